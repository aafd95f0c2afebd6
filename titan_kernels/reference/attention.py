"""Scaled dot-product attention in plain PyTorch, float32 math (FlashAttention's contract).

(float64 inputs are computed in float64, which lets ``torch.autograd.gradcheck`` test the backward.)

Math (Vaswani et al. 2017, eq. 1; the softmax statistics and backward of Dao et al. 2022,
"FlashAttention", Alg. 2 and appendix B.2), for one (batch, head) and scale c:
    S = c * Q K^T,   S_ij = -inf where key j is hidden from query i
    lse_i = log sum_j exp(S_ij),   P = exp(S - lse),   O = P V
Backward, with delta_i = sum_d dO_id * O_id:
    dV = P^T dO,   dP = dO V^T,   dS = P * (dP - delta),   dQ = c * dS K,   dK = c * dS^T Q
A gradient dlse for the LSE adds P_ij * dlse_i to dS_ij (d lse_i / d S_ij = P_ij): delta -= dlse.

Masking, as FlashAttention >= 2.1: with ``causal``, query i sees key j when ``j <= i + seq_k - seq_q``
(aligned bottom-right). A query row that sees no key has O = 0 and lse = -inf.

GQA/MQA: query head h reads K/V head ``h // (n_heads // n_kv_heads)``. K and V are broadcast through
a view, never repeated in memory; dK and dV sum over the query heads of their group.

Layouts (shared with ``titan_kernels.triton.flash_attn``); v's head_dim (head_dim_v) may differ from
q/k's (multi-head latent attention), and out has v's:
  dense:  q (batch, seq_q, n_heads, head_dim), k (batch, seq_k, n_kv_heads, head_dim),
          v (batch, seq_k, n_kv_heads, head_dim_v), out (batch, seq_q, n_heads, head_dim_v), lse (batch, n_heads, seq_q)
  varlen: q (total_q, n_heads, head_dim), k (total_k, n_kv_heads, head_dim), v (total_k, n_kv_heads, head_dim_v),
          out (total_q, n_heads, head_dim_v), lse (n_heads, total_q),
          documents delimited by int32 ``cu_seqlens_q`` / ``cu_seqlens_k`` of length n_docs + 1.
"""
from __future__ import annotations

import torch


def _acc(t: torch.Tensor) -> torch.Tensor:
    # float32 math for half inputs; float64 stays float64 (so gradcheck can test this module).
    return t.to(torch.promote_types(t.dtype, torch.float32))


def causal_mask(seq_q: int, seq_k: int, device: torch.device | str | None = None, diag: int | None = None) -> torch.Tensor:
    """(seq_q, seq_k) bool: True where query i sees key j, i.e. ``j <= i + diag`` with the bottom-right
    ``diag = seq_k - seq_q`` by default (pass another diag for a block of rows of a longer query)."""
    i = torch.arange(seq_q, device=device).unsqueeze(1)
    j = torch.arange(seq_k, device=device).unsqueeze(0)
    return j <= i + (seq_k - seq_q if diag is None else diag)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float, diag: int | None = None) -> torch.Tensor:
    """(b, n_kv_heads, group, seq_q, seq_k) float32 masked scores of a dense batch."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    qg = _acc(q).reshape(b, sq, hkv, h // hkv, d).permute(0, 2, 3, 1, 4)
    kt = _acc(k).permute(0, 2, 3, 1).unsqueeze(2)  # (b, hkv, 1, d, sk): broadcast over the group
    s = torch.matmul(qg, kt) * scale
    if causal:
        s = s.masked_fill(~causal_mask(sq, sk, q.device, diag), float("-inf"))
    return s


def attention_lse(q: torch.Tensor, k: torch.Tensor, causal: bool, softmax_scale: float, chunk: int = 1024) -> torch.Tensor:
    """The LSE alone of a dense batch, (b, n_heads, seq_q) float32, computed over blocks of ``chunk``
    query rows so that memory is O(chunk * seq_k) per head (for backends that return no LSE)."""
    b, sq, h, _ = q.shape
    sk = k.shape[1]
    parts = [
        torch.logsumexp(_scores(q[:, r0:r0 + chunk], k, causal, softmax_scale, r0 + sk - sq), dim=-1)
        for r0 in range(0, sq, chunk)
    ]
    lse = torch.cat(parts, dim=-1) if parts else q.new_empty((b, k.shape[2], h // max(k.shape[2], 1), 0))
    return lse.reshape(b, h, sq).to(torch.promote_types(q.dtype, torch.float32))


def _probs(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    # Rows with no visible key have lse = -inf: their probabilities are 0, not exp(-inf + inf) = nan.
    lse = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse)
    return torch.exp(s - lse.unsqueeze(-1))


def _dense_fwd(q, k, v, causal, scale):
    b, sq, h, _ = q.shape
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)  # -inf for a row with no visible key (and for seq_k == 0)
    p = _probs(s, lse)
    o = torch.matmul(p, _acc(v).permute(0, 2, 1, 3).unsqueeze(2))  # (b, hkv, g, sq, dv)
    out = o.permute(0, 3, 1, 2, 4).reshape(b, sq, h, v.shape[-1]).to(q.dtype)
    return out, lse.reshape(b, h, sq)


def _dense_bwd(dout, q, k, v, out, lse, causal, scale, dlse=None):
    b, sq, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    s = _scores(q, k, causal, scale)
    p = _probs(s, _acc(lse).reshape(b, hkv, g, sq))
    do = _acc(dout).reshape(b, sq, hkv, g, v.shape[-1]).permute(0, 2, 3, 1, 4)  # (b, hkv, g, sq, dv)
    delta = (_acc(dout) * _acc(out)).sum(-1).reshape(b, sq, hkv, g).permute(0, 2, 3, 1)
    if dlse is not None:
        delta = delta - _acc(dlse).reshape(b, hkv, g, sq)
    vf = _acc(v).permute(0, 2, 1, 3).unsqueeze(2)  # (b, hkv, 1, sk, d)
    dp = torch.matmul(do, vf.transpose(-1, -2))
    ds = p * (dp - delta.unsqueeze(-1))
    qg = _acc(q).reshape(b, sq, hkv, g, d).permute(0, 2, 3, 1, 4)
    dq = torch.matmul(ds, _acc(k).permute(0, 2, 1, 3).unsqueeze(2)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qg).sum(2) * scale  # sum over the query heads of the group
    dv = torch.matmul(p.transpose(-1, -2), do).sum(2)
    dq = dq.permute(0, 3, 1, 2, 4).reshape(b, sq, h, d)
    return dq.to(q.dtype), dk.permute(0, 2, 1, 3).to(k.dtype), dv.permute(0, 2, 1, 3).to(v.dtype)


def _doc_bounds(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor):
    cq = cu_seqlens_q.tolist()
    ck = cu_seqlens_k.tolist()
    return list(zip(cq[:-1], cq[1:], ck[:-1], ck[1:]))


def attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward.

    Dense (``cu_seqlens_q is None``): q (b, seq_q, n_heads, d), k/v (b, seq_k, n_kv_heads, d) ->
    out (b, seq_q, n_heads, d) in q.dtype and lse (b, n_heads, seq_q) float32 (natural log).
    Varlen: q (total_q, n_heads, d), k/v (total_k, n_kv_heads, d), cu_seqlens int32 (n_docs + 1,) ->
    out (total_q, n_heads, d) and lse (n_heads, total_q). ``max_seqlen_*`` are unused here (they size
    the kernels' grids). Inputs are validated by ``titan_kernels.ops.attention``.
    """
    if cu_seqlens_q is None:
        return _dense_fwd(q, k, v, causal, softmax_scale)
    out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=_acc(q[:0]).dtype, device=q.device)
    for q0, q1, k0, k1 in _doc_bounds(cu_seqlens_q, cu_seqlens_k):
        if q1 == q0:
            continue
        o, l = _dense_fwd(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal, softmax_scale)
        out[q0:q1] = o[0]
        lse[:, q0:q1] = l[0]
    return out, lse


def attention_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    softmax_scale: float,
    dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention backward from the forward's ``out`` and ``lse``: (dq, dk, dv) shaped and typed like
    (q, k, v); math in float32. Layouts as ``attention_fwd``; dout may have any strides. ``dlse``
    (the LSE's shape) is an optional gradient for the LSE output."""
    if cu_seqlens_q is None:
        return _dense_bwd(dout, q, k, v, out, lse, causal, softmax_scale, dlse)
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    for q0, q1, k0, k1 in _doc_bounds(cu_seqlens_q, cu_seqlens_k):
        if q1 == q0 or k1 == k0:
            continue  # no query or no key: every gradient of the document is 0
        g = _dense_bwd(
            dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], out[None, q0:q1],
            lse[None, :, q0:q1], causal, softmax_scale, None if dlse is None else dlse[None, :, q0:q1],
        )
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv
