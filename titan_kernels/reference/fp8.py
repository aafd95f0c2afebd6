"""Float8 quantization and scaled GEMM in plain PyTorch, float32 math.

Quantization (dynamic scaling, as in Micikevicius et al. 2022, "FP8 Formats for Deep Learning",
section 4, and torchao.float8): for each group of elements (the whole tensor, a row or a column)

    amax  = max(|x|) over the group, floored at AMAX_EPS (an all-zero group must not give 0 or NaN)
    mult  = fp8_max / amax                     (rounded down to a power of two when asked)
    scale = 1 / mult                           (float32, the dequantization scale we return)
    codes = round_to_nearest_even(clamp(x * mult, -fp8_max, fp8_max))   in the fp8 dtype

so that ``x ~= codes.float() * scale``. Every division is an IEEE-rounded float32 division; the
Triton kernels do the same operations in the same order, so the scales agree bit for bit.

Scaled GEMM: ``(a * a_scale) @ (b * b_scale).T`` with a (M, K), b (N, K) (the layout of
``nn.Linear``: y = x W^T), computed here by dequantizing to float32 and calling ``matmul``.
"""
from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Largest finite values (OCP FP8 spec): e4m3fn 1.75 * 2^8, e5m2 1.75 * 2^15.
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
GRANULARITIES = ("tensorwise", "rowwise", "colwise")
# The floor on amax (torchao uses the same): keeps the scale finite and positive for zero groups.
AMAX_EPS = 1e-12


def amax(x: torch.Tensor, granularity: str) -> torch.Tensor:
    """max(|x|) in float32: shape () for tensorwise, (rows, 1) rowwise, (1, cols) colwise.

    Empty groups give 0 (then floored by ``scale_from_amax``); NaN propagates.
    """
    xf = x.float().abs()
    if granularity == "tensorwise":
        return xf.amax() if xf.numel() else xf.new_zeros(())
    dim = 1 if granularity == "rowwise" else 0
    if xf.shape[dim] == 0:
        shape = (xf.shape[0], 1) if dim == 1 else (1, xf.shape[1])
        return xf.new_zeros(shape)
    return xf.amax(dim=dim, keepdim=True)


def scale_from_amax(
    amax: torch.Tensor, dtype: torch.dtype, round_scales_to_power_of_2: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mult, scale) in float32 from a float32 amax: ``mult = fp8_max / max(amax, AMAX_EPS)``,
    optionally rounded down to a power of two (clearing the mantissa bits: exact, and it keeps
    ``codes * scale`` exact in any precision), and ``scale = 1 / mult``."""
    amax = torch.clamp(amax.float(), min=AMAX_EPS)
    # Tensor / tensor: `number / tensor` is computed as reciprocal * number, which rounds twice.
    mult = torch.full_like(amax, FP8_MAX[dtype]) / amax
    if round_scales_to_power_of_2:
        mult = (mult.view(torch.int32) & 0x7F800000).view(torch.float32)
    return mult, torch.ones_like(mult) / mult


def cast_with_mult(x: torch.Tensor, mult: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Saturated cast ``clamp(x * mult, -fp8_max, fp8_max)`` to ``dtype`` (round to nearest even)."""
    m = FP8_MAX[dtype]
    return (x.float() * mult).clamp(-m, m).to(dtype)


def fp8_quantize(
    x: torch.Tensor, dtype: torch.dtype, granularity: str, round_scales_to_power_of_2: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic float8 quantization.

    x: float32/bf16/fp16; any shape for "tensorwise", 2-D (rows, cols) for "rowwise"/"colwise".
    Returns (codes, scale): codes in ``dtype`` with x's shape, contiguous, except for "colwise"
    where they are column-major (strides (1, rows)) so that ``codes.t()`` is row-major; scale
    float32 of shape (), (rows, 1) or (1, cols).
    """
    a = amax(x, granularity)
    mult, scale = scale_from_amax(a, dtype, round_scales_to_power_of_2)
    codes = cast_with_mult(x, mult, dtype)
    if granularity == "colwise":
        return empty_colwise(x.shape[0], x.shape[1], dtype, x.device).copy_(codes), scale
    return codes.contiguous(), scale


def empty_colwise(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised column-major (rows, cols) tensor: strides (1, rows), the layout of colwise
    codes (shared by every backend and the fake implementation, so the strides always agree)."""
    return torch.empty_strided((rows, cols), (1, max(rows, 1)), dtype=dtype, device=device)


def fp8_quantize_from_amax(
    x: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype, round_scales_to_power_of_2: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tensorwise quantization with a given float32 amax of shape () (e.g. all-reduced over the
    shards of a weight): the second half of ``fp8_quantize(x, dtype, "tensorwise", ...)``."""
    mult, scale = scale_from_amax(amax.reshape(()), dtype, round_scales_to_power_of_2)
    return cast_with_mult(x, mult, dtype).contiguous(), scale


def fp8_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    use_fast_accum: bool,
) -> torch.Tensor:
    """``(a * a_scale) @ (b * b_scale).T (+ bias)`` in float32, rounded once to ``out_dtype``.

    a (M, K), b (N, K) fp8, any strides; a_scale () or (M, 1), b_scale () or (N, 1) float32;
    bias (N,) or None. Returns a contiguous (M, N) tensor. ``use_fast_accum`` has no meaning here
    (the accumulation is float32 throughout).
    """
    del use_fast_accum
    out = (a.float() * a_scale.float()) @ (b.float() * b_scale.float()).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype).contiguous()
