"""Drop-in modules built on the titan ops.

  norm.py               RMSNorm (``torch.nn.RMSNorm``-compatible), AddRMSNorm (fused with the residual add)
  rotary.py             RotaryEmbedding
  float8.py             Float8Linear and convert_to_float8 (the float8 recipes: ``Float8LinearConfig``), the
                        size filter (too_small_for_float8; module_filter: torchtitan's filter_fqns and
                        auto_filter_small_kgemms as convert_to_float8's module_filter_fn)
  float8_all_gather.py  the FSDP2 float8 all-gather of a Float8Linear weight
"""
from titan_kernels.nn.float8 import Float8Linear, convert_to_float8, module_filter, too_small_for_float8  # noqa: F401
from titan_kernels.nn.norm import AddRMSNorm, RMSNorm  # noqa: F401
from titan_kernels.nn.rotary import RotaryEmbedding  # noqa: F401
from titan_kernels.ops.fp8.config import RECIPES, CastConfig, Float8GemmConfig, Float8LinearConfig  # noqa: F401
