"""Attention: ``titan_kernels.flash_attn`` / ``flash_attn_varlen`` on the fastest backend that takes the case.

  dispatch.py   the backends, the automatic order per device (measured), overrides, capability cache
  aten.py       aten's flash / cuDNN / efficient / CPU-flash kernels, with their own LSE and backward ops
  flash_lib.py  the FlashAttention-2 / -3 libraries
  validate.py   argument checks
  op.py         the ``titan::flash_attn`` ops, their one autograd definition, the public functions
"""
from titan_kernels.ops.attention.dispatch import (  # noqa: F401
    ATTENTION_BACKENDS, AttentionCase, AttentionChoice, choose_backend, clear_caches,
)
from titan_kernels.ops.attention.op import attention_backend, flash_attn, flash_attn_varlen  # noqa: F401
from titan_kernels.ops.attention.validate import MAX_HEAD_DIM  # noqa: F401
