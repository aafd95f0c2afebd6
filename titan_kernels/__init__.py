"""Titan Kernels: fused ops for LLM pre-training as ``torch.ops.titan.*`` custom ops.

Public API (each op has a reference, a Triton and, where built, a C++/CUDA implementation):
  rms_norm, add_rms_norm            fused RMSNorm (+ residual add)
  apply_rotary_emb, rope_cos_sin    rotary position embedding (q and k in one kernel)
  swiglu                            silu(gate) * up (or GPT-OSS's clamped variant), fwd and bwd in one kernel each
  fp8_quantize, fp8_gemm, fp8_linear  float8 cast (tensorwise/rowwise/colwise), scaled GEMM, linear
  flash_attn, flash_attn_varlen      attention (FA3 > FA2 > Triton > SDPA; causal, sliding windows, sinks,
                                    soft-capping, chunks, GQA, varlen, v's own head_dim, LSE)
  attention_backend                 which attention backend would run, and why
  unmasked_score_count              the (query, key) scores a mask leaves (windows, chunks), for FLOPs
  linear_cross_entropy              fused output projection + cross-entropy (chunked; vocab-parallel under TP)
  grouped_mm                        grouped GEMM over experts (MoE), forward and backward
  fp8_grouped_mm                    the same in float8 (rowwise e4m3 scaling, the MoE float8 recipe)
  moe_permute, moe_unpermute        MoE tokens to expert order (padded groups) and back, weighted by scores
  fused_adamw_                      AdamW over a list of tensors in one pass (fp32/bf16 states, stochastic rounding)
  newton_schulz                     Muon's orthogonalisation of (batches of) matrices
  use_backend, available_backends   choose / inspect implementations
  enable_triton_op                  register rms_norm's triton_op variant (Inductor traces into it)
  capture_request                   the backend request in force for an op, to hand to its backward
  requested_backend                 the request in force (use_backend, else TITAN_KERNELS_BACKEND; a bad
                                    value raises ValueError naming it)
  patch                             swap PyTorch modules in a model for ours
  nn                                drop-in modules (RMSNorm, Float8Linear + convert_to_float8, ...)

What a model or a parallel layer built on the ops needs (the trainer's ring attention, MLA, Muon):
  AttentionArgs                     one attention call's non-tensor arguments as one record (the mask)
  check_window, check_chunk, check_softcap   validate flash_attn's mask arguments (errors name them)
  apply_attention_sinks, attention_sinks_grad  sinks as an exact epilogue on any (out, lse) and its
                                    gradient (ring attention applies it after merging its blocks)
  rope_type, yarn_mscale            the rotary scaling's kind and YaRN's attention temperature
  newton_schulz_flops               the FLOPs of newton_schulz on an m x n matrix

Everything else (``titan_kernels.ops``, ``backend``, ``reference``, ``triton``) is the library's inside:
the trainer imports none of it (tests/test_import_graph.py). The triton_op variant of rms_norm is not
imported here (it imports Inductor): ``TITAN_KERNELS_TRITON_OP=1`` or ``enable_triton_op()`` registers it.
"""
from titan_kernels.backend import available_backends, capture_request, requested_backend, use_backend  # noqa: F401
from titan_kernels.ops.rms_norm import add_rms_norm, rms_norm  # noqa: F401
from titan_kernels.ops.triton_op import enable_triton_op  # noqa: F401
from titan_kernels.ops.rotary import apply_rotary_emb, rope_cos_sin  # noqa: F401
from titan_kernels.ops.rope_tables import rope_type, yarn_mscale  # noqa: F401
from titan_kernels.ops.swiglu import swiglu  # noqa: F401
from titan_kernels.ops.fp8 import fp8_gemm, fp8_grouped_mm, fp8_linear, fp8_quantize  # noqa: F401
from titan_kernels.ops.attention import attention_backend, flash_attn, flash_attn_varlen  # noqa: F401
from titan_kernels.ops.attention import apply_attention_sinks, attention_sinks_grad  # noqa: F401
from titan_kernels.attention_mask import (  # noqa: F401
    AttentionArgs, check_chunk, check_softcap, check_window, unmasked_score_count,
)
from titan_kernels.ops.cross_entropy import linear_cross_entropy  # noqa: F401
from titan_kernels.ops.grouped_mm import grouped_mm  # noqa: F401
from titan_kernels.ops.moe_permute import MoERouting, moe_permute, moe_routing, moe_unpermute  # noqa: F401
from titan_kernels.ops.fused_adamw import fused_adamw_  # noqa: F401
from titan_kernels.ops.newton_schulz import newton_schulz  # noqa: F401
from titan_kernels.reference.newton_schulz import newton_schulz_flops  # noqa: F401
from titan_kernels import nn  # noqa: F401
from titan_kernels.patch import patch  # noqa: F401
from titan_kernels.ops import triton_op as _triton_op

_triton_op.enable_from_environment()
