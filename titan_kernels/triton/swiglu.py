"""Triton SwiGLU kernels: y = silu(gate) * up, and its backward with sigmoid recomputed from gate;
and the clamped variant (GPT-OSS): y = (clamp(up, -limit, limit) + up_offset) * sw(min(gate, limit))
with sw(x) = x * sigmoid(alpha x).

Layout: the launchers view gate, up (and dy) as 2-D (M rows, N columns) with arbitrary strides, so
slices of a fused w1/w3 projection and transposed tensors are read in place; outputs are contiguous.
Row and column offsets are int64, so tensors of more than 2^31 elements index correctly.

Tiling: a program owns one BLOCK_M x BLOCK_N tile (grid: row tiles on axis 0, whose limit is 2^31-1,
column tiles on axis 1). Each element is read once and written once, all math in float32: the
forward reads 2 and writes 1 tensor, the backward reads 3 and writes 2; nothing else is saved for
the backward (the Liger scheme: silu is recomputed from gate, not stored).

Math: titan_kernels/reference/swiglu.py (Shazeer 2020, eq. 5; the variant after OpenAI's gpt-oss).

The variant's scalars (alpha, limit, up_offset) are runtime arguments, so one compiled kernel serves
any values; limit +inf means no limit. One constexpr, CLAMPED, keeps the plain SwiGLU on its own code
(bit for bit the kernel it was: the variant's formula differs from it in the sign of a zero product
and in NaN handling of the clamps' gradient masks). The clamps are selects, not tl.minimum, so NaN
propagates as in torch.clamp; the masks pass the gradient where -limit <= x <= limit, bounds included,
and give 0 at NaN (torch.clamp's backward).

Each launcher takes an optional fixed config (``block_m``, ``block_n``, ``num_warps``); without one
it uses ``default_config(N)``. No autotuning: the op is memory-bound and a tile of about 4k elements
per program keeps the loads 16 bytes wide.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from titan_kernels.triton import triton_interpret
from titan_kernels.reference.swiglu import is_plain
from titan_kernels.triton.tile_io import load_2d, store_rows

MAX_BLOCK_N = 2048


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's rows and columns (int64) and their (rows, cols) mask."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    return rows, cols, (rows < M)[:, None] & (cols < N)[None, :]


@triton.jit
def _clamp(g, u, limit):
    """The variant's clamps: min(g, limit) and clamp(u, -limit, limit), as selects (NaN propagates)."""
    g = tl.where(g > limit, limit, g)
    u = tl.where(u > limit, limit, tl.where(u < -limit, -limit, u))
    return g, u


@triton.jit
def _swiglu_fwd_kernel(
    G, U, Y,
    M, N,
    stride_gm, stride_gn, stride_um, stride_un,
    alpha, limit, up_offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CLAMPED: tl.constexpr,
):
    rows, cols, mask = _tile(M, N, BLOCK_M, BLOCK_N)
    g = load_2d(G, rows, cols, stride_gm, stride_gn, mask).to(tl.float32)
    u = load_2d(U, rows, cols, stride_um, stride_un, mask).to(tl.float32)
    if CLAMPED:
        g, u = _clamp(g, u, limit)
        s = 1.0 / (1.0 + tl.exp(-(alpha * g)))
        y = g * s * (u + up_offset)
    else:
        s = 1.0 / (1.0 + tl.exp(-g))
        y = g * s * u
    store_rows(Y, rows, cols, N, y, mask)


@triton.jit
def _swiglu_bwd_kernel(
    DY, G, U, DG, DU,
    M, N,
    stride_dym, stride_dyn, stride_gm, stride_gn, stride_um, stride_un,
    alpha, limit, up_offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CLAMPED: tl.constexpr,
):
    rows, cols, mask = _tile(M, N, BLOCK_M, BLOCK_N)
    dy = load_2d(DY, rows, cols, stride_dym, stride_dyn, mask).to(tl.float32)
    g = load_2d(G, rows, cols, stride_gm, stride_gn, mask).to(tl.float32)
    u = load_2d(U, rows, cols, stride_um, stride_un, mask).to(tl.float32)
    if CLAMPED:
        # Where the gradient passes each clamp; limit +inf (no limit) passes everything, NaN included.
        no_limit = limit == float("inf")
        pass_g = (g <= limit) | no_limit
        pass_u = ((u >= -limit) & (u <= limit)) | no_limit
        g, u = _clamp(g, u, limit)
        s = 1.0 / (1.0 + tl.exp(-(alpha * g)))
        # sw'(g) = s * (1 + alpha * g * (1 - s)) for sw(g) = g * sigmoid(alpha * g)
        dg = tl.where(pass_g, dy * (u + up_offset) * (s * (1.0 + alpha * g * (1.0 - s))), 0.0)
        du = tl.where(pass_u, dy * (g * s), 0.0)
    else:
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


def _scalars(alpha: float, limit: float | None, up_offset: float) -> tuple[float, float, float, bool]:
    """The kernels' (alpha, limit, up_offset, CLAMPED): limit +inf for none."""
    clamped = not is_plain(alpha, limit, up_offset)
    return float(alpha), float("inf") if limit is None else float(limit), float(up_offset), clamped


def swiglu_fwd(
    gate: torch.Tensor, up: torch.Tensor, alpha: float = 1.0, limit: float | None = None, up_offset: float = 0.0,
    *, block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None,
) -> torch.Tensor:
    """Triton forward; same contract as ``titan_kernels.reference.swiglu.swiglu_fwd`` (plain, or the
    clamped variant with alpha, limit, up_offset). The keyword arguments fix the tile (powers of two)
    instead of ``default_config``."""
    n = gate.shape[-1]
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if y.numel() == 0:
        return y
    g2, u2 = _as_rows(gate), _as_rows(up)
    m = g2.shape[0]
    bm, bn, nw = _config(n, block_m, block_n, num_warps)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    a, lim, off, clamped = _scalars(alpha, limit, up_offset)
    _swiglu_fwd_kernel[grid](
        g2, u2, y,
        m, n,
        g2.stride(0), g2.stride(1), u2.stride(0), u2.stride(1),
        a, lim, off,
        BLOCK_M=bm, BLOCK_N=bn, CLAMPED=clamped, num_warps=nw,
    )
    return y


def swiglu_bwd(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, alpha: float = 1.0, limit: float | None = None,
    up_offset: float = 0.0, *, block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None,
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
    a, lim, off, clamped = _scalars(alpha, limit, up_offset)
    _swiglu_bwd_kernel[grid](
        dy2, g2, u2, dg, du,
        m, n,
        dy2.stride(0), dy2.stride(1), g2.stride(0), g2.stride(1), u2.stride(0), u2.stride(1),
        a, lim, off,
        BLOCK_M=bm, BLOCK_N=bn, CLAMPED=clamped, num_warps=nw,
    )
    return dg, du
