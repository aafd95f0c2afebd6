"""aten's own attention kernels as titan backends: each returns its log-sum-exp and has its own backward op.

Backends (all with the contract of ``titan_kernels.reference.attention``: our layouts, bottom-right
causal alignment, out = 0 and lse = -inf for a row with no visible key):
  sdpa_flash      CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``): blocked
                  online softmax, GQA natively, float32 accumulation for half inputs.
                  CUDA: ``aten._scaled_dot_product_flash_attention`` (+ ``_backward``), FlashAttention-2 in aten.
  sdpa_cudnn      CUDA: ``aten._scaled_dot_product_cudnn_attention`` (+ ``_backward``).
  sdpa_efficient  CUDA: ``aten._scaled_dot_product_efficient_attention`` (+ ``_backward``), xFormers' kernel.

None of them keeps a (seq_q x seq_k) tensor for the backward: they save out and lse (O(seq)) and
recompute the probabilities blockwise, as FlashAttention does.

How the cases that the kernels do not take directly are mapped onto them:
- Layout: our (b, s, h, d) tensors are passed as the (b, h, s, d) views aten expects (no copy, unless
  head_dim is strided: the CPU kernel gives wrong values then, so that case is copied).
- Causal with seq_q != seq_k: aten's ``is_causal`` is top-left aligned. With seq_q > seq_k the first
  seq_q - seq_k rows see nothing and the rest are a top-left causal problem of seq_k rows; with
  seq_q < seq_k the CPU kernel gets an additive (seq_q, seq_k) mask (the CUDA kernels refuse the case,
  see ``why_not``).
- Varlen: one dense call per document (the CPU kernel has no packed mode). The loop costs one host
  read of cu_seqlens per call, free on the CPU.
- GQA: the CPU and CUDA flash kernels take n_kv_heads < n_heads as is; cuDNN and efficient get K/V
  repeated per query head and their dK/dV summed over the group.
- v's head_dim different from q/k's (multi-head latent attention, q/k 192 and v 128): cuDNN and
  efficient take it natively (torch's ``can_use_*_attention`` decides per call); aten's CPU flash
  kernel refuses it ("Q/K/V should have the same head size"), so the narrower of q/k and v is
  zero-padded to the wider head_dim (no score changes; out = [out, 0], the extra columns dropped; the
  backward pads out and dout alike and drops the gradients' extra columns). That is the kernel's only way; its cost is measured in bench/bench_attention_cpu.py
  (P V over 192 columns instead of 128). CUDA's flash kernel refuses it (``why_not``).
- A gradient for the LSE (ring attention): d lse_i / d S_ij = P_ij adds dlse_i * P_ij to dS_ij. The
  backward kernels take no dlse, so it rides in one extra head_dim column: q' = [q, 0], k' = [k, 0],
  v' = [v, 1], out' = [out, 0], dout' = [dout, dlse]. The kernel's dP'_ij = dout_i.v_j + dlse_i and its
  delta_i = dout'_i.out'_i = dout_i.out_i, so dS = P (dP - delta + dlse): exactly the gradient with the
  LSE term; the scores are unchanged (the extra q/k column is 0, the scale is passed explicitly).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

aten = torch.ops.aten
# torch's own binding skips the Python OpOverloadPacket of torch.ops.aten: 5 us of an 8 us small call.
_cpu_flash = getattr(torch, "_scaled_dot_product_flash_attention_for_cpu",
                     aten._scaled_dot_product_flash_attention_for_cpu)


# ----------------------------------------------------------------------------- shared pieces


def _bhsd(t: torch.Tensor) -> torch.Tensor:
    # (b, s, h, d) <-> (b, h, s, d), a view. head_dim must have unit stride: aten's CPU flash kernel
    # silently returns wrong values for a strided head_dim (seen on torch 2.13), so such inputs are copied.
    t = t.transpose(1, 2)
    return t if t.stride(-1) == 1 else t.contiguous()


def _bottom_right_mask(sq: int, sk: int, dtype: torch.dtype, device) -> torch.Tensor:
    # Additive mask for seq_q < seq_k: query i sees key j when j <= i + sk - sq (every row sees a key).
    i = torch.arange(sq, device=device).unsqueeze(1)
    j = torch.arange(sk, device=device).unsqueeze(0)
    return torch.zeros((sq, sk), dtype=dtype, device=device).masked_fill(j > i + (sk - sq), float("-inf"))


def _empty_rows(sq: int, sk: int, causal: bool) -> int:
    """Leading query rows that see no key (causal, bottom-right, seq_q > seq_k)."""
    return sq - sk if causal and sq > sk else 0


def _pad_col(t: torch.Tensor, value) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return torch.cat([t, value.to(t.dtype).unsqueeze(-1)], -1)
    return F.pad(t, (0, 1), value=value)


def _zeros_like(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in ts)


# ----------------------------------------------------------------------------- CPU flash kernel


def _pad_to(t: torch.Tensor, d: int) -> torch.Tensor:
    # aten's CPU kernel needs one head_dim for q, k and v: zero columns change no score (q.k) and give
    # out = [out, 0] (see the module doc).
    return t if t.shape[-1] == d else F.pad(t, (0, d - t.shape[-1]))


def _cpu_dense_fwd(q, k, v, causal: bool, scale: float):
    dv = v.shape[-1]
    if dv != q.shape[-1]:  # multi-head latent attention (q/k 192, v 128): the kernel's only way is padding
        d = max(dv, q.shape[-1])
        out, lse = _cpu_dense_fwd(_pad_to(q, d), _pad_to(k, d), _pad_to(v, d), causal, scale)
        return out[..., :dv], lse
    sq, sk = q.shape[1], k.shape[1]
    if (sq == sk or not causal) and ((q.is_contiguous() and k.is_contiguous() and v.is_contiguous())
                                     or (q.stride()[-1] == 1 and k.stride()[-1] == 1 and v.stride()[-1] == 1)):
        # The common case, kept short (it is most of a small call's cost): no empty rows, no mask.
        o, lse = _cpu_flash(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, scale=scale)
        return o.transpose(1, 2), lse
    b, h = q.shape[0], q.shape[2]
    skip = _empty_rows(sq, sk, causal)
    out = q.new_zeros(q.shape) if skip else None
    lse = q.new_full((b, h, sq), float("-inf"), dtype=torch.float32) if skip else None
    qs = q[:, skip:] if skip else q
    mask, is_causal = None, causal
    if causal and qs.shape[1] < sk:
        mask, is_causal = _bottom_right_mask(qs.shape[1], sk, q.dtype, q.device), False
    o, l = _cpu_flash(_bhsd(qs), _bhsd(k), _bhsd(v), 0.0, is_causal, attn_mask=mask, scale=scale)
    if not skip:
        return _bhsd(o), l
    out[:, skip:] = _bhsd(o)
    lse[:, :, skip:] = l
    return out, lse


def _cpu_dense_bwd(dout, q, k, v, out, lse, causal: bool, scale: float, dlse=None):
    b, sq, h, d = q.shape
    dv = v.shape[-1]
    if dv != d:  # padded as in the forward (out and dout too); the gradients' extra columns dropped
        p = max(d, dv)
        dq, dk, dv_ = _cpu_dense_bwd(_pad_to(dout, p), _pad_to(q, p), _pad_to(k, p), _pad_to(v, p), _pad_to(out, p),
                                     lse, causal, scale, dlse)
        return dq[..., :d], dk[..., :d], dv_[..., :dv]
    sk = k.shape[1]
    skip = _empty_rows(sq, sk, causal)
    if skip:  # the empty rows have no gradient; the kernel sees only the rows that see a key
        dout, q, out, lse = dout[:, skip:], q[:, skip:], out[:, skip:], lse[:, :, skip:]
        dlse = None if dlse is None else dlse[:, :, skip:]
    mask, is_causal = None, causal
    if causal and q.shape[1] < sk:
        mask, is_causal = _bottom_right_mask(q.shape[1], sk, q.dtype, q.device), False
    if dlse is not None:  # the LSE gradient rides in an extra column (module docstring)
        q, k, out = _pad_col(q, 0.0), _pad_col(k, 0.0), _pad_col(out, 0.0)
        v = _pad_col(v, 1.0)
        dout = _pad_col(dout, dlse.transpose(1, 2))
    dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse.contiguous(), 0.0, is_causal,
        attn_mask=mask, scale=scale)
    dq, dk, dv = _bhsd(dq), _bhsd(dk), _bhsd(dv)
    if dlse is not None:
        dq, dk, dv = dq[..., :d], dk[..., :d], dv[..., :d]
    if skip:
        dq = torch.cat([dq.new_zeros((b, skip, h, d)), dq], 1)
    return dq, dk, dv


def _per_document(dense, q, k, v, cu_q, cu_k, causal, scale):
    """Varlen forward as one dense call per document: out (total_q, h, dv), lse (h, total_q)."""
    out = q.new_zeros((*q.shape[:-1], v.shape[-1]))
    lse = q.new_full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for q0, q1, k0, k1 in zip(cq[:-1], cq[1:], ck[:-1], ck[1:]):
        if q1 > q0 and k1 > k0:
            o, l = dense(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal, scale)
            out[q0:q1], lse[:, q0:q1] = o[0], l[0]
    return out, lse


def _per_document_bwd(dense_bwd, dout, q, k, v, out, lse, cu_q, cu_k, causal, scale, dlse):
    dq, dk, dv = _zeros_like(q, k, v)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for q0, q1, k0, k1 in zip(cq[:-1], cq[1:], ck[:-1], ck[1:]):
        if q1 > q0 and k1 > k0:
            g = dense_bwd(dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], out[None, q0:q1],
                          lse[None, :, q0:q1], causal, scale, None if dlse is None else dlse[None, :, q0:q1])
            dq[q0:q1], dk[k0:k1], dv[k0:k1] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv


def cpu_flash_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    """aten's CPU flash kernel: dense or varlen (per document), with its own LSE."""
    if cu_q is None:
        return _cpu_dense_fwd(q, k, v, causal, scale)
    return _per_document(_cpu_dense_fwd, q, k, v, cu_q, cu_k, causal, scale)


def cpu_flash_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, dlse=None):
    """aten's CPU flash backward kernel (dlse folded in, see the module docstring)."""
    if cu_q is None:
        return _cpu_dense_bwd(dout, q, k, v, out, lse, causal, scale, dlse)
    return _per_document_bwd(_cpu_dense_bwd, dout, q, k, v, out, lse, cu_q, cu_k, causal, scale, dlse)


# ----------------------------------------------------------------------------- CUDA kernels
# Dense only, and causal only with seq_q == seq_k (their is_causal is top-left and the flash kernel
# takes no mask); ``why_not`` routes the other cases elsewhere. Dropout is 0, so the philox
# seed/offset that the backward ops take are never read: placeholders of the forward's shapes.


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


def cuda_flash_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    r = aten._scaled_dot_product_flash_attention(_bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, False, scale=scale)
    return _bhsd(r[0]), r[1]


def cuda_flash_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, dlse=None):
    seed = torch.zeros((2,), dtype=torch.uint64, device=q.device)
    offset = torch.zeros((), dtype=torch.uint64, device=q.device)
    dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
        _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse.contiguous(), None, None, q.shape[1], k.shape[1],
        0.0, causal, seed, offset, scale=scale)
    return _bhsd(dq), _bhsd(dk), _bhsd(dv)


def cuda_cudnn_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    kr, vr = _repeat_kv(q, k, v)
    r = aten._scaled_dot_product_cudnn_attention(_bhsd(q), _bhsd(kr), _bhsd(vr), None, True, 0.0, causal, False,
                                                 scale=scale)
    return _bhsd(r[0]), r[1].squeeze(-1)  # cuDNN's LSE is (b, h, s, 1)


def cuda_cudnn_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, dlse=None):
    kr, vr = _repeat_kv(q, k, v)
    seed, offset = _philox(q.device)
    dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
        _bhsd(dout), _bhsd(q), _bhsd(kr), _bhsd(vr), _bhsd(out), lse.unsqueeze(-1).contiguous(), seed, offset, None,
        None, None, q.shape[1], k.shape[1], 0.0, causal, scale=scale)
    dk, dv = _sum_groups(_bhsd(dk), _bhsd(dv), k.shape[2])
    return _bhsd(dq), dk, dv


def cuda_efficient_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    kr, vr = _repeat_kv(q, k, v)
    r = aten._scaled_dot_product_efficient_attention(_bhsd(q), _bhsd(kr), _bhsd(vr), None, True, 0.0, causal,
                                                     scale=scale)
    return _bhsd(r[0]), r[1][..., : q.shape[1]]  # the kernel pads the LSE's rows to a multiple of 32


def cuda_efficient_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, dlse=None):
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
