"""``torch.ops.titan.fp8_quantize``: dynamic float8 scaling and the saturated cast, with its
validation, backends and the public ``fp8_quantize``, ``tensorwise_amax`` and
``fp8_quantize_from_amax``.

Math: dynamic scaling as in Micikevicius et al. 2022, "FP8 Formats for Deep Learning" (section 4)
and torchao.float8; ``titan_kernels.reference.fp8`` has the exact formulas and is the ground truth.

Backends (registered here, each once): ``reference`` and ``triton``; each provides the three
functions of ``QuantizeKernels``. The op is built by the op scaffold (its schema: the reference's
signature, the contract every backend implements, written once); it is not differentiable
(``fp8_linear`` is the training op built on it).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from titan_kernels.ops._common import check_float, dtype_name
from titan_kernels.ops._scaffold import Op
from titan_kernels.reference import fp8 as _ref
from titan_kernels.reference.fp8 import FP8_DTYPES, GRANULARITIES

OP = "fp8_quantize"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


class QuantizeKernels(NamedTuple):
    """One backend's quantizers (contracts: ``titan_kernels.reference.fp8``)."""

    quantize: Callable  # (x, dtype, granularity, round_scales_to_power_of_2) -> (codes, scale)
    tensorwise_amax: Callable  # x -> float32 () amax
    quantize_from_amax: Callable  # (x, amax, dtype, round_scales_to_power_of_2) -> (codes, scale)


quantize_def = Op(OP)
quantize_def.register(
    "reference", QuantizeKernels(_ref.fp8_quantize, lambda x: _ref.amax(x, "tensorwise"), _ref.fp8_quantize_from_amax)
)
quantize_def.register_triton("titan_kernels.triton.fp8_quantize", "fp8_quantize", "tensorwise_amax",
                             "fp8_quantize_from_amax", kind=QuantizeKernels)


def kernels(device: torch.device) -> QuantizeKernels:
    """The quantizers of the backend ``titan_kernels.backend`` chooses for ``device`` now."""
    return quantize_def.kernels(device)


# ----------------------------------------------------------------------------- validation (shared by the family)


def check_fp8_dtype(dtype: object, arg: str) -> None:
    if dtype not in FP8_DTYPES:
        raise TypeError(f"{arg}: expected torch.float8_e4m3fn or torch.float8_e5m2, got {dtype_name(dtype)}")


def check_bool(v: object, arg: str) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"{arg}: expected a bool, got {type(v).__name__}")
    return v


def _validate(x, dtype, granularity, round_scales_to_power_of_2) -> None:
    check_float(x, "x")
    check_fp8_dtype(dtype, "dtype")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity: expected one of {GRANULARITIES}, got {granularity!r}")
    if granularity != "tensorwise" and x.dim() != 2:
        raise ValueError(
            f"x: {granularity} granularity expects a 2-D tensor (rows, cols), got shape {tuple(x.shape)}; "
            "reshape to 2-D first"
        )
    check_bool(round_scales_to_power_of_2, "round_scales_to_power_of_2")


# ----------------------------------------------------------------------------- op


def _forward(x, dtype, granularity, round_scales_to_power_of_2, backend=None):
    return quantize_def.kernels(x.device, backend).quantize(x, dtype, granularity, round_scales_to_power_of_2)


def _fake(x, dtype, granularity, round_scales_to_power_of_2, backend=None):
    if granularity == "colwise":
        codes = _ref.empty_colwise(x.shape[0], x.shape[1], dtype, x.device)
        return codes, x.new_empty((1, x.shape[1]), dtype=torch.float32)
    codes = torch.empty(x.shape, dtype=dtype, device=x.device)
    if granularity == "rowwise":
        return codes, x.new_empty((x.shape[0], 1), dtype=torch.float32)
    return codes, x.new_empty((), dtype=torch.float32)


quantize_def.define(_forward, _fake, signature=_ref.fp8_quantize, differentiable=False)


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
    _validate(x, dtype, granularity, round_scales_to_power_of_2)
    return quantize_def.call(x.detach(), dtype, granularity, round_scales_to_power_of_2, None)


def tensorwise_amax(x: torch.Tensor) -> torch.Tensor:
    """max(|x|) of a float tensor as a float32 () tensor, on the selected quantize backend."""
    return kernels(x.device).tensorwise_amax(x)


def fp8_quantize_from_amax(
    x: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype = E4M3, round_scales_to_power_of_2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tensorwise quantization with a known amax (e.g. all-reduced over the shards of a weight):
    the same codes and scale as ``fp8_quantize`` of the full tensor whose amax it is."""
    return kernels(x.device).quantize_from_amax(x, amax, dtype, round_scales_to_power_of_2)
