"""aten's own attention kernels as titan backends: each returns its log-sum-exp and has its own backward op.

Backends (all with the contract of ``titan_kernels.reference.attention``: our layouts, bottom-right
causal alignment, out = 0 and lse = -inf for a row with no visible key):
  sdpa_flash      CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``), in
                  ``aten_cpu.py`` (windows and chunks by query-block decomposition there).
                  CUDA: ``aten._scaled_dot_product_flash_attention`` (+ ``_backward``), FlashAttention-2 in aten.
  sdpa_cudnn      CUDA: ``aten._scaled_dot_product_cudnn_attention`` (+ ``_backward``).
  sdpa_efficient  CUDA: ``aten._scaled_dot_product_efficient_attention`` (+ ``_backward``), xFormers' kernel.

None of them keeps a (seq_q x seq_k) tensor for the backward: they save out and lse (O(seq)) and
recompute the probabilities blockwise, as FlashAttention does.

The CUDA kernels take dense batches, full or causal with seq_q == seq_k (their is_causal is top-left
and the flash kernel takes no mask), no soft-capping and no LSE gradient; ``dispatch.why_not`` routes
the other cases elsewhere (FlashAttention, Triton). Layout: our (b, s, h, d) tensors are passed as
the (b, h, s, d) views aten expects. GQA: the flash kernel takes n_kv_heads < n_heads as is; cuDNN
and efficient get K/V repeated per query head and their dK/dV summed over the group. v's head_dim
different from q/k's: cuDNN and efficient take it natively (torch's ``can_use_*_attention`` decides
per call); the flash kernel refuses it. Dropout is 0, so the philox seed/offset that the backward ops
take are never read: placeholders of the forward's shapes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from titan_kernels.attention_mask import AttentionArgs
from titan_kernels.ops.attention.aten_cpu import _bhsd, cpu_flash_bwd, cpu_flash_fwd

aten = torch.ops.aten


# ----------------------------------------------------------------------------- CUDA kernels


def _philox(device):
    return torch.zeros((), dtype=torch.int64, device=device), torch.zeros((), dtype=torch.int64, device=device)


def _repeat_kv(q, k, v):
    g = q.shape[2] // k.shape[2]
    if g == 1:
        return k, v
    return k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)


def _sum_groups(dk, dv, n_kv_heads):
    b, s, h, d = dk.shape
    if h == n_kv_heads:
        return dk, dv
    g = h // n_kv_heads
    return dk.view(b, s, n_kv_heads, g, d).sum(3), dv.view(b, s, n_kv_heads, g, dv.shape[-1]).sum(3)


def cuda_flash_fwd(q, k, v, cu_q, cu_k, a: AttentionArgs):
    causal, scale = a.causal, a.scale
    r = aten._scaled_dot_product_flash_attention(_bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, False, scale=scale)
    return _bhsd(r[0]), r[1]


def cuda_flash_bwd(dout, q, k, v, out, lse, dlse, cu_q, cu_k, a: AttentionArgs):
    causal, scale = a.causal, a.scale
    seed = torch.zeros((2,), dtype=torch.uint64, device=q.device)
    offset = torch.zeros((), dtype=torch.uint64, device=q.device)
    dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
        _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse.contiguous(), None, None, q.shape[1], k.shape[1],
        0.0, causal, seed, offset, scale=scale)
    return _bhsd(dq), _bhsd(dk), _bhsd(dv)


def cuda_cudnn_fwd(q, k, v, cu_q, cu_k, a: AttentionArgs):
    causal, scale = a.causal, a.scale
    kr, vr = _repeat_kv(q, k, v)
    r = aten._scaled_dot_product_cudnn_attention(_bhsd(q), _bhsd(kr), _bhsd(vr), None, True, 0.0, causal, False,
                                                 scale=scale)
    return _bhsd(r[0]), r[1].squeeze(-1)  # cuDNN's LSE is (b, h, s, 1)


def cuda_cudnn_bwd(dout, q, k, v, out, lse, dlse, cu_q, cu_k, a: AttentionArgs):
    causal, scale = a.causal, a.scale
    kr, vr = _repeat_kv(q, k, v)
    seed, offset = _philox(q.device)
    dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
        _bhsd(dout), _bhsd(q), _bhsd(kr), _bhsd(vr), _bhsd(out), lse.unsqueeze(-1).contiguous(), seed, offset, None,
        None, None, q.shape[1], k.shape[1], 0.0, causal, scale=scale)
    dk, dv = _sum_groups(_bhsd(dk), _bhsd(dv), k.shape[2])
    return _bhsd(dq), dk, dv


def cuda_efficient_fwd(q, k, v, cu_q, cu_k, a: AttentionArgs):
    causal, scale = a.causal, a.scale
    kr, vr = _repeat_kv(q, k, v)
    r = aten._scaled_dot_product_efficient_attention(_bhsd(q), _bhsd(kr), _bhsd(vr), None, True, 0.0, causal,
                                                     scale=scale)
    return _bhsd(r[0]), r[1][..., : q.shape[1]]  # the kernel pads the LSE's rows to a multiple of 32


def cuda_efficient_bwd(dout, q, k, v, out, lse, dlse, cu_q, cu_k, a: AttentionArgs):
    causal, scale = a.causal, a.scale
    kr, vr = _repeat_kv(q, k, v)
    seed, offset = _philox(q.device)
    sq = q.shape[1]
    lse_padded = F.pad(lse, (0, -sq % 32)).contiguous()
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        _bhsd(dout), _bhsd(q), _bhsd(kr), _bhsd(vr), None, _bhsd(out), lse_padded, seed, offset, 0.0,
        [True, True, True, False], causal, scale=scale)
    dk, dv = _sum_groups(_bhsd(dk), _bhsd(dv), k.shape[2])
    return _bhsd(dq), dk, dv


IMPLS = {
    ("sdpa_flash", "cpu"): (cpu_flash_fwd, cpu_flash_bwd),
    ("sdpa_flash", "cuda"): (cuda_flash_fwd, cuda_flash_bwd),
    ("sdpa_cudnn", "cuda"): (cuda_cudnn_fwd, cuda_cudnn_bwd),
    ("sdpa_efficient", "cuda"): (cuda_efficient_fwd, cuda_efficient_bwd),
}
