"""Triton float8 scaled GEMM: out = (a * a_scale) @ (b * b_scale)^T (+ bias), the nn.Linear layout.

Same contract as ``titan_kernels.reference.fp8.fp8_gemm``: a (M, K) and b (N, K) in e4m3fn or e5m2
(mixed allowed), a_scale () or (M, 1), b_scale () or (N, 1) float32, bias (N,) or None; the
product accumulates in float32, the scales and the bias are applied to the float32 tile in the
epilogue, and the result is rounded once to out_dtype into a contiguous (M, N) tensor.

Two kernels, both persistent (one program per SM walks over output tiles in GROUP_M-swizzled
order, so neighbouring programs share A rows and B columns in L2):
  * ``_fp8_gemm_tma_kernel``: operands and output through TMA tensor descriptors (sm_90+). TMA
    zero-fills out-of-bounds reads and clips out-of-bounds writes, so any M, N, K works; it needs
    K-contiguous operands with 16-byte-aligned rows (K % 16 == 0) and output rows
    (N * out bytes % 16 == 0).
  * ``_fp8_gemm_kernel``: plain pointer loads with masks, any strides and sizes: the fallback for
    unaligned shapes and pre-Hopper GPUs, and what the interpreter runs by default.
On CUDA the block sizes are autotuned per (M, N, K) for GEMMs of at least ~4 GFLOP; smaller ones
use one fixed config (tuning would cost more than it saves).

Accumulation: Hopper's fp8 tensor cores accumulate with reduced precision; with
``use_fast_accum=False`` the partial sums are promoted to the float32 accumulator once per K block
(``max_num_imprecise_acc=BLOCK_K``, at most 128 elements, the interval cuBLAS and DeepSeek-V3
use); with True, Triton's default (promote only at the end) is used.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from titan_kernels.triton import triton_interpret
from titan_kernels.triton.persistent import num_programs

try:  # host-side TMA descriptors (triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton: pointer kernel only
    TensorDescriptor = None

_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    group = GROUP_M * num_pid_n
    first_m = (tile // group) * GROUP_M
    rows_in_group = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % group) % rows_in_group
    pid_n = (tile % group) // rows_in_group
    return pid_m, pid_n


@triton.jit
def _dot(a, b, acc, FAST_ACCUM: tl.constexpr, BLOCK_K: tl.constexpr):
    if FAST_ACCUM:
        acc = tl.dot(a, tl.trans(b), acc)
    else:
        acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=BLOCK_K)
    return acc


@triton.jit
def _epilogue(acc, SA, SB, BIAS, rm, rn, M, N, stride_sa, stride_sb, HAS_BIAS: tl.constexpr):
    # Tensorwise scales come with stride 0, so every row (column) reads the one value.
    sa = tl.load(SA + rm * stride_sa, mask=rm < M, other=0.0)
    sb = tl.load(SB + rn * stride_sb, mask=rn < N, other=0.0)
    acc = acc * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _fp8_gemm_kernel(
    A, B, C, SA, SB, BIAS,
    M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_sa, stride_sb,
    HAS_BIAS: tl.constexpr, FAST_ACCUM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    for tile in range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
        rk = tl.arange(0, BLOCK_K).to(tl.int64)
        a_ptrs = A + rm[:, None] * stride_am + rk[None, :] * stride_ak
        b_ptrs = B + rn[:, None] * stride_bn + rk[None, :] * stride_bk
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kmask = (rk + k0) < K
            a = tl.load(a_ptrs, mask=(rm < M)[:, None] & kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=(rn < N)[:, None] & kmask[None, :], other=0.0)
            acc = _dot(a, b, acc, FAST_ACCUM, BLOCK_K)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        acc = _epilogue(acc, SA, SB, BIAS, rm, rn, M, N, stride_sa, stride_sb, HAS_BIAS)
        mask = (rm < M)[:, None] & (rn < N)[None, :]
        tl.store(C + rm[:, None] * stride_cm + rn[None, :], acc.to(C.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_gemm_tma_kernel(
    a_desc, b_desc, c_desc, SA, SB, BIAS,
    M, N, K, stride_sa, stride_sb,
    OUT_DTYPE: tl.constexpr, HAS_BIAS: tl.constexpr, FAST_ACCUM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    for tile in range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = a_desc.load([off_m, k0])
            b = b_desc.load([off_n, k0])
            acc = _dot(a, b, acc, FAST_ACCUM, BLOCK_K)
        rm = off_m + tl.arange(0, BLOCK_M)
        rn = off_n + tl.arange(0, BLOCK_N)
        acc = _epilogue(acc, SA, SB, BIAS, rm, rn, M, N, stride_sa, stride_sb, HAS_BIAS)
        c_desc.store([off_m, off_n], acc.to(OUT_DTYPE))


# ----------------------------------------------------------------------------- CUDA autotuning


def _set_block_shapes(nargs: dict) -> None:
    # Host descriptors carry their block shape: update it to the config being tried.
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [bm, bk]
    nargs["b_desc"].block_shape = [bn, bk]
    nargs["c_desc"].block_shape = [bm, bn]


def _cuda_configs(tma: bool) -> list:
    hook = _set_block_shapes if tma else None
    # (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps): large tiles for Llama shapes, small for small M. The first
    # is the default (what a capped autotuning list keeps): 256x128, since 128x256 spills ~100-350 B of
    # registers at 8 warps on sm_90a (tests/test_sm90_compile.py); autotuning still times it.
    shapes = [
        (256, 128, 128, 3, 8), (128, 256, 128, 3, 8), (128, 128, 128, 4, 8),
        (128, 64, 128, 4, 4), (64, 128, 128, 4, 4), (64, 64, 128, 4, 4),
    ]
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8}, num_stages=s, num_warps=w, pre_hook=hook)
        for m, n, k, s, w in shapes
    ]


_KEY = ["M", "N", "K", "HAS_BIAS", "FAST_ACCUM"]
_fp8_gemm_kernel_tuned = triton.autotune(_cuda_configs(False), key=_KEY)(_fp8_gemm_kernel)
_fp8_gemm_tma_kernel_tuned = triton.autotune(_cuda_configs(True), key=_KEY + ["OUT_DTYPE"])(_fp8_gemm_tma_kernel)


# ----------------------------------------------------------------------------- launcher


def tma_supported(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether the TMA kernel can take these operands on this GPU: sm_90+, triton with host tensor
    descriptors, and 16-byte-aligned rows (K % 16 == 0 for fp8, N * out bytes % 16 == 0)."""
    if TensorDescriptor is None or a.device.type != "cuda":
        return False
    if torch.cuda.get_device_capability(a.device)[0] < 9:
        return False
    k, n = a.shape[1], b.shape[0]
    return k % 16 == 0 and (n * torch.empty((), dtype=out_dtype).element_size()) % 16 == 0


_AUTOTUNE_MIN_FLOPS = 1 << 32  # ~4 GFLOP, e.g. 1024 x 2048 x 2048


def _fixed_config(m: int, n: int, k: int) -> dict:
    """Block sizes (and launch options) when not autotuning: under the interpreter (few, big
    blocks; no launch options) and for small GEMMs on GPUs."""
    if triton_interpret():
        def fit(size: int, lo: int, hi: int) -> int:
            return max(lo, min(hi, triton.next_power_of_2(max(size, 1))))

        return dict(BLOCK_M=fit(m, 16, 64), BLOCK_N=fit(n, 16, 64), BLOCK_K=fit(k, 32, 128), GROUP_M=4)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3)


def fp8_gemm(a, b, a_scale, b_scale, out_dtype, bias, use_fast_accum, *, use_tma: bool | None = None):
    """Triton scaled GEMM; the contract (arguments, shapes, dtypes, result) of
    ``titan_kernels.reference.fp8.fp8_gemm``.

    use_tma: None picks the TMA kernel when ``tma_supported``; True forces it (also under the
    interpreter, for testing; operands are made K-contiguous) and raises ValueError when the rows
    are not 16-byte aligned; False forces the pointer kernel.
    """
    m, k = a.shape
    n = b.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:  # an empty sum: only the bias remains
        return out.copy_(bias.float().expand(m, n) if bias is not None else torch.zeros((), device=a.device))
    # Scales as pointers with a stride: 0 for tensorwise (one value), the row stride for rowwise.
    stride_sa = 0 if a_scale.numel() == 1 else a_scale.stride(0)
    stride_sb = 0 if b_scale.numel() == 1 else b_scale.stride(0)
    has_bias = bias is not None
    bias_arg = bias if has_bias else a_scale
    interpret = triton_interpret()

    if use_tma is None:
        use_tma = not interpret and tma_supported(a, b, out_dtype)
    # Autotune only GEMMs big enough to repay it; small ones (and the interpreter) use one config.
    tuned = not interpret and 2 * m * n * k >= _AUTOTUNE_MIN_FLOPS
    config = {} if tuned else _fixed_config(m, n, k)

    def grid(meta):
        return (num_programs(a.device, triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"])),)

    if use_tma:
        if TensorDescriptor is None:
            raise RuntimeError("use_tma: this triton has no triton.tools.tensor_descriptor (needs triton >= 3.4)")
        if k % 16 or (n * out.element_size()) % 16:
            raise ValueError(f"use_tma: TMA needs K % 16 == 0 and N * {out.element_size()} % 16 == 0, got K={k}, N={n}")
        # fp8 tensor cores and TMA both want K-major operands, TMA a 16-byte-aligned base.
        a, b = (t.contiguous() if t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format) for t in (a, b))
        bm, bn, bk = (config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]) if config else (128, 128, 128)
        a_desc = TensorDescriptor(a, [m, k], [k, 1], [bm, bk])  # (tuned: the configs' pre_hook resets blocks)
        b_desc = TensorDescriptor(b, [n, k], [k, 1], [bn, bk])
        c_desc = TensorDescriptor(out, [m, n], [n, 1], [bm, bn])
        args = (a_desc, b_desc, c_desc, a_scale, b_scale, bias_arg, m, n, k, stride_sa, stride_sb)
        flags = dict(OUT_DTYPE=_TL_DTYPE[out_dtype], HAS_BIAS=has_bias, FAST_ACCUM=bool(use_fast_accum))
        kernel = _fp8_gemm_tma_kernel_tuned if tuned else _fp8_gemm_tma_kernel
    else:
        args = (
            a, b, out, a_scale, b_scale, bias_arg, m, n, k,
            a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), stride_sa, stride_sb,
        )
        flags = dict(HAS_BIAS=has_bias, FAST_ACCUM=bool(use_fast_accum))
        kernel = _fp8_gemm_kernel_tuned if tuned else _fp8_gemm_kernel
    kernel[grid](*args, **flags, **config)
    return out
