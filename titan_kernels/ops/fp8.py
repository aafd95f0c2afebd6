"""Float8 ops: the public face of the family, where its callers import it.

  fp8_quantize_gemm.py  ``titan::fp8_quantize`` (dynamic scaling + saturated cast) and ``titan::fp8_gemm``
                        (the scaled GEMM): validation, backends, fake, public ``fp8_quantize``, ``fp8_gemm``,
                        ``tensorwise_amax``, ``fp8_quantize_from_amax``, ``gemm_backend_name``
  fp8_scaled_mm.py      ``torch._scaled_mm`` as fp8_gemm's native (cpu / cuda) implementation: the adapter,
                        its one-time capability probe and CPU timing
  fp8_linear.py         ``titan::fp8_linear`` and its backward, the training GEMM triple of a linear layer
                        per recipe (the recipe table: tensorwise, rowwise, rowwise_with_gw_hp), its one
                        autograd definition, public ``fp8_linear``

Math: dynamic scaling as in Micikevicius et al. 2022, "FP8 Formats for Deep Learning" (section 4)
and torchao.float8, whose recipe names and meanings ``fp8_linear`` keeps
(``titan_kernels.reference.fp8`` has the exact formulas).

Under DTensor, ``fp8_linear`` runs on local shards (rules in ``titan_kernels.dtensor``); ``fp8_quantize``
and ``fp8_gemm`` have no sharding rule (DTensor refuses them with an error) because a tensorwise amax
would need a collective.
"""
from titan_kernels.ops.fp8_linear import (  # noqa: F401
    RECIPES,
    _rows,
    _unflatten,
    fp8_linear,
    fp8_linear_backward_op,
    fp8_linear_op,
    linear_bwd,
    linear_bwd_prequantized,
    linear_fwd,
    refuse_double_backward,
    request_context,
)
from titan_kernels.ops.fp8_quantize_gemm import (  # noqa: F401
    E4M3,
    E5M2,
    FP8_DTYPES,
    FP8_MAX,
    GRANULARITIES,
    OP_GEMM,
    OP_QUANT,
    OUT_DTYPES,
    fp8_gemm,
    fp8_gemm_op,
    fp8_quantize,
    fp8_quantize_from_amax,
    fp8_quantize_op,
    gemm_backend_name,
    tensorwise_amax,
)
from titan_kernels.ops.fp8_scaled_mm import scaled_mm_available, scaled_mm_gemm  # noqa: F401
