"""Triton float8 rowwise grouped GEMM over experts: the quantizers and the two scaled grouped GEMM
forms of ``titan_kernels.reference.fp8_grouped_mm`` (same contracts; the codes and scales agree bit
for bit, the products to float32 rounding).

  _group_cols_kernel  e4m3 codes with one scale per (group, column) over the group's rows: the groups
                      are either the experts of a 3-D weight (UNIFORM: every group has all L rows,
                      w_fwd) or runs of token rows given by the offsets (the weight gradient's
                      operands). One program per (group, column block): an amax pass and a cast pass
                      over the group's rows; any input and output strides.
  _fp8_gmm_kernel     out[rows of e] = (a @ b[e]) * sa[row] * sb[e, col]: the persistent tile queue of
                      ``titan_kernels.triton.grouped_mm`` (one list of the output tiles of every group,
                      the group found from its cumulative tile ends, empty groups cost nothing) with
                      float8 tiles on the tensor cores and both scales applied to the float32 tile in
                      the epilogue. Forward (b = w codes) and dgrad (b = the dgrad codes of w, read
                      transposed: only strides differ).
  _fp8_gmm_dw_kernel  dw[e] = (a[rows of e]^T @ b[rows of e]) * sa[e, k] * sb[e, n]: one tile per
                      (expert, K block, N block), a loop over the group's rows; an empty group stores 0.
The per-row quantization of x and dy is the rowwise kernel of ``titan_kernels.triton.fp8_quantize``
(w_dgrad too: the rows of w viewed as (E*K, N)).

Accumulation: float32, the tensor cores' partial sums promoted to it once per K block
(``max_num_imprecise_acc`` = BLOCK_K, as ``titan_kernels.triton.fp8_gemm`` without fast
accumulation). Operand layouts: the quantizers write codes contraction-major (x rows, w column-major
per expert, token-major columns for the weight gradient), the layout Hopper's float8 wgmma reads.
Pointer loads with masks, any strides and sizes (no TMA variant yet). Fixed tiles: 128x128x128 on
GPUs, small ones in the interpreter (which multiplies float8 tiles exactly in float32).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from titan_kernels.triton import triton_interpret
from titan_kernels.triton.persistent import num_programs
from titan_kernels.reference.fp8 import FP8_MAX
from titan_kernels.triton.fp8_quantize import (
    _FORMAT, _nanmax, _reduce_nanmax, _scale_from_amax, _to_fp8_grid, fp8_quantize,
)
from titan_kernels.triton.grouped_mm import (
    _dw_tile, _dw_tile_acc, _queue_tile_ranges, _tile_acc, interpret_config, row_starts, tile_queue,
    zero_rows_from,
)

E4M3 = torch.float8_e4m3fn
_MANT, _EMIN = _FORMAT[E4M3]


@triton.jit
def _group_cols_kernel(
    X, Q, S, SEG_END, L, C,
    sx_g, sx_r, sx_c, sq_g, sq_r, sq_c, ss_g,
    UNIFORM: tl.constexpr, FP8_MAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, POW2: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    g = tl.program_id(0)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
    cmask = cols < C
    if UNIFORM:  # the experts of a weight: every group holds rows [0, L) at its own base
        r0 = 0
        r1 = L
    else:  # token groups: rows [SEG_END[g-1], SEG_END[g]) of one 2-D tensor
        r1 = tl.load(SEG_END + g).to(tl.int64)
        r0 = tl.load(SEG_END + g - 1, mask=g > 0, other=0).to(tl.int64)
    xb = X + g.to(tl.int64) * sx_g
    qb = Q + g.to(tl.int64) * sq_g
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for start in range(r0, r1, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R).to(tl.int64)
        mask = (rows < r1)[:, None] & cmask[None, :]
        x = tl.load(xb + rows[:, None] * sx_r + cols[None, :] * sx_c, mask=mask, other=0.0)
        acc = _nanmax(acc, tl.abs(x.to(tl.float32)))
    mult, scale = _scale_from_amax(_reduce_nanmax(acc, 0), FP8_MAX, POW2)
    for start in range(r0, r1, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R).to(tl.int64)
        mask = (rows < r1)[:, None] & cmask[None, :]
        x = tl.load(xb + rows[:, None] * sx_r + cols[None, :] * sx_c, mask=mask, other=0.0)
        y = _to_fp8_grid(x.to(tl.float32) * mult[None, :], FP8_MAX, MANT, EMIN)
        tl.store(qb + rows[:, None] * sq_r + cols[None, :] * sq_c, y.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + g.to(tl.int64) * ss_g + cols, scale, mask=cmask)


@triton.jit
def _fp8_gmm_kernel(
    A, B, C, SA, SB, OFFS, ROW_START, TILE_START, TILE_END,
    E, N, K,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_sbe,
    BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tiles_n = tl.cdiv(N, BLOCK_N)
    for tile in range(tl.program_id(0), tl.load(TILE_END + E - 1), tl.num_programs(0)):
        e, rm, rn, in_m, in_n = _queue_tile_ranges(tile, OFFS, ROW_START, TILE_START, TILE_END, E, N, tiles_n,
                                                   BLOCK_E, BLOCK_M, BLOCK_N)
        acc = _tile_acc(A, B, e, rm, rn, in_m, in_n, K, stride_am, stride_ak, stride_be, stride_bk, stride_bn,
                        True, "ieee", False, BLOCK_M, BLOCK_N, BLOCK_K)
        sa = tl.load(SA + rm, mask=in_m, other=0.0)
        sb = tl.load(SB + e.to(tl.int64) * stride_sbe + rn, mask=in_n, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
        tl.store(C + rm[:, None] * stride_cm + rn[None, :], acc.to(C.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])


@triton.jit
def _fp8_gmm_dw_kernel(
    X, DY, DW, SX, SDY, OFFS, ROW_START,
    E, K, N,
    stride_xm, stride_xk, stride_dym, stride_dyn, stride_we, stride_wk, stride_sx, stride_sdy,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    for tile in range(tl.program_id(0), E * tl.cdiv(K, BLOCK_K) * tl.cdiv(N, BLOCK_N), tl.num_programs(0)):
        e, rk, rn, in_k, in_n, row_start, row_end = _dw_tile(tile, OFFS, ROW_START, K, N, BLOCK_N, BLOCK_K)
        acc = _dw_tile_acc(X, DY, rk, rn, in_k, in_n, row_start, row_end, stride_xm, stride_xk, stride_dym, stride_dyn,
                           True, "ieee", False, BLOCK_M, BLOCK_N, BLOCK_K)
        e64 = e.to(tl.int64)
        sx = tl.load(SX + e64 * stride_sx + rk, mask=in_k, other=0.0)
        sdy = tl.load(SDY + e64 * stride_sdy + rn, mask=in_n, other=0.0)
        acc = acc * sx[:, None] * sdy[None, :]
        tl.store(DW + e64 * stride_we + rk[:, None] * stride_wk + rn[None, :], acc.to(DW.dtype.element_ty),
                 mask=in_k[:, None] & in_n[None, :])


# ----------------------------------------------------------------------------- quantizers


def _consts() -> dict:
    return dict(FP8_MAX=FP8_MAX[E4M3], MANT=_MANT, EMIN=_EMIN, POW2=True)


def _cols_blocks(rows: int, cols: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_C, num_warps) of the per-(group, column) quantizer."""
    if triton_interpret():
        return max(16, min(256, triton.next_power_of_2(max(rows, 1)))), max(16, min(64, triton.next_power_of_2(cols))), 4
    return 64, 64, 4


def rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton ``reference.fp8_grouped_mm.rows``: (codes (T, C), scale (T,))."""
    codes, scale = fp8_quantize(t, E4M3, "rowwise", True)
    return codes, scale.reshape(-1)


def w_fwd(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton ``reference.fp8_grouped_mm.w_fwd``: (codes (E, K, N) column-major per expert, scale (E, N))."""
    e, k, n = w.shape
    codes = torch.empty((e, n, k), dtype=E4M3, device=w.device).transpose(1, 2)
    scale = torch.empty((e, n), dtype=torch.float32, device=w.device)
    br, bc, nw = _cols_blocks(k, n)
    _group_cols_kernel[(e, triton.cdiv(n, bc))](
        w, codes, scale, scale, k, n, w.stride(0), w.stride(1), w.stride(2),
        codes.stride(0), codes.stride(1), codes.stride(2), scale.stride(0),
        UNIFORM=True, **_consts(), BLOCK_R=br, BLOCK_C=bc, num_warps=nw)
    return codes, scale


def w_dgrad(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton ``reference.fp8_grouped_mm.w_dgrad``: (codes (E, K, N) row-major, scale (E, K))."""
    e, k, n = w.shape
    codes, scale = fp8_quantize(w.reshape(e * k, n), E4M3, "rowwise", True)
    return codes.view(e, k, n), scale.view(e, k)


def group_cols(t: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton ``reference.fp8_grouped_mm.group_cols``: (codes (T, C) column-major, scale (E, C)).
    Rows past the last group are left unwritten (no GEMM reads them)."""
    n_rows, c = t.shape
    e = offsets.shape[0]
    codes = torch.empty((c, n_rows), dtype=E4M3, device=t.device).t()
    scale = torch.empty((e, c), dtype=torch.float32, device=t.device)
    br, bc, nw = _cols_blocks(max(1, n_rows // max(e, 1)), c)
    _group_cols_kernel[(e, triton.cdiv(c, bc))](
        t, codes, scale, offsets, n_rows, c, 0, t.stride(0), t.stride(1),
        0, codes.stride(0), codes.stride(1), scale.stride(0),
        UNIFORM=False, **_consts(), BLOCK_R=br, BLOCK_C=bc, num_warps=nw)
    return codes, scale


# ----------------------------------------------------------------------------- GEMMs


def _gemm_config(n: int, k: int) -> dict:
    """The blocks of both float8 GEMMs (the interpreter's: grouped_mm's)."""
    if triton_interpret():
        return interpret_config(n, k)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3)


def gmm(a, sa, b, sb, offsets, out_dtype: torch.dtype) -> torch.Tensor:
    """Triton ``reference.fp8_grouped_mm.gmm``: a (T, Kc), sa (T,), b (E, Kc, No), sb (E, No) -> (T, No),
    rows past the last group zero."""
    t, kc = a.shape
    e, _, n = b.shape
    c = torch.empty((t, n), dtype=out_dtype, device=a.device)
    if t == 0 or n == 0:
        return c
    cfg = _gemm_config(n, kc)
    grid, (row_start, tile_start, tile_end), block_e = tile_queue(offsets, t, n, cfg, a.device)
    sa = sa.reshape(-1)
    sb = sb if sb.stride(1) == 1 else sb.contiguous()
    _fp8_gmm_kernel[grid](a, b, c, sa, sb, offsets, row_start, tile_start, tile_end, e, n, kc,
                          a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), sb.stride(0),
                          BLOCK_E=block_e, **cfg)
    return zero_rows_from(c, offsets)


def gmm_dw(a, sa, b, sb, offsets, out_dtype: torch.dtype) -> torch.Tensor:
    """Triton ``reference.fp8_grouped_mm.gmm_dw``: a (T, Kd), sa (E, Kd), b (T, Nd), sb (E, Nd) -> (E, Kd, Nd)."""
    e = offsets.shape[0]
    k, n = a.shape[1], b.shape[1]
    dw = torch.empty((e, k, n), dtype=out_dtype, device=a.device)
    if k == 0 or n == 0:
        return dw
    cfg = _gemm_config(n, k)
    starts = row_starts(offsets).to(torch.int32)
    sa = sa if sa.stride(1) == 1 else sa.contiguous()
    sb = sb if sb.stride(1) == 1 else sb.contiguous()
    grid = (num_programs(a.device, e * triton.cdiv(k, cfg["BLOCK_K"]) * triton.cdiv(n, cfg["BLOCK_N"])),)
    _fp8_gmm_dw_kernel[grid](a, b, dw, sa, sb, offsets, starts, e, k, n,
                             a.stride(0), a.stride(1), b.stride(0), b.stride(1), dw.stride(0), dw.stride(1),
                             sa.stride(0), sb.stride(0), **cfg)
    return dw
