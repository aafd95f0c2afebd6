"""``torch._scaled_mm`` as the native implementation of ``titan::fp8_gemm`` (cuBLASLt / CUTLASS on
CUDA; the CPU kernel of torch >= 2.13), with the probes the automatic choice reads, registered here
(once, as "scaled_mm" in the ``cpu`` and ``cuda`` families).

``scaled_mm_gemm`` adapts the ``fp8_gemm`` contract (``titan_kernels.reference.fp8.fp8_gemm``:
(a * a_scale) @ (b * b_scale)^T + bias, accumulated in float32) to _scaled_mm's conventions and
falls back where this torch/device refuses a combination. ``_scaled_mm_works`` probes once per
(device, dtypes, scale mode, output dtype, bias) what _scaled_mm accepts; ``_cpu_scaled_mm_pays``
times it once against the dequantized float32 GEMM on the CPU. ``why_not_scaled_mm`` and
``scaled_mm_slower`` are the ``why_not`` / ``auto`` predicates of its registration. Tests that fake
a probe patch it here, where the adapter looks it up.
"""
from __future__ import annotations

import functools

import torch

from titan_kernels import backend as _backend
from titan_kernels.ops.fp8.gemm import OP as OP_GEMM
from titan_kernels.ops.fp8.gemm import gemm_def
from titan_kernels.reference import fp8 as _ref

E4M3 = torch.float8_e4m3fn


@functools.lru_cache(maxsize=None)
def _scaled_mm_works(device: str, a_dtype, b_dtype, rowwise: bool, out_dtype, with_bias: bool) -> bool:
    """Whether ``torch._scaled_mm`` accepts this combination on ``device`` (probed once on 16^3:
    the accepted dtypes, scale modes and bias support differ between CPU, CUDA and versions)."""
    if not hasattr(torch, "_scaled_mm"):
        return False
    dev = torch.device(device)
    try:
        a = torch.zeros(16, 16, device=dev).to(a_dtype)
        b = torch.zeros(16, 16, device=dev).to(b_dtype)
        if rowwise:
            sa, sb = torch.ones(16, 1, device=dev), torch.ones(1, 16, device=dev)
        else:
            sa, sb = torch.ones((), device=dev), torch.ones((), device=dev)
        bias = torch.zeros(16, device=dev, dtype=out_dtype) if with_bias else None
        torch._scaled_mm(a, b.t(), sa, sb, bias=bias, out_dtype=out_dtype)
    except (RuntimeError, TypeError, NotImplementedError, ValueError):
        return False
    return True


def scaled_mm_available(device: torch.device | str) -> bool:
    """Whether ``torch._scaled_mm`` runs an e4m3 tensorwise GEMM on this device type."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        return False
    return _scaled_mm_works(str(dev), E4M3, E4M3, False, torch.bfloat16, False)


@functools.lru_cache(maxsize=None)
def _cpu_scaled_mm_pays() -> bool:
    """One timing, once per process: torch._scaled_mm against the dequantized float32 matmul at
    128^3. Measured on our AVX2 EPYC CPUs (torch 2.13): _scaled_mm took 2.1 s for a 256 x 256 x 768
    GEMM, about a thousand times the float32 matmul, so there the reference GEMM is the fast path;
    CPUs with native float8 support in oneDNN keep _scaled_mm."""
    import time

    a = torch.randn(128, 128).to(E4M3)
    b = torch.randn(128, 128).to(E4M3)
    one = torch.ones(())

    def best(fn) -> float:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    t_scaled = best(lambda: torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16))
    t_ref = best(lambda: (a.float() @ b.float().t()).to(torch.bfloat16))
    return t_scaled <= 2 * t_ref


_ALIGN = 16  # _scaled_mm wants K and N multiples of 16 on CUDA; we pad everywhere so the CPU tests it


def _pad_to(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``t`` (row-major) zero-padded to (rows, cols)."""
    if t.shape == (rows, cols):
        return t.contiguous()
    out = t.new_zeros((rows, cols))
    out[: t.shape[0], : t.shape[1]] = t
    return out


def scaled_mm_gemm(a, b, a_scale, b_scale, out_dtype, bias, use_fast_accum):
    """``fp8_gemm`` on ``torch._scaled_mm``; the contract of ``reference.fp8.fp8_gemm``.

    Adapts to _scaled_mm's conventions: a row-major and b column-major (``b.t()`` of a row-major
    (N, K)), K and N zero-padded to multiples of 16 (zeros add nothing to the dot products; the
    extra columns are cut off), scales either both scalars or (M, 1) and (1, N) (a tensorwise
    scale facing a rowwise one is broadcast). A combination this torch/device refuses (e.g. rowwise
    with a float32 output on CUDA) runs as an unscaled float32 _scaled_mm with the scales and bias
    applied in float32 afterwards; e5m2 x e5m2, which cuBLASLt refuses outright, runs on the
    Triton kernel (or the reference where Triton cannot run).
    """
    m, k = a.shape
    n = b.shape[0]
    if m == 0 or n == 0 or k == 0:
        return _ref.fp8_gemm(a, b, a_scale, b_scale, out_dtype, bias, use_fast_accum)
    dev = a.device
    kp, np_ = -(-k // _ALIGN) * _ALIGN, -(-n // _ALIGN) * _ALIGN
    a2 = _pad_to(a, m, kp)
    b2 = _pad_to(b, np_, kp)
    rowwise = a_scale.numel() != 1 or b_scale.numel() != 1
    if rowwise:
        # Built from 1-D vectors: _scaled_mm checks stride(1) == 1 even on size-1 dims.
        sa = a_scale.float().reshape(-1).expand(m).reshape(m, 1).contiguous()
        sb = torch.ones(np_, dtype=torch.float32, device=dev)
        sb[:n] = b_scale.float().reshape(-1)
        sb = sb.reshape(1, np_)
    else:
        sa, sb = a_scale.float().reshape(()), b_scale.float().reshape(())
    fuse_bias = bias is not None and bias.dtype == out_dtype and out_dtype != torch.float32
    mm_dtype = out_dtype if bias is None or fuse_bias else torch.float32
    key = (str(dev), a.dtype, b.dtype)
    if _scaled_mm_works(*key, rowwise, mm_dtype, fuse_bias):
        y = torch._scaled_mm(a2, b2.t(), sa, sb, bias=_pad_to(bias.reshape(1, -1), 1, np_).reshape(-1) if fuse_bias else None,
                             out_dtype=mm_dtype, use_fast_accum=use_fast_accum)[:, :n]
        if bias is not None and not fuse_bias:
            y = y + bias.float()
    elif _scaled_mm_works(*key, False, torch.float32, False):
        one = torch.ones((), device=dev)
        y = torch._scaled_mm(a2, b2.t(), one, one, out_dtype=torch.float32, use_fast_accum=use_fast_accum)[:, :n]
        y = y * a_scale.float().reshape(-1, 1) * b_scale.float().reshape(1, -1)
        if bias is not None:
            y = y + bias.float()
    else:
        impl = _backend.kernels(OP_GEMM, dev, "triton" if _backend.backend_status("triton", dev).available else "reference").forward
        return impl(a, b, a_scale, b_scale, out_dtype, bias, use_fast_accum)
    return y.to(out_dtype).contiguous()


# ----------------------------------------------------------------------------- backend choice


def why_not_scaled_mm(device: torch.device, case) -> str | None:
    return None if scaled_mm_available(device) else "this torch has no float8 torch._scaled_mm for the device"


def scaled_mm_slower(device: torch.device, case) -> str | None:
    if device.type != "cpu" or _cpu_scaled_mm_pays():
        return None
    return "measured slower than the dequantized float32 GEMM on this CPU (asked for by name it still runs)"


# torch._scaled_mm is the native GEMM of both device types (no extension of ours needed): "cpu" /
# "cuda" / "scaled_mm" ask for it; the automatic choice takes it first where it is not slower.
gemm_def.register_native(scaled_mm_gemm, name="scaled_mm", why_not=why_not_scaled_mm, auto=scaled_mm_slower)
