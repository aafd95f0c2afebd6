"""The float8 primitives: ``torch.ops.titan.fp8_quantize`` (dynamic scaling and the saturated cast)
and ``torch.ops.titan.fp8_gemm`` (the scaled GEMM), with their validation, backends and public
functions ``fp8_quantize``, ``fp8_gemm``, ``tensorwise_amax`` and ``fp8_quantize_from_amax``.

Math: dynamic scaling as in Micikevicius et al. 2022, "FP8 Formats for Deep Learning" (section 4)
and torchao.float8; ``titan_kernels.reference.fp8`` has the exact formulas and is the ground truth.

Backends (registered here, each once). ``fp8_quantize``: ``reference`` and ``triton``.
``fp8_gemm``: ``reference`` (dequantize + float32 matmul), ``triton`` (our persistent GEMM, TMA on
sm_90) and ``scaled_mm``, ``torch._scaled_mm`` (``titan_kernels.ops.fp8_scaled_mm``), the native
implementation of both the ``cpu`` and ``cuda`` families (it needs no extension of ours). The
automatic choice takes it first where torch has it for the device and, on the CPU, where a one-time
timing shows it is not slower than the reference GEMM. The ops follow the rms_norm pattern:
``custom_op`` + fake, and an eager fast path; neither is differentiable (``fp8_linear`` in
``titan_kernels.ops.fp8_linear`` is the training op built on them).
"""
from __future__ import annotations

import torch

from titan_kernels import backend as _backend
from titan_kernels.ops._common import FLOAT_DTYPES, check_float, check_same_device, check_tensor, eager_fast_path
from titan_kernels.ops.fp8_scaled_mm import OP_GEMM, scaled_mm_gemm, scaled_mm_slower, why_not_scaled_mm
from titan_kernels.reference import fp8 as _ref
from titan_kernels.reference.fp8 import FP8_DTYPES, FP8_MAX, GRANULARITIES  # noqa: F401  (re-exported)

OP_QUANT = "fp8_quantize"
OUT_DTYPES = FLOAT_DTYPES
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

# Each quantize backend: (fp8_quantize, tensorwise_amax, fp8_quantize_from_amax).
_backend.register_impl(
    OP_QUANT, "reference",
    (_ref.fp8_quantize, lambda x: _ref.amax(x, "tensorwise"), _ref.fp8_quantize_from_amax),
)
_backend.register_impl(OP_GEMM, "reference", _ref.fp8_gemm)


def _register_triton() -> None:
    try:
        from titan_kernels.triton import fp8_gemm as _tri_gemm
        from titan_kernels.triton import fp8_quantize as _tri_quant
    except ImportError:  # triton not installed: the backend reports itself unavailable
        return
    _backend.register_impl(
        OP_QUANT, "triton", (_tri_quant.fp8_quantize, _tri_quant.tensorwise_amax, _tri_quant.fp8_quantize_from_amax)
    )
    _backend.register_impl(OP_GEMM, "triton", _tri_gemm.fp8_gemm)


_register_triton()


# torch._scaled_mm is the native GEMM of both device types (no extension of ours needed): "cpu" /
# "cuda" / "scaled_mm" ask for it; the automatic choice takes it first where it is not slower.
for _fam in ("cpu", "cuda"):
    _backend.register_impl(OP_GEMM, _fam, scaled_mm_gemm, name="scaled_mm", why_not=why_not_scaled_mm,
                           auto=scaled_mm_slower)


def _quant_impl(device: torch.device):
    return _backend.get_impl(OP_QUANT, device)


def _gemm_impl(device: torch.device):
    """The GEMM implementation for ``device``, chosen by ``titan_kernels.backend`` (torch._scaled_mm
    as the native one, else triton / reference)."""
    return _backend.get_impl(OP_GEMM, device)


def gemm_backend_name(device: torch.device | str) -> str:
    """The name of the GEMM implementation ``fp8_gemm`` would use now on ``device``
    ("scaled_mm", "triton" or "reference")."""
    return _backend.resolve(OP_GEMM, torch.device(device))


# ----------------------------------------------------------------------------- validation


def _name(dtype: object) -> str:
    return str(dtype).replace("torch.", "")


def _check_fp8_dtype(dtype: object, arg: str) -> None:
    if dtype not in FP8_DTYPES:
        raise TypeError(f"{arg}: expected torch.float8_e4m3fn or torch.float8_e5m2, got {_name(dtype)}")


def _check_bool(v: object, arg: str) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"{arg}: expected a bool, got {type(v).__name__}")
    return v


def _validate_quantize(x, dtype, granularity, round_scales_to_power_of_2) -> None:
    check_float(x, "x")
    _check_fp8_dtype(dtype, "dtype")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity: expected one of {GRANULARITIES}, got {granularity!r}")
    if granularity != "tensorwise" and x.dim() != 2:
        raise ValueError(
            f"x: {granularity} granularity expects a 2-D tensor (rows, cols), got shape {tuple(x.shape)}; "
            "reshape to 2-D first"
        )
    _check_bool(round_scales_to_power_of_2, "round_scales_to_power_of_2")


def _scale_kind(scale, arg: str, rows: int, rows_name: str) -> str:
    check_tensor(scale, arg)
    if scale.dtype != torch.float32:
        raise TypeError(f"{arg}: expected a float32 tensor, got {_name(scale.dtype)}")
    if scale.dim() <= 2 and scale.numel() == 1:
        return "tensorwise"
    if tuple(scale.shape) == (rows, 1):
        return "rowwise"
    raise ValueError(
        f"{arg}: expected shape () or (1,) (tensorwise) or ({rows}, 1) (rowwise, {rows_name} = {rows}), "
        f"got {tuple(scale.shape)}"
    )


def _validate_gemm(a, b, a_scale, b_scale, out_dtype, bias, use_fast_accum) -> None:
    for t, arg in ((a, "a"), (b, "b")):
        check_tensor(t, arg)
        _check_fp8_dtype(t.dtype, f"{arg} (dtype)")
        if t.dim() != 2:
            raise ValueError(f"{arg}: expected a 2-D tensor, got shape {tuple(t.shape)}")
    if b.shape[1] != a.shape[1]:
        raise ValueError(
            f"b: expected shape (N, K) with K = a.shape[1] = {a.shape[1]} (out = a @ b.T), got {tuple(b.shape)}"
        )
    _scale_kind(a_scale, "a_scale", a.shape[0], "M")
    _scale_kind(b_scale, "b_scale", b.shape[0], "N")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype: expected one of float32, bfloat16, float16, got {_name(out_dtype)}")
    if bias is not None:
        check_float(bias, "bias")
        if tuple(bias.shape) != (b.shape[0],):
            raise ValueError(f"bias: expected shape ({b.shape[0]},) (N), got {tuple(bias.shape)}")
    _check_bool(use_fast_accum, "use_fast_accum")
    check_same_device({"a": a, "b": b, "a_scale": a_scale, "b_scale": b_scale, "bias": bias})


# ----------------------------------------------------------------------------- ops


@torch.library.custom_op("titan::fp8_quantize", mutates_args=())
def fp8_quantize_op(
    x: torch.Tensor, dtype: torch.dtype, granularity: str, round_scales_to_power_of_2: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic float8 quantization; see ``fp8_quantize``. Returns (codes, scale)."""
    return _quant_impl(x.device)[0](x, dtype, granularity, round_scales_to_power_of_2)


@fp8_quantize_op.register_fake
def _(x, dtype, granularity, round_scales_to_power_of_2):
    if granularity == "colwise":
        codes = _ref.empty_colwise(x.shape[0], x.shape[1], dtype, x.device)
        return codes, x.new_empty((1, x.shape[1]), dtype=torch.float32)
    codes = torch.empty(x.shape, dtype=dtype, device=x.device)
    if granularity == "rowwise":
        return codes, x.new_empty((x.shape[0], 1), dtype=torch.float32)
    return codes, x.new_empty((), dtype=torch.float32)


@torch.library.custom_op("titan::fp8_gemm", mutates_args=())
def fp8_gemm_op(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    use_fast_accum: bool,
) -> torch.Tensor:
    """(a * a_scale) @ (b * b_scale)^T (+ bias); see ``fp8_gemm``. Returns a contiguous (M, N)."""
    return _gemm_impl(a.device)(a, b, a_scale, b_scale, out_dtype, bias, use_fast_accum)


@fp8_gemm_op.register_fake
def _(a, b, a_scale, b_scale, out_dtype, bias, use_fast_accum):
    return torch.empty((a.shape[0], b.shape[0]), dtype=out_dtype, device=a.device)


# ----------------------------------------------------------------------------- public API


def fp8_quantize(
    x: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float8_e4m3fn,
    granularity: str = "tensorwise",
    round_scales_to_power_of_2: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic float8 quantization: amax, scale and saturated cast fused (one kernel per pass).

    Args:
        x: float32 / bfloat16 / float16, any strides; any shape for "tensorwise", 2-D (rows, cols)
            for "rowwise" and "colwise"; zero-size allowed.
        dtype: torch.float8_e4m3fn (max 448) or torch.float8_e5m2 (max 57344).
        granularity: "tensorwise" (one scale), "rowwise" (one per row, over the last dim) or
            "colwise" (one per column).
        round_scales_to_power_of_2: round the scale up to a power of two (the cast multiplier
            down), so that scaling is exact in any precision.

    Returns:
        (x_fp8, scale): x_fp8 in ``dtype`` with x's shape (contiguous; column-major for "colwise",
        so that ``x_fp8.t()`` is row-major), and ``scale`` float32 of shape () / (rows, 1) /
        (1, cols), with ``x ~= x_fp8.float() * scale``. scale = max(amax, 1e-12) / fp8_max, so an
        all-zero tensor or row gets a finite positive scale and zero codes; values beyond the
        range saturate to +-fp8_max. NaN in a group makes its scale NaN. Not differentiable.

    Raises:
        TypeError: x not a float32/bf16/fp16 tensor (e.g. an int tensor), dtype not float8,
            round_scales_to_power_of_2 not a bool.
        ValueError: unknown granularity; rowwise/colwise on a tensor that is not 2-D.

    Source: Micikevicius et al. 2022, "FP8 Formats for Deep Learning", section 4; torchao.float8
    (``reference.fp8`` has the exact formulas).
    """
    _validate_quantize(x, dtype, granularity, round_scales_to_power_of_2)
    x = x.detach()
    if eager_fast_path(x):
        return _quant_impl(x.device)[0](x, dtype, granularity, round_scales_to_power_of_2)
    return torch.ops.titan.fp8_quantize(x, dtype, granularity, round_scales_to_power_of_2)


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
    _validate_gemm(a, b, a_scale, b_scale, out_dtype, bias, use_fast_accum)
    if bias is not None:
        bias = bias.detach()
    if eager_fast_path(a, b, a_scale, b_scale, bias):
        return _gemm_impl(a.device)(a, b, a_scale, b_scale, out_dtype, bias, use_fast_accum)
    return torch.ops.titan.fp8_gemm(a, b, a_scale, b_scale, out_dtype, bias, use_fast_accum)


def tensorwise_amax(x: torch.Tensor) -> torch.Tensor:
    """max(|x|) of a float tensor as a float32 () tensor, on the selected quantize backend."""
    return _quant_impl(x.device)[1](x)


def fp8_quantize_from_amax(
    x: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype = E4M3, round_scales_to_power_of_2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tensorwise quantization with a known amax (e.g. all-reduced over the shards of a weight):
    the same codes and scale as ``fp8_quantize`` of the full tensor whose amax it is."""
    return _quant_impl(x.device)[2](x, amax, dtype, round_scales_to_power_of_2)
