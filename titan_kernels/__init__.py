"""Titan Kernels: fused ops for LLM pre-training as ``torch.ops.titan.*`` custom ops.

Public API (each op has a reference, a Triton and, where built, a C++/CUDA implementation):
  rms_norm, add_rms_norm            fused RMSNorm (+ residual add)
  apply_rotary_emb, rope_cos_sin    rotary position embedding
  use_backend, available_backends   choose / inspect implementations
  patch                             swap PyTorch modules in a model for ours
"""
from titan_kernels.backend import available_backends, use_backend  # noqa: F401
