"""Scaled dot-product attention in plain PyTorch, float32 math (FlashAttention's contract), with every
variant: sliding windows, chunks, soft-capping, v's head_dim different from q/k's.

(float64 inputs are computed in float64, which lets ``torch.autograd.gradcheck`` test the backward.)

Math (Vaswani et al. 2017, eq. 1; the softmax statistics and backward of Dao et al. 2022,
"FlashAttention", Alg. 2 and appendix B.2), for one (batch, head) and scale c:
    S = c * Q K^T;  with softcap a: T = tanh(S / a), S = a * T  (Gemma 2's soft-capping)
    S_ij = -inf where key j is hidden from query i (``titan_kernels.attention_mask``)
    lse_i = log sum_j exp(S_ij),   P = exp(S - lse),   O = P V
Backward, with delta_i = sum_d dO_id * O_id:
    dV = P^T dO,   dP = dO V^T,   dS = P * (dP - delta),   (softcap: dS *= 1 - T^2)
    dQ = c * dS K,   dK = c * dS^T Q
A gradient dlse for the LSE adds P_ij * dlse_i to dS_ij (d lse_i / d S_ij = P_ij): delta -= dlse.
Sinks are not computed here: the op applies them to any backend's (out, lse) (``sinks.py``).

A query row that sees no key has O = 0 and lse = -inf. GQA/MQA: query head h reads K/V head
``h // (n_heads // n_kv_heads)``; K and V are broadcast through a view, never repeated in memory;
dK and dV sum over the query heads of their group.

Layouts (shared with every backend); v's head_dim (head_dim_v) may differ from q/k's, and out has v's:
  dense:  q (batch, seq_q, n_heads, head_dim), k (batch, seq_k, n_kv_heads, head_dim),
          v (batch, seq_k, n_kv_heads, head_dim_v), out (batch, seq_q, n_heads, head_dim_v), lse (batch, n_heads, seq_q)
  varlen: q (total_q, n_heads, head_dim), k (total_k, n_kv_heads, head_dim), v (total_k, n_kv_heads, head_dim_v),
          out (total_q, n_heads, head_dim_v), lse (n_heads, total_q),
          documents delimited by int32 ``cu_seqlens_q`` / ``cu_seqlens_k`` of length n_docs + 1.
"""
from __future__ import annotations

import torch

from titan_kernels.attention_mask import AttentionArgs


def _acc(t: torch.Tensor) -> torch.Tensor:
    # float32 math for half inputs; float64 stays float64 (so gradcheck can test this module).
    return t.to(torch.promote_types(t.dtype, torch.float32))


def seen(p: torch.Tensor, j: torch.Tensor, a: AttentionArgs) -> torch.Tensor:
    """True where the query at position p sees key j (int tensors that broadcast; the definition of
    ``titan_kernels.attention_mask``)."""
    m = torch.ones(torch.broadcast_shapes(p.shape, j.shape), dtype=torch.bool, device=p.device)
    if a.left >= 0:
        m &= j >= p - a.left
    if a.right >= 0:
        m &= j <= p + a.right
    if a.chunk > 0:
        m &= torch.div(j, a.chunk, rounding_mode="floor") == torch.div(p, a.chunk, rounding_mode="floor")
    return m


def visible(seq_q: int, seq_k: int, a: AttentionArgs, device=None):
    """(seq_q, seq_k) bool, True where query i sees key j (positions aligned bottom-right); None when
    nothing is masked."""
    if a.left < 0 and a.right < 0 and a.chunk == 0:
        return None
    p = torch.arange(seq_q, device=device).unsqueeze(1) + (seq_k - seq_q)
    return seen(p, torch.arange(seq_k, device=device).unsqueeze(0), a)


def _scores(q: torch.Tensor, k: torch.Tensor, a: AttentionArgs):
    """(masked scores, tanh of the soft-capped scores or None), each (b, n_kv_heads, group, seq_q, seq_k)."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    qg = _acc(q).reshape(b, sq, hkv, h // hkv, d).permute(0, 2, 3, 1, 4)
    kt = _acc(k).permute(0, 2, 3, 1).unsqueeze(2)  # (b, hkv, 1, d, sk): broadcast over the group
    s = torch.matmul(qg, kt) * a.scale
    t = None
    if a.softcap > 0:
        t = torch.tanh(s / a.softcap)
        s = a.softcap * t
    m = visible(sq, sk, a, q.device)
    if m is not None:
        s = s.masked_fill(~m, float("-inf"))
    return s, t


def _probs(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    # Rows with no visible key have lse = -inf: their probabilities are 0, not exp(-inf + inf) = nan.
    lse = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse)
    return torch.exp(s - lse.unsqueeze(-1))


def _dense_fwd(q, k, v, a):
    b, sq, h, _ = q.shape
    s, _ = _scores(q, k, a)
    lse = torch.logsumexp(s, dim=-1)  # -inf for a row with no visible key (and for seq_k == 0)
    p = _probs(s, lse)
    o = torch.matmul(p, _acc(v).permute(0, 2, 1, 3).unsqueeze(2))  # (b, hkv, g, sq, dv)
    out = o.permute(0, 3, 1, 2, 4).reshape(b, sq, h, v.shape[-1]).to(q.dtype)
    return out, lse.reshape(b, h, sq)


def _dense_bwd(dout, q, k, v, out, lse, dlse, a):
    b, sq, h, d = q.shape
    hkv, dv = k.shape[2], v.shape[-1]
    g = h // hkv
    s, t = _scores(q, k, a)
    p = _probs(s, _acc(lse).reshape(b, hkv, g, sq))
    do = _acc(dout).reshape(b, sq, hkv, g, dv).permute(0, 2, 3, 1, 4)  # (b, hkv, g, sq, dv)
    delta = (_acc(dout) * _acc(out)).sum(-1).reshape(b, sq, hkv, g).permute(0, 2, 3, 1)
    if dlse is not None:
        delta = delta - _acc(dlse).reshape(b, hkv, g, sq)
    vf = _acc(v).permute(0, 2, 1, 3).unsqueeze(2)  # (b, hkv, 1, sk, dv)
    dp = torch.matmul(do, vf.transpose(-1, -2))
    ds = p * (dp - delta.unsqueeze(-1))
    if t is not None:
        ds = ds * (1 - t * t)
    qg = _acc(q).reshape(b, sq, hkv, g, d).permute(0, 2, 3, 1, 4)
    dq = torch.matmul(ds, _acc(k).permute(0, 2, 1, 3).unsqueeze(2)) * a.scale
    dk = torch.matmul(ds.transpose(-1, -2), qg).sum(2) * a.scale  # sum over the query heads of the group
    dvv = torch.matmul(p.transpose(-1, -2), do).sum(2)
    dq = dq.permute(0, 3, 1, 2, 4).reshape(b, sq, h, d)
    return dq.to(q.dtype), dk.permute(0, 2, 1, 3).to(k.dtype), dvv.permute(0, 2, 1, 3).to(v.dtype)


def doc_bounds(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """[(q0, q1, k0, k1)] per document (one host read of the offsets)."""
    cq = cu_seqlens_q.tolist()
    ck = cu_seqlens_k.tolist()
    return list(zip(cq[:-1], cq[1:], ck[:-1], ck[1:]))


def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor | None,
                  cu_seqlens_k: torch.Tensor | None, a: AttentionArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward -> (out in q.dtype, lse float32, natural log); layouts in the module doc.

    Dense when ``cu_seqlens_q`` is None, else varlen (``a.max_q`` / ``a.max_k`` are unused here: they
    size the kernels' grids). Inputs are validated by ``titan_kernels.ops.attention``.
    """
    if cu_seqlens_q is None:
        return _dense_fwd(q, k, v, a)
    out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=_acc(q[:0]).dtype, device=q.device)
    for q0, q1, k0, k1 in doc_bounds(cu_seqlens_q, cu_seqlens_k):
        if q1 == q0:
            continue
        o, l = _dense_fwd(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], a)
        out[q0:q1] = o[0]
        lse[:, q0:q1] = l[0]
    return out, lse


def attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, dlse: torch.Tensor | None, cu_seqlens_q: torch.Tensor | None,
                  cu_seqlens_k: torch.Tensor | None, a: AttentionArgs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention backward from the forward's ``out`` and ``lse``: (dq, dk, dv) shaped and typed like
    (q, k, v); math in float32. Layouts as ``attention_fwd``; dout may have any strides. ``dlse`` (the
    LSE's shape, or None) is a gradient for the LSE output."""
    if cu_seqlens_q is None:
        return _dense_bwd(dout, q, k, v, out, lse, dlse, a)
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    for q0, q1, k0, k1 in doc_bounds(cu_seqlens_q, cu_seqlens_k):
        if q1 == q0 or k1 == k0:
            continue  # no query or no key: every gradient of the document is 0
        g = _dense_bwd(dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], out[None, q0:q1],
                       lse[None, :, q0:q1], None if dlse is None else dlse[None, :, q0:q1], a)
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv
