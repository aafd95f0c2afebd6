"""The ``blockwise`` attention backend: the CPU path for what aten's CPU kernel lacks (soft-capping;
v's head_dim different from q/k's, natively). Every variant, in PyTorch ops.

Algorithm: the query-block plan of ``blocks.py`` (each piece is query rows with exactly the keys they
can see, so blocks outside a window or chunk are skipped and no partial softmaxes are merged); per
piece, the scores of its (rows x keys) in float32 (float64 for float64 inputs), soft-capped, masked,
their log-sum-exp and P V, as FlashAttention's forward computes them per block (Dao et al. 2022,
Alg. 1, with one key block per piece). The backward recomputes each piece's P from the saved LSE
(FlashAttention's backward, Alg. 2 / appendix B.2): dV = P^T dO, dS = P * (dP - delta) (soft-capping:
times 1 - tanh^2), dQ = c dS K, dK = c dS^T Q, the key gradients of overlapping pieces added.
GQA: a piece's rows of the query heads of one KV head are one matrix, so K/V are never repeated and
dK/dV sum over the group inside the matmul.

Memory: O(block * keys of the piece) per (batch, head) for the scores, never (seq_q x seq_k); the
backward keeps only out and lse from the forward. The block is sized so a piece's scores stay near
``_BUDGET`` elements.
"""
from __future__ import annotations

import torch

from titan_kernels.attention_mask import AttentionArgs
from titan_kernels.ops.attention.blocks import Piece, piece_visible, plan
from titan_kernels.reference.attention import doc_bounds

_BUDGET = 1 << 23  # score elements per piece (32 MiB in float32): fewer, larger ops


def _block_rows(b: int, h: int, sq: int, sk: int, a: AttentionArgs) -> int:
    if a.left >= 0 and a.right >= 0:
        span = min(sk, a.left + a.right + 1)
    else:
        span = min(sk, a.chunk) if a.chunk > 0 else sk
    rows = 16
    # Scores of (rows x (span + rows)) per piece within the budget; for a window, about half its span
    # (a longer block computes more masked scores at the window's edges).
    while rows < 512 and 2 * rows * b * h * (span + 2 * rows) <= _BUDGET and (span == sk or 4 * rows <= span):
        rows *= 2
    return rows


def _views(q, k, v):
    """(b, hkv, g, sq, d) of q; (b, hkv, d, sk) of k; (b, hkv, sk, dv) of v (views)."""
    b, sq, h, d = q.shape
    hkv = k.shape[2]
    return (q.reshape(b, sq, hkv, h // hkv, d).permute(0, 2, 3, 1, 4), k.permute(0, 2, 3, 1), v.permute(0, 2, 1, 3))


def _rows(t5: torch.Tensor, pc: Piece, acc) -> torch.Tensor:
    # (b, hkv, g, sq, x) -> the piece's rows as one (b, hkv, g * rows, x) matrix per KV head.
    b, hkv, g, _, x = t5.shape
    return t5[:, :, :, pc.r0:pc.r1].to(acc).reshape(b, hkv, g * (pc.r1 - pc.r0), x)


def _scores(qb, kt, pc: Piece, sq: int, sk: int, a: AttentionArgs, g: int):
    """(scores (b, hkv, g * rows, keys) soft-capped and masked, tanh of the capped scores or None)."""
    s = torch.matmul(qb, kt[..., pc.k0:pc.k1].to(qb.dtype)).mul_(a.scale)
    t = None
    if a.softcap > 0:
        t = torch.tanh(s.div_(a.softcap))
        s = t * a.softcap
    if pc.mode != "full":
        b, hkv, _, n = s.shape
        seen = piece_visible(pc, sq, sk, a, s.device)
        s.view(b, hkv, g, pc.r1 - pc.r0, n).masked_fill_(~seen, float("-inf"))
    return s, t


def _dense_fwd(q, k, v, a: AttentionArgs):
    b, sq, h, _ = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = h // hkv
    acc = torch.promote_types(q.dtype, torch.float32)
    out = q.new_zeros((b, sq, h, dv))
    lse = q.new_full((b, h, sq), float("-inf"), dtype=acc)
    qg, kt, vt = _views(q, k, v)
    for pc in plan(sq, sk, a, _block_rows(b, h, sq, sk, a), causal_head=False):
        n = pc.r1 - pc.r0
        s, _ = _scores(_rows(qg, pc, acc), kt, pc, sq, sk, a, g)
        m = s.amax(-1, keepdim=True)  # every row of a piece sees a key: finite
        denom = s.sub_(m).exp_().sum(-1, keepdim=True)
        o = torch.matmul(s.div_(denom), vt[:, :, pc.k0:pc.k1].to(acc))  # (b, hkv, g * n, dv)
        l = m + denom.log()
        out[:, pc.r0:pc.r1] = o.view(b, hkv, g, n, dv).permute(0, 3, 1, 2, 4).reshape(b, n, h, dv)
        lse[:, :, pc.r0:pc.r1] = l.view(b, h, n)
    return out, lse.float() if q.dtype != torch.float64 else lse


def _dense_bwd(dout, q, k, v, out, lse, dlse, a: AttentionArgs):
    b, sq, h, d = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = h // hkv
    acc = torch.promote_types(q.dtype, torch.float32)
    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dvv = torch.zeros(v.shape, dtype=acc, device=v.device)
    qg, kt, vt = _views(q, k, v)
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)  # (b, h, sq)
    if dlse is not None:
        delta = delta - dlse.to(acc)
    delta = delta.reshape(b, hkv, g, sq, 1)
    lse5 = lse.to(acc).reshape(b, hkv, g, sq, 1)
    dog = dout.reshape(b, sq, hkv, g, dv).permute(0, 2, 3, 1, 4)
    for pc in plan(sq, sk, a, _block_rows(b, h, sq, sk, a), causal_head=False):
        n = pc.r1 - pc.r0
        qb = _rows(qg, pc, acc)
        s, t = _scores(qb, kt, pc, sq, sk, a, g)
        p = s.sub_(_rows(lse5, pc, acc)).exp_()  # (b, hkv, g * n, keys)
        dob = _rows(dog, pc, acc)
        keys = slice(pc.k0, pc.k1)
        vb = vt[:, :, keys].to(acc)
        dvv[:, keys] += torch.matmul(p.transpose(-1, -2), dob).transpose(1, 2)
        ds = torch.matmul(dob, vb.transpose(-1, -2)).sub_(_rows(delta, pc, acc)).mul_(p)
        if t is not None:
            ds.mul_(1 - t * t)
        kb = kt[..., keys].to(acc)
        dqb = torch.matmul(ds, kb.transpose(-1, -2)).mul_(a.scale)  # (b, hkv, g * n, d)
        dq[:, pc.r0:pc.r1] = dqb.view(b, hkv, g, n, d).permute(0, 3, 1, 2, 4).reshape(b, n, h, d)
        dk[:, keys] += torch.matmul(ds.transpose(-1, -2), qb).mul_(a.scale).transpose(1, 2)
    return dq, dk.to(k.dtype), dvv.to(v.dtype)


def attention_fwd(q, k, v, cu_q, cu_k, a: AttentionArgs):
    """Forward with the contract of ``titan_kernels.reference.attention.attention_fwd``."""
    if cu_q is None:
        return _dense_fwd(q, k, v, a)
    out = q.new_zeros((*q.shape[:-1], v.shape[-1]))
    lse = q.new_full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.promote_types(q.dtype, torch.float32))
    for q0, q1, k0, k1 in doc_bounds(cu_q, cu_k):
        if q1 > q0 and k1 > k0:
            o, l = _dense_fwd(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], a)
            out[q0:q1], lse[:, q0:q1] = o[0], l[0]
    return out, lse


def attention_bwd(dout, q, k, v, out, lse, dlse, cu_q, cu_k, a: AttentionArgs):
    """Backward with the contract of ``titan_kernels.reference.attention.attention_bwd``."""
    if cu_q is None:
        return _dense_bwd(dout, q, k, v, out, lse, dlse, a)
    dq, dk, dv = (torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    for q0, q1, k0, k1 in doc_bounds(cu_q, cu_k):
        if q1 > q0 and k1 > k0:
            g = _dense_bwd(dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], out[None, q0:q1],
                           lse[None, :, q0:q1], None if dlse is None else dlse[None, :, q0:q1], a)
            dq[q0:q1], dk[k0:k1], dv[k0:k1] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv
