"""Triton RMSNorm kernels (forward with optional fused residual add; backward with fp32 partial dweight).

Layout: the launcher views the input as 2-D (M rows, N columns) with arbitrary strides, so
transposed and sliced inputs are read in place. All row offsets are int64, so tensors of more than
2^31 elements index correctly. Outputs are contiguous.

Tiling: a program handles BLOCK_M rows x BLOCK_N columns. Rows up to MAX_BLOCK_N wide are read once
("one pass"); wider rows loop over column chunks (two passes: sum of squares, then normalize).
The backward is persistent: G programs stride over the row tiles and each keeps a float32 partial
dweight, written to a (G, N) buffer and summed at the end (the Liger / quack scheme), so dweight is
never accumulated in bf16 and needs no atomics.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from titan_kernels.triton import triton_interpret
from titan_kernels.triton.persistent import num_programs
from titan_kernels.triton.tile_io import load_2d, store_rows

MAX_BLOCK_N = 16384


@triton.jit
def _load_weight(W, cols, N):
    return tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)


@triton.jit
def _fwd_input(X, R, H, rows, cols, mask, N, stride_xm, stride_xn, stride_rm, stride_rn, HAS_RES: tl.constexpr):
    """The tile to normalize: x, or h = x + residual (stored to H)."""
    x = load_2d(X, rows, cols, stride_xm, stride_xn, mask)
    if HAS_RES:
        r = load_2d(R, rows, cols, stride_rm, stride_rn, mask)
        # Round the sum to the storage dtype first, exactly as unfused `rms_norm(x + residual)`.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(H.dtype.element_ty)
        store_rows(H, rows, cols, N, x, mask)
    return x


@triton.jit
def _store_normalized(Y, W, xf, rstd, rows, cols, mask, N, HAS_W: tl.constexpr):
    """y = xf * rstd (* w) stored to the contiguous Y."""
    y = xf * rstd[:, None]
    if HAS_W:
        y = y * _load_weight(W, cols, N)[None, :]
    store_rows(Y, rows, cols, N, y, mask)


@triton.jit
def _rms_norm_fwd_kernel(
    X, R, W, Y, H, RSTD,
    M, N,
    stride_xm, stride_xn, stride_rm, stride_rn,
    eps,
    HAS_W: tl.constexpr, HAS_RES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ONE_PASS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    rmask = rows < M
    if ONE_PASS:
        cols = tl.arange(0, BLOCK_N)
        mask = rmask[:, None] & (cols < N)[None, :]
        xf = _fwd_input(X, R, H, rows, cols, mask, N, stride_xm, stride_xn, stride_rm, stride_rn,
                        HAS_RES).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / N + eps)
        tl.store(RSTD + rows, rstd, mask=rmask)
        _store_normalized(Y, W, xf, rstd, rows, cols, mask, N, HAS_W)
    else:
        acc = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = rmask[:, None] & (cols < N)[None, :]
            xf = _fwd_input(X, R, H, rows, cols, mask, N, stride_xm, stride_xn, stride_rm, stride_rn,
                            HAS_RES).to(tl.float32)
            acc += tl.sum(xf * xf, axis=1)
        rstd = tl.rsqrt(acc / N + eps)
        tl.store(RSTD + rows, rstd, mask=rmask)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = rmask[:, None] & (cols < N)[None, :]
            if HAS_RES:
                x = load_2d(H, rows, cols, N, 1, mask)
            else:
                x = load_2d(X, rows, cols, stride_xm, stride_xn, mask)
            _store_normalized(Y, W, x.to(tl.float32), rstd, rows, cols, mask, N, HAS_W)


@triton.jit
def _store_dx(DX, DRES, g, xhat, c, rstd, rows, cols, mask, N, stride_drm, stride_drn, HAS_DRES: tl.constexpr):
    """dx = (g - xhat * c) * rstd (+ dresidual) stored to the contiguous DX."""
    dx = (g - xhat * c[:, None]) * rstd[:, None]
    if HAS_DRES:
        dx += load_2d(DRES, rows, cols, stride_drm, stride_drn, mask).to(tl.float32)
    store_rows(DX, rows, cols, N, dx, mask)


@triton.jit
def _rms_norm_bwd_kernel(
    DY, X, W, RSTD, DRES, DX, DWP,
    M, N, n_tiles,
    stride_dym, stride_dyn, stride_xm, stride_xn, stride_drm, stride_drn,
    HAS_W: tl.constexpr, HAS_DRES: tl.constexpr, COMPUTE_DW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ONE_PASS: tl.constexpr,
):
    pid = tl.program_id(0)
    n_progs = tl.num_programs(0)
    if ONE_PASS:
        cols = tl.arange(0, BLOCK_N)
        cmask = cols < N
        if HAS_W:
            w = _load_weight(W, cols, N)
        dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for tile in range(pid, n_tiles, n_progs):
            rows = tl.arange(0, BLOCK_M).to(tl.int64) + tile * BLOCK_M  # row count < 2^31; offsets are int64
            rmask = rows < M
            mask = rmask[:, None] & cmask[None, :]
            dy = load_2d(DY, rows, cols, stride_dym, stride_dyn, mask).to(tl.float32)
            x = load_2d(X, rows, cols, stride_xm, stride_xn, mask).to(tl.float32)
            rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
            xhat = x * rstd[:, None]
            if HAS_W:
                g = dy * w[None, :]
            else:
                g = dy
            c = tl.sum(g * xhat, axis=1) / N
            _store_dx(DX, DRES, g, xhat, c, rstd, rows, cols, mask, N, stride_drm, stride_drn, HAS_DRES)
            if COMPUTE_DW:
                dw_acc += tl.sum(dy * xhat, axis=0)
        if COMPUTE_DW:
            tl.store(DWP + pid.to(tl.int64) * N + cols, dw_acc, mask=cmask)
    else:
        for tile in range(pid, n_tiles, n_progs):
            rows = tl.arange(0, BLOCK_M).to(tl.int64) + tile * BLOCK_M  # row count < 2^31; offsets are int64
            rmask = rows < M
            rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
            acc = tl.zeros([BLOCK_M], dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                mask = rmask[:, None] & (cols < N)[None, :]
                dy = load_2d(DY, rows, cols, stride_dym, stride_dyn, mask).to(tl.float32)
                x = load_2d(X, rows, cols, stride_xm, stride_xn, mask).to(tl.float32)
                if HAS_W:
                    dy = dy * _load_weight(W, cols, N)[None, :]
                acc += tl.sum(dy * x, axis=1)
            c = acc * rstd / N
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                cmask = cols < N
                mask = rmask[:, None] & cmask[None, :]
                dy = load_2d(DY, rows, cols, stride_dym, stride_dyn, mask).to(tl.float32)
                x = load_2d(X, rows, cols, stride_xm, stride_xn, mask).to(tl.float32)
                xhat = x * rstd[:, None]
                if HAS_W:
                    g = dy * _load_weight(W, cols, N)[None, :]
                else:
                    g = dy
                _store_dx(DX, DRES, g, xhat, c, rstd, rows, cols, mask, N, stride_drm, stride_drn, HAS_DRES)
                if COMPUTE_DW:
                    # This program owns row `pid` of the partial buffer: read-modify-write, no atomics.
                    p = DWP + pid.to(tl.int64) * N + cols
                    tl.store(p, tl.load(p, mask=cmask, other=0.0) + tl.sum(dy * xhat, axis=0), mask=cmask)


def _tiling(n: int) -> tuple[int, int, bool, int]:
    """(BLOCK_M, BLOCK_N, one_pass, num_warps) for rows of width n."""
    block_n = min(triton.next_power_of_2(max(n, 1)), MAX_BLOCK_N)
    one_pass = n <= block_n
    # Enough elements per tile to keep loads wide; the interpreter prefers big tiles (fewer steps).
    tile_elems = 16384 if triton_interpret() else 4096
    block_m = max(1, min(tile_elems // block_n, 64))
    num_warps = 4 if block_n <= 2048 else 8 if block_n <= 8192 else 16
    return block_m, block_n, one_pass, num_warps


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    # A view when the leading dims flatten onto one stride (e.g. a transposed 2-D tensor), else a copy.
    return t.reshape(-1, t.shape[-1])


def _num_programs(device: torch.device, n_tiles: int) -> int:
    return num_programs(device, n_tiles, per_sm=2)  # two resident programs per SM hide the reduction


def _launchable(kernel, wrap):
    # ``wrap`` is torch.library.wrap_triton for the triton_op variant (titan_kernels.ops.rms_norm_triton_op),
    # so that Inductor traces the launch; plain launches otherwise.
    return kernel if wrap is None else wrap(kernel)


def rms_norm_fwd(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float, *, wrap=None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Triton forward; same contract as ``titan_kernels.reference.rms_norm.rms_norm_fwd``.

    wrap: None, or ``torch.library.wrap_triton`` when called from a ``triton_op`` body.
    """
    n = x.shape[-1]
    x2 = _as_rows(x)
    m = x2.shape[0]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    if m == 0 or n == 0:
        if n == 0:
            rstd.fill_(eps ** -0.5)
        return y, h, rstd
    r2 = _as_rows(residual) if residual is not None else x2
    block_m, block_n, one_pass, num_warps = _tiling(n)
    grid = (triton.cdiv(m, block_m),)
    _launchable(_rms_norm_fwd_kernel, wrap)[grid](
        x2, r2, weight if weight is not None else x2, y, h if h is not None else y, rstd,
        m, n,
        x2.stride(0), x2.stride(1), r2.stride(0), r2.stride(1),
        eps,
        HAS_W=weight is not None, HAS_RES=residual is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, ONE_PASS=one_pass, num_warps=num_warps,
    )
    return y, h, rstd


def rms_norm_bwd(dy, x, weight, rstd, dresidual, compute_dweight, *, wrap=None):
    """Triton backward; the contract (arguments, shapes, dtypes, result) of
    ``titan_kernels.reference.rms_norm.rms_norm_bwd``.

    wrap: None, or ``torch.library.wrap_triton`` when called from a ``triton_op`` body.
    """
    n = x.shape[-1]
    x2 = _as_rows(x)
    dy2 = _as_rows(dy)
    m = x2.shape[0]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    compute_dw = compute_dweight and weight is not None
    if m == 0 or n == 0:
        if dresidual is not None:
            dx.copy_(dresidual)
        dw = torch.zeros_like(weight) if compute_dw else None
        return dx, dw
    dr2 = _as_rows(dresidual) if dresidual is not None else dy2
    block_m, block_n, one_pass, num_warps = _tiling(n)
    n_tiles = triton.cdiv(m, block_m)
    g = _num_programs(x.device, n_tiles)
    dwp = None
    if compute_dw:
        alloc = torch.empty if one_pass else torch.zeros
        dwp = alloc((g, n), dtype=torch.float32, device=x.device)
    _launchable(_rms_norm_bwd_kernel, wrap)[(g,)](
        dy2, x2, weight if weight is not None else x2, rstd.reshape(-1), dr2, dx,
        dwp if dwp is not None else rstd,
        m, n, n_tiles,
        dy2.stride(0), dy2.stride(1), x2.stride(0), x2.stride(1), dr2.stride(0), dr2.stride(1),
        HAS_W=weight is not None, HAS_DRES=dresidual is not None, COMPUTE_DW=compute_dw,
        BLOCK_M=block_m, BLOCK_N=block_n, ONE_PASS=one_pass, num_warps=num_warps,
    )
    dw = dwp.sum(0).to(weight.dtype) if dwp is not None else None
    return dx, dw
