"""Triton grouped GEMM over experts: y[group e] = x[group e] @ w[e], its dx (the same kernel on w^T)
and dw[e] = x[group e]^T @ dy[group e]. Math: titan_kernels/reference/moe.py.

Persistent tile queue: the output tiles of every group form one list (group e owns
cdiv(rows_e, BLOCK_M) * cdiv(N, BLOCK_N) tiles, counted on the device from the offsets, so no host
sync), and min(#SMs, bound) programs walk it with a stride of the program count. A program finds its
tile's group by comparing the tile index with the groups' cumulative tile ends (one vector load, E <=
BLOCK_E), so empty groups cost nothing and a group that is not a multiple of the tile is masked in
its last tile. Rows of a tile past its group are computed but never stored (a row of y depends only
on the same row of x), which lets the TMA variant read whole tiles.

  _gmm_kernel       pointer loads with masks: any strides and sizes.
  _gmm_tma_kernel   sm_90: x and w read through TMA tensor descriptors (w as a 3-D (E, K, N)
                    descriptor, so a tile never reads the next expert's rows: out-of-bounds K is
                    zero-filled); needs 16-byte-aligned rows. ``TRANS_B`` reads w^T for dx.
  _gmm_dw_kernel    dw: one tile per (expert, K block, N block), a loop over the group's rows;
                    an empty group stores zeros.
  _zero_rows_kernel zeros the rows past the last group (programs below it return at once).
The walk of the queue (``_queue_tile``), the dw tile list (``_dw_tile``), the pointer main loops
(``_tile_acc``, ``_dw_tile_acc``, float8 tiles under ``FP8``) and the launch pieces (``tile_queue``,
``row_starts``, ``interpret_config``) are shared with ``titan_kernels.triton.fp8_grouped_mm``.

Accumulation in float32; float32 inputs use IEEE products unless torch allows TF32 for matmuls.
Row offsets are int64. Fixed configs (no autotuning yet): 128x128x64 at 8 warps for 16-bit types.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from titan_kernels.triton import triton_interpret
from titan_kernels.triton.persistent import num_programs

try:  # host-side TMA descriptors (triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton: the pointer kernel only
    TensorDescriptor = None


@triton.jit
def _group_of(tile, TILE_END, E, BLOCK_E: tl.constexpr):
    eidx = tl.arange(0, BLOCK_E)
    ends = tl.load(TILE_END + eidx, mask=eidx < E, other=2147483647)
    return tl.sum((ends <= tile).to(tl.int32), axis=0)


@triton.jit
def _queue_tile(tile, OFFS, ROW_START, TILE_START, TILE_END, E, tiles_n,
                BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Tile ``tile`` of the persistent queue (``_schedule``): (its group e, its first row and first
    column, the group's row end), int32. Shared by every kernel that walks the queue (also
    ``titan_kernels.triton.fp8_grouped_mm``)."""
    e = _group_of(tile, TILE_END, E, BLOCK_E)
    local = tile - tl.load(TILE_START + e)
    off_m = tl.load(ROW_START + e) + (local // tiles_n) * BLOCK_M
    off_n = (local % tiles_n) * BLOCK_N
    return e, off_m, off_n, tl.load(OFFS + e)


@triton.jit
def _queue_tile_ranges(tile, OFFS, ROW_START, TILE_START, TILE_END, E, N, tiles_n,
                       BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``_queue_tile`` for pointer loads: (e, rows rm (int64), columns rn, their masks in_m, in_n)."""
    e, off_m, off_n, row_end = _queue_tile(tile, OFFS, ROW_START, TILE_START, TILE_END, E, tiles_n,
                                           BLOCK_E, BLOCK_M, BLOCK_N)
    rm = off_m.to(tl.int64) + tl.arange(0, BLOCK_M)
    rn = off_n + tl.arange(0, BLOCK_N)
    return e, rm, rn, rm < row_end, rn < N


@triton.jit
def _dw_tile(tile, OFFS, ROW_START, K, N, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Tile ``tile`` of a weight gradient's (expert, K block, N block) list: (e, rk, rn, their masks
    in_k, in_n, the group's first row and row end (int64)). Shared with the float8 dw kernel."""
    tiles_k = tl.cdiv(K, BLOCK_K)
    tiles_n = tl.cdiv(N, BLOCK_N)
    e = tile // (tiles_k * tiles_n)
    rest = tile % (tiles_k * tiles_n)
    rk = (rest // tiles_n) * BLOCK_K + tl.arange(0, BLOCK_K)
    rn = (rest % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_start = tl.load(ROW_START + e).to(tl.int64)
    row_end = tl.load(OFFS + e).to(tl.int64)
    return e, rk, rn, rk < K, rn < N, row_start, row_end


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    # DOT_F32: the interpreter multiplies bfloat16 blocks as raw bits (numpy has no bfloat16), so
    # there the blocks are widened first; compiled code multiplies them on the tensor cores.
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _reduce_acc(A, B, i, j, in_i, in_j, lo, hi, s_ai, s_ar, s_br, s_bj,
                FP8: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr, R_FIRST: tl.constexpr,
                BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_R: tl.constexpr):
    """The float32 (BLOCK_I, BLOCK_J) sum over r in [lo, hi) of A[i, r] B[r, j] (element (i, r) of A at
    i * s_ai + r * s_ar, (r, j) of B at r * s_br + j * s_bj), pointer loads with masks. ``FP8``: B read
    as (BLOCK_J, BLOCK_R) tiles, r-contiguous for the codes fp8 wgmma reads, the tensor cores' partial
    sums promoted to float32 once per block of r (PRECISION, DOT_F32 unused). ``R_FIRST`` adds the r
    offsets of A and the float8 B first: the same addresses, the order each kernel compiles best with
    (the other order costs the GEMM kernels 8 SASS instructions and the dw kernels 2 registers)."""
    acc = tl.zeros((BLOCK_I, BLOCK_J), dtype=tl.float32)
    for r0 in range(lo, hi, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        in_r = r < hi
        if R_FIRST:
            a = tl.load(A + r[None, :] * s_ar + i[:, None] * s_ai, mask=in_i[:, None] & in_r[None, :], other=0.0)
        else:
            a = tl.load(A + i[:, None] * s_ai + r[None, :] * s_ar, mask=in_i[:, None] & in_r[None, :], other=0.0)
        if FP8:
            if R_FIRST:
                bt = tl.load(B + r[None, :] * s_br + j[:, None] * s_bj, mask=in_j[:, None] & in_r[None, :], other=0.0)
            else:
                bt = tl.load(B + j[:, None] * s_bj + r[None, :] * s_br, mask=in_j[:, None] & in_r[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(bt), acc, max_num_imprecise_acc=BLOCK_R)
        else:
            b = tl.load(B + r[:, None] * s_br + j[None, :] * s_bj, mask=in_r[:, None] & in_j[None, :], other=0.0)
            acc = _dot(a, b, acc, PRECISION, DOT_F32)
    return acc


@triton.jit
def _tile_acc(A, B, e, rm, rn, in_m, in_n, K, stride_am, stride_ak, stride_be, stride_bk, stride_bn,
              FP8: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The float32 (BLOCK_M, BLOCK_N) product of rows rm of A and columns rn of expert e's B over K.
    ``FP8`` (the float8 kernel): B K-contiguous (column-major expert codes)."""
    return _reduce_acc(A, B + e.to(tl.int64) * stride_be, rm, rn, in_m, in_n, 0, K, stride_am, stride_ak, stride_bk,
                       stride_bn, FP8, PRECISION, DOT_F32, False, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def _dw_tile_acc(X, DY, rk, rn, in_k, in_n, row_start, row_end, stride_xm, stride_xk, stride_dym, stride_dyn,
                 FP8: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The float32 (BLOCK_K, BLOCK_N) product X[rows]^T @ DY[rows] over a group's rows [row_start,
    row_end). ``FP8`` (the float8 kernel): both tiles token-contiguous (token-major codes)."""
    return _reduce_acc(X, DY, rk, rn, in_k, in_n, row_start, row_end, stride_xk, stride_xm, stride_dym, stride_dyn,
                       FP8, PRECISION, DOT_F32, True, BLOCK_K, BLOCK_N, BLOCK_M)


@triton.jit
def _gmm_kernel(
    A, B, C, OFFS, ROW_START, TILE_START, TILE_END,
    E, N, K,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm,
    PRECISION: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tiles_n = tl.cdiv(N, BLOCK_N)
    for tile in range(tl.program_id(0), tl.load(TILE_END + E - 1), tl.num_programs(0)):
        e, rm, rn, in_m, in_n = _queue_tile_ranges(tile, OFFS, ROW_START, TILE_START, TILE_END, E, N, tiles_n,
                                                   BLOCK_E, BLOCK_M, BLOCK_N)
        acc = _tile_acc(A, B, e, rm, rn, in_m, in_n, K, stride_am, stride_ak, stride_be, stride_bk, stride_bn,
                        False, PRECISION, DOT_F32, BLOCK_M, BLOCK_N, BLOCK_K)
        tl.store(C + rm[:, None] * stride_cm + rn[None, :], acc.to(C.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])


@triton.jit
def _gmm_tma_kernel(
    a_desc, b_desc, C, OFFS, ROW_START, TILE_START, TILE_END,
    E, N, K, stride_cm,
    TRANS_B: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tiles_n = tl.cdiv(N, BLOCK_N)
    for tile in range(tl.program_id(0), tl.load(TILE_END + E - 1), tl.num_programs(0)):
        e, off_m, off_n, row_end = _queue_tile(tile, OFFS, ROW_START, TILE_START, TILE_END, E, tiles_n,
                                               BLOCK_E, BLOCK_M, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = a_desc.load([off_m, k0])
            if TRANS_B:  # w stored (E, N_out, K_contraction): dx = dy @ w^T
                b = tl.trans(b_desc.load([e, off_n, k0]).reshape(BLOCK_N, BLOCK_K))
            else:
                b = b_desc.load([e, k0, off_n]).reshape(BLOCK_K, BLOCK_N)
            acc = _dot(a, b, acc, PRECISION, DOT_F32)
        rm = off_m.to(tl.int64) + tl.arange(0, BLOCK_M)
        rn = off_n + tl.arange(0, BLOCK_N)
        # Pointer store: the tile's rows past its group belong to the next group.
        tl.store(C + rm[:, None] * stride_cm + rn[None, :], acc.to(C.dtype.element_ty),
                 mask=(rm < row_end)[:, None] & (rn < N)[None, :])


@triton.jit
def _gmm_dw_kernel(
    X, DY, DW, OFFS, ROW_START,
    E, K, N,
    stride_xm, stride_xk, stride_dym, stride_dyn, stride_we, stride_wk,
    PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    for tile in range(tl.program_id(0), E * tl.cdiv(K, BLOCK_K) * tl.cdiv(N, BLOCK_N), tl.num_programs(0)):
        e, rk, rn, in_k, in_n, row_start, row_end = _dw_tile(tile, OFFS, ROW_START, K, N, BLOCK_N, BLOCK_K)
        acc = _dw_tile_acc(X, DY, rk, rn, in_k, in_n, row_start, row_end, stride_xm, stride_xk, stride_dym, stride_dyn,
                           False, PRECISION, DOT_F32, BLOCK_M, BLOCK_N, BLOCK_K)
        tl.store(DW + e.to(tl.int64) * stride_we + rk[:, None] * stride_wk + rn[None, :], acc.to(DW.dtype.element_ty),
                 mask=in_k[:, None] & in_n[None, :])


@triton.jit
def _zero_rows_kernel(Y, OFFS, E, T, N, stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    first = tl.load(OFFS + E - 1).to(tl.int64)
    row0 = tl.program_id(0).to(tl.int64) * BLOCK_M
    if row0 + BLOCK_M > first:
        rm = row0 + tl.arange(0, BLOCK_M)
        in_m = (rm >= first) & (rm < T)
        for n0 in range(0, N, BLOCK_N):
            rn = n0 + tl.arange(0, BLOCK_N)
            tl.store(Y + rm[:, None] * stride_ym + rn[None, :], tl.zeros((BLOCK_M, BLOCK_N), dtype=Y.dtype.element_ty),
                     mask=in_m[:, None] & (rn < N)[None, :])


# ----------------------------------------------------------------------------- launchers


def _precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"  # ignored for 16-bit inputs


def _dot_f32(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and triton_interpret()


def interpret_config(n: int, k: int) -> dict:
    """Small blocks for the interpreter (no launch options): also the float8 kernels'."""
    fit = lambda s, hi: max(16, min(hi, triton.next_power_of_2(max(s, 1))))  # noqa: E731
    return dict(BLOCK_M=16, BLOCK_N=fit(n, 32), BLOCK_K=fit(k, 32))


def default_config(dtype: torch.dtype, n: int, k: int) -> dict:
    """Block sizes and launch options (interpreter: small blocks, no launch options)."""
    if triton_interpret():
        return interpret_config(n, k)
    if dtype == torch.float32:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)


def tma_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """sm_90+, triton with host tensor descriptors, 16-byte-aligned rows and bases."""
    if TensorDescriptor is None or x.device.type != "cuda" or torch.cuda.get_device_capability(x.device)[0] < 9:
        return False
    es = x.element_size()
    return (x.shape[1] * es) % 16 == 0 and (w.shape[2] * es) % 16 == 0


def row_starts(offsets: torch.Tensor) -> torch.Tensor:
    """Each group's first row (int64, on the device): the previous group's end, 0 for the first."""
    ends = offsets.to(torch.int64)
    return torch.cat([ends.new_zeros(1), ends[:-1]])


def _schedule(offsets: torch.Tensor, block_m: int, tiles_n: int):
    """(row starts, tile starts, tile ends) per group, int32 on the device (no host sync)."""
    ends = offsets.to(torch.int64)
    starts = row_starts(offsets)
    tiles = (ends - starts + block_m - 1) // block_m * tiles_n
    tile_end = torch.cumsum(tiles, 0)
    return starts.to(torch.int32), (tile_end - tiles).to(torch.int32), tile_end.to(torch.int32)


def tile_queue(offsets: torch.Tensor, t: int, n: int, cfg: dict, device: torch.device):
    """The launch of a kernel walking the tile queue over T rows and N output columns with blocks
    ``cfg``: (grid, (row starts, tile starts, tile ends) of ``_schedule``, BLOCK_E). The grid bounds
    the tiles from above without a host sync: each group adds at most one partial row block."""
    e = offsets.shape[0]
    bm, tiles_n = cfg["BLOCK_M"], triton.cdiv(n, cfg["BLOCK_N"])
    grid = (num_programs(device, (triton.cdiv(t, bm) + e) * tiles_n),)
    return grid, _schedule(offsets, bm, tiles_n), max(16, triton.next_power_of_2(e))


def _grouped_mm(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, trans_b: bool, use_tma: bool | None = None):
    """c (T, N_out) = a[group e] @ B[e] with B = w (E, K, N) or, trans_b, w^T (contraction over w's N)."""
    t, kc = a.shape
    e = w.shape[0]
    n = w.shape[1] if trans_b else w.shape[2]
    c = torch.empty((t, n), dtype=a.dtype, device=a.device)
    if t == 0 or n == 0:
        return c
    cfg = default_config(a.dtype, n, kc)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    grid, (row_start, tile_start, tile_end), block_e = tile_queue(offsets, t, n, cfg, a.device)
    common = dict(PRECISION=_precision(a.dtype), DOT_F32=_dot_f32(a.dtype), BLOCK_E=block_e, **cfg)
    if use_tma is None:
        use_tma = not triton_interpret() and tma_supported(a, w if not trans_b else w.transpose(1, 2))
    if use_tma:
        # TMA wants row-major operands with 16-byte-aligned bases.
        a, w = (u.contiguous() if u.data_ptr() % 16 == 0 else u.clone(memory_format=torch.contiguous_format) for u in (a, w))
        a_desc = TensorDescriptor(a, [t, kc], [kc, 1], [bm, bk])
        ek, en = w.shape[1], w.shape[2]
        b_desc = TensorDescriptor(w, [e, ek, en], [ek * en, en, 1], [1, bn, bk] if trans_b else [1, bk, bn])
        _gmm_tma_kernel[grid](a_desc, b_desc, c, offsets, row_start, tile_start, tile_end,
                              e, n, kc, c.stride(0), TRANS_B=trans_b, **common)
        return c
    sb_e, sb_k, sb_n = (w.stride(0), w.stride(2), w.stride(1)) if trans_b else (w.stride(0), w.stride(1), w.stride(2))
    _gmm_kernel[grid](a, w, c, offsets, row_start, tile_start, tile_end, e, n, kc,
                      a.stride(0), a.stride(1), sb_e, sb_k, sb_n, c.stride(0), **common)
    return c


def zero_rows_from(y: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Zero the rows of y (T, N) at and past offsets[-1], in place, reading offsets on the device."""
    t, n = y.shape
    if t and n:
        bm, bn = 64, min(256, max(16, triton.next_power_of_2(n)))
        _zero_rows_kernel[(triton.cdiv(t, bm),)](y, offsets, offsets.shape[0], t, n, y.stride(0), BLOCK_M=bm, BLOCK_N=bn)
    return y


def grouped_mm_fwd(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, use_tma: bool | None = None):
    """Triton version of ``reference.moe.grouped_mm_fwd`` (rows past the last group zero)."""
    return zero_rows_from(_grouped_mm(x, w, offsets, False, use_tma), offsets)


def grouped_mm_bwd(dy, x, w, offsets, need_dx: bool = True, need_dw: bool = True, use_tma: bool | None = None):
    """Triton version of ``reference.moe.grouped_mm_bwd``: dx (the forward kernel on w^T) and dw."""
    dx = zero_rows_from(_grouped_mm(dy, w, offsets, True, use_tma), offsets) if need_dx else None
    dw = None
    if need_dw:
        e, k, n = w.shape
        dw = torch.empty((e, k, n), dtype=w.dtype, device=w.device)
        if k and n:
            cfg = default_config(x.dtype, n, k)
            bk, bn = cfg["BLOCK_K"] if triton_interpret() else 64, cfg["BLOCK_N"]
            cfg = dict(cfg, BLOCK_K=bk)
            starts = row_starts(offsets).to(torch.int32)
            grid = (num_programs(x.device, e * triton.cdiv(k, bk) * triton.cdiv(n, bn)),)
            _gmm_dw_kernel[grid](x, dy, dw, offsets, starts, e, k, n,
                                 x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), dw.stride(0), dw.stride(1),
                                 PRECISION=_precision(x.dtype), DOT_F32=_dot_f32(x.dtype), **cfg)
    return dx, dw
