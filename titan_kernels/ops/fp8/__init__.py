"""The fp8 ops: float8 quantization, the scaled GEMM, the float8 linear layer's training GEMMs and
the float8 grouped GEMM over experts, one concept per module:

  quantize.py    ``titan::fp8_quantize`` (dynamic scaling + saturated cast): ``fp8_quantize``,
                 ``tensorwise_amax``, ``fp8_quantize_from_amax``
  gemm.py        ``titan::fp8_gemm`` (the scaled GEMM, nn.Linear layout): ``fp8_gemm``, ``gemm_backend_name``
  scaled_mm.py   ``torch._scaled_mm`` as fp8_gemm's native (cpu / cuda) implementation: the adapter,
                 its one-time capability probe and CPU timing
  config.py      the recipes as data: ``Float8LinearConfig`` (torchao's shape) and ``RECIPES``
  linear.py      ``titan::fp8_linear`` and its backward: the three GEMMs of a config, one autograd
                 definition, ``fp8_linear``
  grouped_mm.py  ``titan::fp8_grouped_mm`` and its backward (rowwise MoE experts): ``fp8_grouped_mm``

Math: dynamic scaling as in Micikevicius et al. 2022, "FP8 Formats for Deep Learning" (section 4)
and torchao.float8, whose recipe names and meanings we keep (``titan_kernels.reference.fp8`` and
``reference.fp8_grouped_mm`` have the exact formulas; the Triton kernels are in
``titan_kernels.triton``). The module layer (``Float8Linear``) is ``titan_kernels.nn.float8``.

Under DTensor, ``fp8_linear`` and ``fp8_grouped_mm`` run on local shards (rules beside each op);
``fp8_quantize`` and ``fp8_gemm`` have no sharding rule (DTensor refuses
them with an error) because a tensorwise amax would need a collective.
"""
from titan_kernels.ops.fp8.config import (  # noqa: F401
    RECIPES,
    CastConfig,
    Float8GemmConfig,
    Float8LinearConfig,
)
from titan_kernels.ops.fp8.gemm import fp8_gemm, gemm_backend_name  # noqa: F401
from titan_kernels.ops.fp8.grouped_mm import fp8_grouped_mm  # noqa: F401
from titan_kernels.ops.fp8.linear import fp8_linear  # noqa: F401
from titan_kernels.ops.fp8.quantize import fp8_quantize, fp8_quantize_from_amax, tensorwise_amax  # noqa: F401
from titan_kernels.ops.fp8.scaled_mm import scaled_mm_available  # noqa: F401
