"""Triton kernels for MoE token routing: permute tokens to expert order and combine them back.

Math and index layout: titan_kernels/reference/moe.py (``routing_index``: dst (T, top_k) is the row
of each (token, choice) slot in the permuted buffer, src (R,) the slot of each row or -1 for padding).

  permute_rows   one program per buffer row r: copies x[src[r] // top_k] (times weights[src[r]]) or
                 writes zeros for a padding row, so every row is written exactly once (no memset, no
                 atomics). The permute forward, and the unpermute backward, which also reduces the
                 per-slot dot product <dout[t], y[r]> (the scores' gradient) in the same pass.
  combine_rows   one program per (token, column block): out[t] = sum_j weights[t, j] * y[dst[t, j]],
                 float32 accumulation. The unpermute forward, and the permute backward (weights 1).

Row offsets are int64 (buffers past 2^31 elements index correctly); loads and stores are
column-contiguous (the launchers make the last dim contiguous). No autotuning: memory-bound copies.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from titan_kernels.triton import triton_interpret


@triton.jit
def _permute_rows_kernel(
    X, SRC, W, Y, DOT_WITH, DOTS,
    D, TOP_K, stride_xm, stride_ym, stride_dm,
    HAS_W: tl.constexpr, HAS_DOT: tl.constexpr, BLOCK_D: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    s = tl.load(SRC + r)
    s0 = tl.maximum(s, 0)  # a padding row (s = -1) reads nothing: its loads are masked off
    t = s0 // TOP_K
    valid = (tl.zeros((BLOCK_D,), dtype=tl.int64) + s) >= 0
    if HAS_W:
        w = tl.load(W + s0).to(tl.float32)
    dot = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D).to(tl.int64)
        in_d = cols < D
        x = tl.load(X + t * stride_xm + cols, mask=in_d & valid, other=0.0)
        if HAS_W:
            tl.store(Y + r * stride_ym + cols, (x.to(tl.float32) * w).to(Y.dtype.element_ty), mask=in_d)
        else:  # a plain copy: bit-exact in every dtype
            tl.store(Y + r * stride_ym + cols, x, mask=in_d)
        if HAS_DOT:
            yv = tl.load(DOT_WITH + r * stride_dm + cols, mask=in_d & valid, other=0.0).to(tl.float32)
            dot += x.to(tl.float32) * yv
    if HAS_DOT:
        if s >= 0:
            tl.store(DOTS + s, tl.sum(dot, axis=0))


@triton.jit
def _combine_rows_kernel(
    Y, DST, W, OUT,
    D, TOP_K, stride_ym, stride_om,
    HAS_W: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D).to(tl.int64)
    in_d = cols < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in range(0, TOP_K):
        r = tl.load(DST + t * TOP_K + j)
        y = tl.load(Y + r * stride_ym + cols, mask=in_d, other=0.0).to(tl.float32)
        if HAS_W:
            y = y * tl.load(W + t * TOP_K + j).to(tl.float32)
        acc += y
    tl.store(OUT + t * stride_om + cols, acc.to(OUT.dtype.element_ty), mask=in_d)


def _block_d(d: int, cap: int) -> int:
    return max(16, min(triton.next_power_of_2(max(d, 1)), cap))


def _rowmajor(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def permute_rows(x, src, top_k: int, weights=None, dot_with=None):
    """Triton version of ``reference.moe.permute_rows`` (same arguments and results)."""
    x = _rowmajor(x)
    rows, d = src.shape[0], x.shape[1]
    out = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    dots = None
    if dot_with is not None:
        dot_with = _rowmajor(dot_with)
        dots = torch.zeros(x.shape[0] * top_k, dtype=torch.float32, device=x.device)
    w = weights.reshape(-1).contiguous() if weights is not None else None
    if rows and d and x.shape[0] * top_k == 0:  # no slot at all: every row is padding
        out.zero_()
    elif rows and d:
        _permute_rows_kernel[(rows,)](
            x, src.contiguous(), w if w is not None else x, out,
            dot_with if dot_with is not None else x, dots if dots is not None else out,
            d, top_k, x.stride(0), out.stride(0), dot_with.stride(0) if dot_with is not None else 0,
            HAS_W=w is not None, HAS_DOT=dot_with is not None,
            BLOCK_D=_block_d(d, 4096 if triton_interpret() else 1024), num_warps=4,
        )
    return out, (dots.view(x.shape[0], top_k) if dots is not None else None)


def combine_rows(y, dst, weights=None):
    """Triton version of ``reference.moe.combine_rows`` (same arguments and results)."""
    y = _rowmajor(y)
    t, top_k, d = dst.shape[0], dst.shape[1], y.shape[1]
    out = torch.empty((t, d), dtype=y.dtype, device=y.device)
    if t and d:
        block = _block_d(d, 4096 if triton_interpret() else 1024)
        w = weights.contiguous() if weights is not None else None
        _combine_rows_kernel[(t, triton.cdiv(d, block))](
            y, dst.contiguous(), w if w is not None else y, out,
            d, top_k, y.stride(0), out.stride(0),
            HAS_W=w is not None, BLOCK_D=block, num_warps=4,
        )
    elif t:
        out.zero_()
    return out
