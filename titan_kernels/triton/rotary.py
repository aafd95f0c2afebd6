"""Triton rotary-embedding kernel: q and k in one launch, forward and backward.

Layout: q (batch, seq, n_heads, head_dim) and k (batch, seq, n_kv_heads, head_dim) are read through
their own four strides (e.g. slices of a fused qkv projection, transposed tensors), so nothing is
copied first; outputs are contiguous. Token and head offsets are int64, so tensors of more than
2^31 elements index correctly.

Tiling: a program owns BLOCK_T tokens (flattened batch x seq). For each chunk of BLOCK_R rotation
pairs it loads the cos/sin rows of its tokens once and applies them to every q head and then every
k head, BLOCK_H heads at a time, so the tables are read once per token and chunk, not once per head.
Dims past rotary_dim are copied in the same program. The backward is the same kernel with -sin.

A position outside [0, max_positions) is never read: its cos/sin are masked to NaN, so its rotated
dims come out NaN instead of garbage (the op raises a ValueError before launching in eager mode).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from titan_kernels.triton import triton_interpret


@triton.jit
def _rotate_heads(
    X, Y, c, sn, x_tok, y_tok, tmask, d1, d2, rmask,
    n_heads, head_dim, stride_h, stride_d,
    BLOCK_H: tl.constexpr,
):
    """Rotate pairs (d1, d2) of all n_heads heads of BLOCK_T tokens; c, sn: (BLOCK_T, BLOCK_R)."""
    c3 = c[:, None, :]
    s3 = sn[:, None, :]
    for h0 in range(0, n_heads, BLOCK_H):
        h = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
        mask = tmask[:, None, None] & (h < n_heads)[None, :, None] & rmask[None, None, :]
        xoff = x_tok[:, None, None] + h[None, :, None] * stride_h
        x1 = tl.load(X + xoff + d1[None, None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(X + xoff + d2[None, None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
        yoff = y_tok[:, None, None] + h[None, :, None] * head_dim
        tl.store(Y + yoff + d1[None, None, :], (x1 * c3 - x2 * s3).to(Y.dtype.element_ty), mask=mask)
        tl.store(Y + yoff + d2[None, None, :], (x2 * c3 + x1 * s3).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _copy_heads(
    X, Y, x_tok, y_tok, tmask, d, dmask,
    n_heads, head_dim, stride_h, stride_d,
    BLOCK_H: tl.constexpr,
):
    """Copy dims d (past rotary_dim) of all n_heads heads of BLOCK_T tokens unchanged."""
    for h0 in range(0, n_heads, BLOCK_H):
        h = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
        mask = tmask[:, None, None] & (h < n_heads)[None, :, None] & dmask[None, None, :]
        x = tl.load(X + x_tok[:, None, None] + h[None, :, None] * stride_h + d[None, None, :] * stride_d, mask=mask)
        tl.store(Y + y_tok[:, None, None] + h[None, :, None] * head_dim + d[None, None, :], x, mask=mask)


@triton.jit
def _rotary_kernel(
    Q, K, QO, KO, COS, SIN, POS,
    n_tokens, seq, n_heads, n_kv_heads, head_dim, half, max_positions,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_cp, stride_cr, stride_sp, stride_sr,
    stride_pb, stride_ps,
    HAS_POS: tl.constexpr, INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr, HAS_PASS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    tmask = tok < n_tokens
    b = tok // seq
    s = tok % seq
    if HAS_POS:
        pos = tl.load(POS + b * stride_pb + s * stride_ps, mask=tmask, other=0).to(tl.int64)
    else:
        pos = s
    pvalid = tmask & (pos >= 0) & (pos < max_positions)
    q_tok = b * stride_qb + s * stride_qs
    k_tok = b * stride_kb + s * stride_ks
    qo_tok = tok * n_heads * head_dim
    ko_tok = tok * n_kv_heads * head_dim
    for r0 in range(0, half, BLOCK_R):
        r = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)
        rmask = r < half
        cmask = pvalid[:, None] & rmask[None, :]
        c = tl.load(COS + pos[:, None] * stride_cp + r[None, :] * stride_cr, mask=cmask, other=float("nan"))
        sn = tl.load(SIN + pos[:, None] * stride_sp + r[None, :] * stride_sr, mask=cmask, other=float("nan"))
        if BACKWARD:
            sn = -sn
        if INTERLEAVED:
            d1 = 2 * r
            d2 = d1 + 1
        else:
            d1 = r
            d2 = r + half
        _rotate_heads(Q, QO, c, sn, q_tok, qo_tok, tmask, d1, d2, rmask,
                      n_heads, head_dim, stride_qh, stride_qd, BLOCK_HQ)
        _rotate_heads(K, KO, c, sn, k_tok, ko_tok, tmask, d1, d2, rmask,
                      n_kv_heads, head_dim, stride_kh, stride_kd, BLOCK_HK)
    if HAS_PASS:
        for p0 in range(2 * half, head_dim, BLOCK_P):
            d = (p0 + tl.arange(0, BLOCK_P)).to(tl.int64)
            dmask = d < head_dim
            _copy_heads(Q, QO, q_tok, qo_tok, tmask, d, dmask, n_heads, head_dim, stride_qh, stride_qd, BLOCK_HQ)
            _copy_heads(K, KO, k_tok, ko_tok, tmask, d, dmask, n_kv_heads, head_dim, stride_kh, stride_kd, BLOCK_HK)


MAX_BLOCK_R = 64
MAX_BLOCK_H = 16


def _tiling(n_heads: int, n_kv_heads: int, half: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_T, BLOCK_HQ, BLOCK_HK, BLOCK_R, num_warps)."""
    block_r = min(triton.next_power_of_2(max(half, 1)), MAX_BLOCK_R)
    block_hq = min(triton.next_power_of_2(max(n_heads, 1)), MAX_BLOCK_H)
    block_hk = min(triton.next_power_of_2(max(n_kv_heads, 1)), MAX_BLOCK_H)
    # About 4k q elements per (tokens x heads x pairs) tile on a GPU; the interpreter prefers
    # bigger tiles (fewer programs, each a vectorised numpy step).
    tile = 32768 if triton_interpret() else 4096
    block_t = max(1, min(tile // (block_hq * block_r), 64))
    return block_t, block_hq, block_hk, block_r, 4


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
    interleaved: bool,
    backward: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seq, n_heads, head_dim = q.shape
    n_kv_heads = k.shape[2]
    half = cos.shape[1]
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ko = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    n_tokens = batch * seq
    if n_tokens == 0 or head_dim == 0 or (n_heads == 0 and n_kv_heads == 0):
        return qo, ko
    if position_ids is not None:
        pos = position_ids.expand(batch, seq)  # (seq,) -> stride 0 over batch; a view
        stride_pb, stride_ps = pos.stride()
    else:
        pos, stride_pb, stride_ps = cos, 0, 0  # unused pointer
    block_t, block_hq, block_hk, block_r, num_warps = _tiling(n_heads, n_kv_heads, half)
    pass_dims = head_dim - 2 * half
    block_p = min(triton.next_power_of_2(max(pass_dims, 1)), MAX_BLOCK_R)
    grid = (triton.cdiv(n_tokens, block_t),)
    _rotary_kernel[grid](
        q, k, qo, ko, cos, sin, pos,
        n_tokens, seq, n_heads, n_kv_heads, head_dim, half, cos.shape[0],
        *q.stride(), *k.stride(),
        *cos.stride(), *sin.stride(),
        stride_pb, stride_ps,
        HAS_POS=position_ids is not None, INTERLEAVED=bool(interleaved), BACKWARD=backward,
        HAS_PASS=pass_dims > 0,
        BLOCK_T=block_t, BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_R=block_r, BLOCK_P=block_p,
        num_warps=num_warps,
    )
    return qo, ko


def rotary_fwd(q, k, cos, sin, position_ids, interleaved):
    """Triton forward; same contract as ``titan_kernels.reference.rotary.rotary_fwd``."""
    return _launch(q, k, cos, sin, position_ids, interleaved, backward=False)


def rotary_bwd(dq, dk, cos, sin, position_ids, interleaved):
    """Triton backward (rotation by -theta); same contract as ``titan_kernels.reference.rotary.rotary_bwd``."""
    return _launch(dq, dk, cos, sin, position_ids, interleaved, backward=True)
