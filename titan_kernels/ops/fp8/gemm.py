"""``torch.ops.titan.fp8_gemm``: the scaled float8 GEMM in the layout of ``nn.Linear``, with its
validation, backends and the public ``fp8_gemm`` and ``gemm_backend_name``.

Math: ``(a * a_scale) @ (b * b_scale)^T + bias`` accumulated in float32, with torchao.float8's
dequantization-scale convention; ``titan_kernels.reference.fp8.fp8_gemm`` is the ground truth and
its signature is the contract of every backend (and the op's schema).

Backends: ``reference`` (dequantize + float32 matmul) and ``triton`` (our persistent GEMM, TMA on
sm_90), registered here; ``scaled_mm``, ``torch._scaled_mm``, the native implementation of both the
``cpu`` and ``cuda`` families, registered by ``titan_kernels.ops.fp8.scaled_mm`` beside its
adapter. The automatic choice takes it first where torch has it for the device and, on the CPU,
where a one-time timing shows it is not slower than the reference GEMM. The op is built by the op
scaffold (its schema: the reference's signature); it is not differentiable (``fp8_linear`` is the
training op built on it).
"""
from __future__ import annotations

import torch

from titan_kernels import backend as _backend
from titan_kernels.ops._common import FLOAT_DTYPES, check_float, check_same_device, check_tensor, dtype_name
from titan_kernels.ops._scaffold import Op
from titan_kernels.ops.fp8.quantize import check_bool, check_fp8_dtype
from titan_kernels.reference import fp8 as _ref

OP = "fp8_gemm"
OUT_DTYPES = FLOAT_DTYPES
gemm_def = Op(OP)
gemm_def.register("reference", _ref.fp8_gemm)
gemm_def.register_triton("titan_kernels.triton.fp8_gemm", "fp8_gemm")


def kernel(device: torch.device):
    """The GEMM implementation for ``device``, chosen by ``titan_kernels.backend`` (torch._scaled_mm
    as the native one, else triton / reference)."""
    return gemm_def.kernels(device).forward


def gemm_backend_name(device: torch.device | str) -> str:
    """The name of the GEMM implementation ``fp8_gemm`` would use now on ``device``
    ("scaled_mm", "triton" or "reference")."""
    return _backend.resolve(OP, torch.device(device))


# ----------------------------------------------------------------------------- validation


def _scale_kind(scale, arg: str, rows: int, rows_name: str) -> str:
    check_tensor(scale, arg)
    if scale.dtype != torch.float32:
        raise TypeError(f"{arg}: expected a float32 tensor, got {dtype_name(scale.dtype)}")
    if scale.dim() <= 2 and scale.numel() == 1:
        return "tensorwise"
    if tuple(scale.shape) == (rows, 1):
        return "rowwise"
    raise ValueError(
        f"{arg}: expected shape () or (1,) (tensorwise) or ({rows}, 1) (rowwise, {rows_name} = {rows}), "
        f"got {tuple(scale.shape)}"
    )


def _validate(a, b, a_scale, b_scale, out_dtype, bias, use_fast_accum) -> None:
    for t, arg in ((a, "a"), (b, "b")):
        check_tensor(t, arg)
        check_fp8_dtype(t.dtype, f"{arg} (dtype)")
        if t.dim() != 2:
            raise ValueError(f"{arg}: expected a 2-D tensor, got shape {tuple(t.shape)}")
    if b.shape[1] != a.shape[1]:
        raise ValueError(
            f"b: expected shape (N, K) with K = a.shape[1] = {a.shape[1]} (out = a @ b.T), got {tuple(b.shape)}"
        )
    _scale_kind(a_scale, "a_scale", a.shape[0], "M")
    _scale_kind(b_scale, "b_scale", b.shape[0], "N")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype: expected one of float32, bfloat16, float16, got {dtype_name(out_dtype)}")
    if bias is not None:
        check_float(bias, "bias")
        if tuple(bias.shape) != (b.shape[0],):
            raise ValueError(f"bias: expected shape ({b.shape[0]},) (N), got {tuple(bias.shape)}")
    check_bool(use_fast_accum, "use_fast_accum")
    check_same_device({"a": a, "b": b, "a_scale": a_scale, "b_scale": b_scale, "bias": bias})


# ----------------------------------------------------------------------------- op


def _forward(a, b, a_scale, b_scale, out_dtype, bias, use_fast_accum, backend=None):
    """(a * a_scale) @ (b * b_scale)^T (+ bias) on the chosen backend; see ``fp8_gemm``."""
    return gemm_def.kernels(a.device, backend).forward(a, b, a_scale, b_scale, out_dtype, bias, use_fast_accum)


gemm_def.define(
    _forward, lambda a, b, a_scale, b_scale, out_dtype, *rest: torch.empty((a.shape[0], b.shape[0]), dtype=out_dtype,
                                                                            device=a.device),
    signature=_ref.fp8_gemm, differentiable=False)


# ----------------------------------------------------------------------------- public API


def fp8_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """Scaled float8 GEMM in the layout of ``nn.Linear``: ``(a * a_scale) @ (b * b_scale).T + bias``.

    Args:
        a: (M, K) float8_e4m3fn / float8_e5m2, any strides, any M (zero included).
        b: (N, K) float8, any strides (e.g. ``weight_fp8`` for y = x W^T, or ``codes.t()``).
        a_scale: float32, () / (1,) (tensorwise) or (M, 1) (rowwise): dequantization scales, as
            returned by ``fp8_quantize``.
        b_scale: float32, () / (1,) or (N, 1). A tensorwise scale may face a rowwise one.
        out_dtype: float32, bfloat16 or float16.
        bias: (N,) float tensor or None, added in float32 before the final rounding.
        use_fast_accum: let Hopper tensor cores accumulate in their reduced precision for the
            whole K loop (faster, slightly less accurate).

    Returns:
        (M, N) contiguous tensor in ``out_dtype``, accumulated in float32. K or N that a backend
        cannot take (``torch._scaled_mm`` wants multiples of 16) are zero-padded, which leaves the
        result unchanged. Not differentiable (use ``fp8_linear`` / ``Float8Linear`` for training).

    Raises:
        TypeError: a or b not float8, a scale not float32, out_dtype not float32/bf16/fp16.
        ValueError: a or b not 2-D, K of b != K of a, a scale shape that fits neither granularity,
            bias shape != (N,), mixed devices.
        RuntimeError: the requested backend cannot run on the device.

    Source: the scaled-matmul contract of ``torch._scaled_mm`` with torchao's dequantization-scale
    convention; Micikevicius et al. 2022.
    """
    _validate(a, b, a_scale, b_scale, out_dtype, bias, use_fast_accum)
    if bias is not None:
        bias = bias.detach()
    return gemm_def.call(a, b, a_scale, b_scale, out_dtype, bias, use_fast_accum, None)
