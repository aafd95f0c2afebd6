"""Triton kernels for the two elementwise passes of the chunked linear cross-entropy.

Given one chunk of float32 logits Z (C, V) (the GEMMs around them are aten's, see
``titan_kernels.reference.cross_entropy``):

  ``softmax_stats``  one read of Z: per row the running max m and sum(exp(z - m)) (online softmax,
                     Milakov & Gimelshein 2018, "Online normalizer calculation for softmax") and the
                     logit at the target column (0 where there is none);
  ``softmax_grad_``  one read of Z and one write of G = (exp(z - lse) - onehot(target)) * row_scale
                     per row, in G's dtype (bf16 for the tensor-core gradient GEMMs on CUDA), in
                     place of Z when G is float32.

They are separate kernels because under a vocabulary split the statistics are all-reduced between
them. Each program handles BLOCK_M rows and loops over the vocabulary in BLOCK_V columns; row
offsets are int64. Launchers: tensors in, tensors out.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from titan_kernels.triton import triton_interpret


@triton.jit
def _ce_stats_kernel(
    Z, stride_zm, TGT, M, S, T,
    n_rows, n_cols,
    BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    rmask = rows < n_rows
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        cmask = cols < n_cols
        z = tl.load(Z + rows[:, None] * stride_zm + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
        z = tl.where(cmask[None, :], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        # Rows past n_rows have m_new = -inf: shift by 0 there, so no inf - inf.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(z - shift[:, None]), axis=1)
        m = m_new
    tgt = tl.load(TGT + rows, mask=rmask, other=-1)
    has = tgt >= 0
    t = tl.load(Z + rows * stride_zm + tl.where(has, tgt, 0), mask=rmask & has, other=0.0)
    tl.store(M + rows, m, mask=rmask)
    tl.store(S + rows, s, mask=rmask)
    tl.store(T + rows, t, mask=rmask)


@triton.jit
def _ce_grad_kernel(
    Z, stride_zm, G, stride_gm, TGT, LSE, SCALE,
    n_rows, n_cols,
    BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    rmask = rows < n_rows
    lse = tl.load(LSE + rows, mask=rmask, other=0.0)
    scale = tl.load(SCALE + rows, mask=rmask, other=0.0)
    tgt = tl.load(TGT + rows, mask=rmask, other=-1)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = rmask[:, None] & (cols < n_cols)[None, :]
        z = tl.load(Z + rows[:, None] * stride_zm + cols[None, :], mask=mask, other=0.0)
        p = tl.exp(z - lse[:, None])
        p = tl.where(cols[None, :] == tgt[:, None], p - 1.0, p)
        # A row without a loss (scale 0) is exactly 0, even where its logits are not finite.
        g = tl.where(scale[:, None] != 0.0, p * scale[:, None], 0.0)
        tl.store(G + rows[:, None] * stride_gm + cols[None, :], g.to(G.dtype.element_ty), mask=mask)


def _config(n_rows: int, n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_V, num_warps). GPU: one row per program, 4096-column tiles (a memory-bound
    pass; Liger's cross-entropy kernel also runs a row per program). Interpreter: many rows per
    program, since its cost is per program and per tile."""
    if triton_interpret():
        return min(64, triton.next_power_of_2(max(n_rows, 1))), min(triton.next_power_of_2(max(n_cols, 1)), 8192), 4
    return 1, min(triton.next_power_of_2(max(n_cols, 1)), 4096), 8


def softmax_stats(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of ``logits`` (C, V) float32 (unit column stride): (max, sum(exp(z - max)), logit at
    ``target`` (C,) int64 or 0 where it is -1), each (C,) float32. V = 0 gives (-inf, 0, 0)."""
    c, v = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    m = logits.new_empty((c,))
    s = logits.new_empty((c,))
    t = logits.new_empty((c,))
    if c:
        bm, bv, warps = _config(c, v)
        _ce_stats_kernel[(triton.cdiv(c, bm),)](
            logits, logits.stride(0), target.contiguous(), m, s, t, c, v,
            BLOCK_M=bm, BLOCK_V=bv, num_warps=warps,
        )
    return m, s, t


def softmax_grad_(
    logits: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, row_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """(softmax(z) - onehot(target)) * row_scale per row of ``logits`` (C, V) float32, written in
    place when ``out_dtype`` is float32, else into a new (C, V) tensor of ``out_dtype``."""
    c, v = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    g = logits if out_dtype == logits.dtype else torch.empty((c, v), dtype=out_dtype, device=logits.device)
    if c and v:
        bm, bv, warps = _config(c, v)
        _ce_grad_kernel[(triton.cdiv(c, bm),)](
            logits, logits.stride(0), g, g.stride(0), target.contiguous(), lse.contiguous(),
            row_scale.contiguous(), c, v, BLOCK_M=bm, BLOCK_V=bv, num_warps=warps,
        )
    return g
