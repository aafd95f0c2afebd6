"""Attention: ``titan_kernels.flash_attn`` / ``flash_attn_varlen`` on the fastest backend that takes the case.

  api.py        the public functions: validation, the call's ``AttentionArgs`` record
  op.py         the ``titan::flash_attn`` ops, their one autograd definition, running one backend
  dispatch.py   the backends, the automatic order per device (measured), overrides, capability cache
  sinks.py      attention sinks as an exact epilogue on any backend's (out, lse)
  aten.py       aten's flash / cuDNN / efficient / CPU-flash kernels, with their own LSE and backward ops
                (windows and chunks on the CPU kernel by query-block decomposition)
  blockwise.py  the CPU path for what aten's kernel lacks (soft-capping, v's own head_dim): an
                online-softmax over query blocks in PyTorch ops, O(block * seq) memory
  flash_lib.py  the FlashAttention-2 / -3 libraries
  validate.py   argument checks
The mask's definition and the ``AttentionArgs`` record live in ``titan_kernels.attention_mask``.
"""
from titan_kernels.ops.attention.dispatch import (  # noqa: F401
    ATTENTION_BACKENDS, AttentionCase, AttentionChoice, choose_backend, clear_caches,
)
from titan_kernels.ops.attention.api import attention_backend, flash_attn, flash_attn_varlen  # noqa: F401
from titan_kernels.ops.attention.sinks import apply_attention_sinks, attention_sinks_grad  # noqa: F401
from titan_kernels.ops.attention.validate import MAX_HEAD_DIM  # noqa: F401
