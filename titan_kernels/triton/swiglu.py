"""Triton SwiGLU kernels: y = silu(gate) * up, and its backward with sigmoid recomputed from gate.

Layout: the launchers view gate, up (and dy) as 2-D (M rows, N columns) with arbitrary strides, so
slices of a fused w1/w3 projection and transposed tensors are read in place; outputs are contiguous.
Row and column offsets are int64, so tensors of more than 2^31 elements index correctly.

Tiling: a program owns one BLOCK_M x BLOCK_N tile (grid: row tiles on axis 0, whose limit is 2^31-1,
column tiles on axis 1). Each element is read once and written once, all math in float32: the
forward reads 2 and writes 1 tensor, the backward reads 3 and writes 2; nothing else is saved for
the backward (the Liger scheme: silu is recomputed from gate, not stored).

Math: titan_kernels/reference/swiglu.py (Shazeer 2020, eq. 5).

Each launcher takes an optional fixed config (``block_m``, ``block_n``, ``num_warps``); without one
it uses ``default_config(N)``. No autotuning: the op is memory-bound and a tile of about 4k elements
per program keeps the loads 16 bytes wide.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from titan_kernels.backend import triton_interpret

MAX_BLOCK_N = 2048


@triton.jit
def _swiglu_fwd_kernel(
    G, U, Y,
    M, N,
    stride_gm, stride_gn, stride_um, stride_un,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    g = tl.load(G + rows[:, None] * stride_gm + cols[None, :] * stride_gn, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + rows[:, None] * stride_um + cols[None, :] * stride_un, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    y = g * s * u
    tl.store(Y + rows[:, None] * N + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    DY, G, U, DG, DU,
    M, N,
    stride_dym, stride_dyn, stride_gm, stride_gn, stride_um, stride_un,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    dy = tl.load(DY + rows[:, None] * stride_dym + cols[None, :] * stride_dyn, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + rows[:, None] * stride_gm + cols[None, :] * stride_gn, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + rows[:, None] * stride_um + cols[None, :] * stride_un, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    silu = g * s
    # silu'(g) = s * (1 + g * (1 - s))
    dg = dy * u * (s * (1.0 + g * (1.0 - s)))
    du = dy * silu
    out = rows[:, None] * N + cols[None, :]
    tl.store(DG + out, dg.to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + out, du.to(DU.dtype.element_ty), mask=mask)


def default_config(n: int) -> dict:
    """The tile of rows of width ``n``: ``{"block_m", "block_n", "num_warps"}``."""
    block_n = min(triton.next_power_of_2(max(n, 1)), MAX_BLOCK_N)
    # ~4k elements per program on a GPU (16 per thread at 8 warps); the interpreter prefers big tiles.
    tile_elems = 16384 if triton_interpret() else 4096
    block_m = max(1, min(tile_elems // block_n, 256))
    return {"block_m": block_m, "block_n": block_n, "num_warps": 8 if block_m * block_n >= 4096 else 4}


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    # A view when the leading dims flatten onto one stride (e.g. a slice of a fused projection), else a copy.
    return t.reshape(-1, t.shape[-1])


def _config(n: int, block_m, block_n, num_warps) -> tuple[int, int, int]:
    cfg = default_config(n)
    return (block_m or cfg["block_m"], block_n or cfg["block_n"], num_warps or cfg["num_warps"])


def swiglu_fwd(
    gate: torch.Tensor, up: torch.Tensor, *, block_m: int | None = None, block_n: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Triton forward; same contract as ``titan_kernels.reference.swiglu.swiglu_fwd``. The keyword
    arguments fix the tile (powers of two) instead of ``default_config``."""
    n = gate.shape[-1]
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if y.numel() == 0:
        return y
    g2, u2 = _as_rows(gate), _as_rows(up)
    m = g2.shape[0]
    bm, bn, nw = _config(n, block_m, block_n, num_warps)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _swiglu_fwd_kernel[grid](
        g2, u2, y,
        m, n,
        g2.stride(0), g2.stride(1), u2.stride(0), u2.stride(1),
        BLOCK_M=bm, BLOCK_N=bn, num_warps=nw,
    )
    return y


def swiglu_bwd(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, *, block_m: int | None = None,
    block_n: int | None = None, num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton backward; same contract as ``titan_kernels.reference.swiglu.swiglu_bwd``. The keyword
    arguments fix the tile instead of ``default_config``."""
    n = gate.shape[-1]
    dg = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    du = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if dg.numel() == 0:
        return dg, du
    dy2, g2, u2 = _as_rows(dy), _as_rows(gate), _as_rows(up)
    m = g2.shape[0]
    bm, bn, nw = _config(n, block_m, block_n, num_warps)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _swiglu_bwd_kernel[grid](
        dy2, g2, u2, dg, du,
        m, n,
        dy2.stride(0), dy2.stride(1), g2.stride(0), g2.stride(1), u2.stride(0), u2.stride(1),
        BLOCK_M=bm, BLOCK_N=bn, num_warps=nw,
    )
    return dg, du
