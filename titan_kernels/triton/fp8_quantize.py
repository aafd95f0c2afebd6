"""Triton float8 quantization: amax, scale and saturated cast fused, one kernel per pass.

Same math and contracts as ``titan_kernels.reference.fp8`` (the scales agree bit for bit):
  rowwise     one kernel: a program owns BLOCK_R rows, takes their amax (one read when the row fits
              in a block, else a loop over column chunks), writes the scales, then casts.
  colwise     one kernel: a program owns BLOCK_C columns, loops over row chunks for the amax, then
              casts; codes are written column-major, so ``codes.t()`` is the row-major operand the
              weight-gradient GEMM wants.
  tensorwise  two kernels (a global amax must be known before any element is cast): pass 1 writes
              one partial amax per persistent program; pass 2 reduces those partials in every
              program, computes the scale (program 0 stores it) and casts.

Inputs are read through arbitrary 2-D strides with int64 offsets. amax reductions propagate NaN, as
``torch.amax`` does (a NaN element makes its group's scale NaN, never a silent finite one). The cast rounds to the fp8 grid explicitly in float32 (round to nearest even
on the mantissa bits) before converting: the result is exactly representable, so the conversion
itself cannot round. This is needed under the Triton interpreter, whose float32 -> fp8 conversion
mis-rounds values that round up into the next binade (e.g. 126.9 -> 64 instead of 128 in e4m3,
triton 3.9); on GPUs it costs a few integer ops in a memory-bound kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from titan_kernels.triton import triton_interpret
from titan_kernels.reference.fp8 import AMAX_EPS, FP8_MAX, empty_colwise, scale_from_amax

_AMAX_EPS = tl.constexpr(AMAX_EPS)
# NaN as its float32 bit pattern: a NaN constexpr global compares unequal to itself, so the compiled
# JIT's "global changed since compile" check would reject every launch (tests/test_sm90_compile.py).
_NAN_BITS = tl.constexpr(0x7FC00000)
# (mantissa bits, exponent of the smallest normal) of each format (OCP FP8 spec).
_FORMAT = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}


@triton.jit
def _nanmax(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _reduce_nanmax(v, axis):
    # tl.max drops NaN on GPUs; a custom-combine tl.reduce would keep it but crawls in the
    # interpreter. So: the plain max, then NaN wherever the reduced group holds one.
    has_nan = tl.max((v != v).to(tl.int32), axis)
    nan = tl.full((), _NAN_BITS, tl.int32).to(tl.float32, bitcast=True)
    return tl.where(has_nan > 0, nan, tl.max(v, axis))


@triton.jit
def _scale_from_amax(amax, FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    """(mult, scale) from a float32 amax, as ``reference.fp8.scale_from_amax`` (IEEE divisions:
    a plain ``/`` is approximate on NVIDIA GPUs)."""
    amax = tl.maximum(amax, _AMAX_EPS, propagate_nan=tl.PropagateNan.ALL)
    mult = tl.math.div_rn(FP8_MAX, amax)
    if POW2:
        mult = (mult.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    scale = tl.math.div_rn(1.0, mult)
    return mult, scale


@triton.jit
def _to_fp8_grid(y, FP8_MAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr):
    """clamp(y, +-FP8_MAX) rounded to nearest even on the fp8 grid, still in float32; NaN stays NaN."""
    a = tl.minimum(tl.abs(y), FP8_MAX)
    # Normal range: round the float32 mantissa to MANT bits (a carry moves into the exponent).
    SHIFT: tl.constexpr = 23 - MANT
    bits = a.to(tl.int32, bitcast=True)
    bits = bits + ((1 << (SHIFT - 1)) - 1) + ((bits >> SHIFT) & 1)
    normal = (bits & ~((1 << SHIFT) - 1)).to(tl.float32, bitcast=True)
    # Subnormal range: a fixed step 2^(EMIN - MANT); adding a constant whose float32 ulp is that
    # step makes the FPU round to it.
    MAGIC: tl.constexpr = 2.0 ** (EMIN - MANT + 23)
    sub = (a + MAGIC) - MAGIC
    r = tl.where(a < 2.0 ** EMIN, sub, normal)
    r = tl.where(y.to(tl.int32, bitcast=True) < 0, -r, r)  # sign bit: -0.0 stays -0.0
    return tl.where(y != y, y, r)


@triton.jit
def _amax_partial_kernel(
    X, PARTIAL, R, C, stride_r, stride_c, n_tiles_c, n_tiles,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for t in range(pid, n_tiles, tl.num_programs(0)):
        rows = (t // n_tiles_c) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
        cols = (t % n_tiles_c) * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
        mask = (rows < R)[:, None] & (cols < C)[None, :]
        x = tl.load(X + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0)
        acc = _nanmax(acc, tl.abs(x.to(tl.float32)))
    tl.store(PARTIAL + pid, _reduce_nanmax(acc, None))


@triton.jit
def _tensorwise_cast_kernel(
    X, Y, PARTIAL, SCALE, n_partials, R, C, stride_r, stride_c, n_tiles_c, n_tiles,
    FP8_MAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, POW2: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr,
):
    p = tl.arange(0, BLOCK_P)
    amax = _reduce_nanmax(tl.load(PARTIAL + p, mask=p < n_partials, other=0.0), 0)
    mult, scale = _scale_from_amax(amax, FP8_MAX, POW2)
    pid = tl.program_id(0)
    if pid == 0:
        tl.store(SCALE, scale)
    for t in range(pid, n_tiles, tl.num_programs(0)):
        rows = (t // n_tiles_c) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
        cols = (t % n_tiles_c) * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
        mask = (rows < R)[:, None] & (cols < C)[None, :]
        x = tl.load(X + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0)
        y = _to_fp8_grid(x.to(tl.float32) * mult, FP8_MAX, MANT, EMIN)
        tl.store(Y + rows[:, None] * C + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rowwise_kernel(
    X, Y, SCALE, R, C, stride_r, stride_c,
    FP8_MAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, POW2: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ONE_PASS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    rmask = rows < R
    if ONE_PASS:
        cols = tl.arange(0, BLOCK_C).to(tl.int64)
        mask = rmask[:, None] & (cols < C)[None, :]
        x = tl.load(X + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0).to(tl.float32)
        mult, scale = _scale_from_amax(_reduce_nanmax(tl.abs(x), 1), FP8_MAX, POW2)
        y = _to_fp8_grid(x * mult[:, None], FP8_MAX, MANT, EMIN)
        tl.store(Y + rows[:, None] * C + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
        for start in range(0, C, BLOCK_C):
            cols = start + tl.arange(0, BLOCK_C).to(tl.int64)
            mask = rmask[:, None] & (cols < C)[None, :]
            x = tl.load(X + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0)
            acc = _nanmax(acc, tl.abs(x.to(tl.float32)))
        mult, scale = _scale_from_amax(_reduce_nanmax(acc, 1), FP8_MAX, POW2)
        for start in range(0, C, BLOCK_C):
            cols = start + tl.arange(0, BLOCK_C).to(tl.int64)
            mask = rmask[:, None] & (cols < C)[None, :]
            x = tl.load(X + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0)
            y = _to_fp8_grid(x.to(tl.float32) * mult[:, None], FP8_MAX, MANT, EMIN)
            tl.store(Y + rows[:, None] * C + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(SCALE + rows, scale, mask=rmask)


@triton.jit
def _colwise_kernel(
    X, Y, SCALE, R, C, stride_r, stride_c,
    FP8_MAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, POW2: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    cols = tl.program_id(0).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
    cmask = cols < C
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for start in range(0, R, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R).to(tl.int64)
        mask = (rows < R)[:, None] & cmask[None, :]
        x = tl.load(X + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0)
        acc = _nanmax(acc, tl.abs(x.to(tl.float32)))
    mult, scale = _scale_from_amax(_reduce_nanmax(acc, 0), FP8_MAX, POW2)
    for start in range(0, R, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R).to(tl.int64)
        mask = (rows < R)[:, None] & cmask[None, :]
        x = tl.load(X + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0)
        y = _to_fp8_grid(x.to(tl.float32) * mult[None, :], FP8_MAX, MANT, EMIN)
        # Column-major codes: element (r, c) at c * R + r.
        tl.store(Y + cols[None, :] * R + rows[:, None], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(SCALE + cols, scale, mask=cmask)


# ----------------------------------------------------------------------------- launchers


def _tile_elems() -> int:
    # The interpreter runs programs one after another: fewer, bigger tiles are much faster there.
    return 16384 if triton_interpret() else 4096


def _num_warps(block_elems: int) -> int:
    return 4 if block_elems <= 2048 else 8 if block_elems <= 8192 else 16


def _max_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 0:
        return x.reshape(1, 1)
    if x.dim() == 1:
        return x.reshape(1, -1)
    return x.reshape(-1, x.shape[-1])  # a view when the leading dims flatten onto one stride


def _consts(dtype: torch.dtype, pow2: bool) -> dict:
    mant, emin = _FORMAT[dtype]
    return dict(FP8_MAX=FP8_MAX[dtype], MANT=mant, EMIN=emin, POW2=bool(pow2))


def _tensorwise_tiles(r: int, c: int) -> tuple[int, int, int, int]:
    block_c = min(triton.next_power_of_2(max(c, 1)), 1024)
    block_r = max(1, _tile_elems() // block_c)
    block_r = min(block_r, triton.next_power_of_2(max(r, 1)))
    n_tiles_c = triton.cdiv(c, block_c)
    return block_r, block_c, n_tiles_c, triton.cdiv(r, block_r) * n_tiles_c


def _amax_partials(x2: torch.Tensor) -> torch.Tensor:
    """float32 (G,) partial amaxes of a non-empty 2-D tensor (pass 1 of tensorwise)."""
    r, c = x2.shape
    block_r, block_c, n_tiles_c, n_tiles = _tensorwise_tiles(r, c)
    g = max(1, min(n_tiles, _max_programs(x2.device)))
    partial = torch.empty(g, dtype=torch.float32, device=x2.device)
    _amax_partial_kernel[(g,)](
        x2, partial, r, c, x2.stride(0), x2.stride(1), n_tiles_c, n_tiles,
        BLOCK_R=block_r, BLOCK_C=block_c, num_warps=_num_warps(block_r * block_c),
    )
    return partial


def _tensorwise_cast(x: torch.Tensor, partial: torch.Tensor, dtype: torch.dtype, pow2: bool):
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    scale = torch.empty((), dtype=torch.float32, device=x.device)
    x2 = _as_2d(x)
    r, c = x2.shape
    block_r, block_c, n_tiles_c, n_tiles = _tensorwise_tiles(r, c)
    g = max(1, min(n_tiles, _max_programs(x.device)))
    _tensorwise_cast_kernel[(g,)](
        x2, out, partial, scale, partial.numel(), r, c, x2.stride(0), x2.stride(1), n_tiles_c, n_tiles,
        **_consts(dtype, pow2), BLOCK_R=block_r, BLOCK_C=block_c,
        BLOCK_P=triton.next_power_of_2(partial.numel()), num_warps=_num_warps(block_r * block_c),
    )
    return out, scale


def tensorwise_amax(x: torch.Tensor) -> torch.Tensor:
    """max(|x|) as a float32 () tensor (0 for an empty x); same contract as the reference."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return _amax_partials(_as_2d(x)).amax()


def fp8_quantize_from_amax(x: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype, round_scales_to_power_of_2: bool):
    """Tensorwise pass 2 with a given amax; same contract as ``reference.fp8.fp8_quantize_from_amax``."""
    amax = amax.reshape(1).to(torch.float32)
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=dtype, device=x.device), scale_from_amax(amax.reshape(()), dtype, round_scales_to_power_of_2)[1]
    return _tensorwise_cast(x, amax, dtype, round_scales_to_power_of_2)


def fp8_quantize(x: torch.Tensor, dtype: torch.dtype, granularity: str, round_scales_to_power_of_2: bool):
    """Triton quantization; same contract as ``titan_kernels.reference.fp8.fp8_quantize``."""
    pow2 = round_scales_to_power_of_2
    if granularity == "tensorwise":
        if x.numel() == 0:
            return fp8_quantize_from_amax(x, torch.zeros((), device=x.device), dtype, pow2)
        return _tensorwise_cast(x, _amax_partials(_as_2d(x)), dtype, pow2)

    r, c = x.shape
    if granularity == "rowwise":
        out = torch.empty((r, c), dtype=dtype, device=x.device)
        scale = torch.empty((r, 1), dtype=torch.float32, device=x.device)
    else:
        out = empty_colwise(r, c, dtype, x.device)
        scale = torch.empty((1, c), dtype=torch.float32, device=x.device)
    if r == 0 or c == 0:
        # Empty groups: amax 0, so the floored scale (no kernel for zero elements).
        scale.copy_(scale_from_amax(torch.zeros_like(scale), dtype, pow2)[1])
        return out, scale

    if granularity == "rowwise":
        block_c = min(triton.next_power_of_2(c), 8192 if not triton_interpret() else 16384)
        one_pass = c <= block_c
        if not one_pass:
            block_c = min(block_c, 2048)
        block_r = max(1, min(_tile_elems() // block_c, 64, triton.next_power_of_2(r)))
        _rowwise_kernel[(triton.cdiv(r, block_r),)](
            x, out, scale, r, c, x.stride(0), x.stride(1), **_consts(dtype, pow2),
            BLOCK_R=block_r, BLOCK_C=block_c, ONE_PASS=one_pass, num_warps=_num_warps(block_r * block_c),
        )
    else:
        block_c = min(triton.next_power_of_2(c), 1024 if triton_interpret() else 64)
        block_r = max(1, min(_tile_elems() // block_c, triton.next_power_of_2(r)))
        _colwise_kernel[(triton.cdiv(c, block_c),)](
            x, out, scale, r, c, x.stride(0), x.stride(1), **_consts(dtype, pow2),
            BLOCK_R=block_r, BLOCK_C=block_c, num_warps=_num_warps(block_r * block_c),
        )
    return out, scale
