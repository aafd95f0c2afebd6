"""The float8 training GEMMs of a linear layer: ``torch.ops.titan.fp8_linear`` (y = x W^T) and its
backward ``torch.ops.titan.fp8_linear_backward``, their one autograd definition and the public
``fp8_linear``, built on ``fp8_quantize`` / ``fp8_gemm`` (``titan_kernels.ops.fp8_quantize_gemm``).

Math: dynamic scaling as in Micikevicius et al. 2022, "FP8 Formats for Deep Learning" (section 4)
and torchao.float8, whose training recipes keep their names and meanings here:

  recipe               forward y = x W^T        grad_input dx = dy W          grad_weight dW = dy^T x
  tensorwise           x, W e4m3 tensorwise     dy e5m2 tensorwise, W e4m3    dy e5m2, x e4m3 (tensorwise)
  rowwise              x, W e4m3 rowwise        dy e4m3 rowwise, W e4m3 colw. dy, x e4m3 colwise
  rowwise_with_gw_hp   x, W e4m3 rowwise        dy e4m3 rowwise, W e4m3 tensorwise   high precision

Every scale is taken along the reduction (K) dim of its GEMM; the rowwise recipes round scales
down to powers of two, as torchao does. The forward GEMM uses fast accumulation, the gradient
GEMMs do not (torchao's defaults). The backward re-quantizes x and W from the high-precision
tensors saved by the forward (the same memory as a bf16 Linear; the same codes as the forward).
The op follows the rms_norm pattern: ``custom_op`` + fake + ``register_autograd``, and an eager
fast path that saves and differentiates with the same functions (DESIGN.md section 2, item 6).

Under DTensor, ``fp8_linear`` runs on local shards (rules in ``titan_kernels.dtensor``): each
shard is scaled on its own (per-shard amax), which is exact dequantized math for that shard; the
result matches the unsharded one to fp8 accuracy, not bit for bit.
"""
from __future__ import annotations

import contextlib

import torch

from titan_kernels import backend as _backend
from titan_kernels.ops._common import check_float, check_same_device, eager_fast_path
from titan_kernels.ops.fp8_quantize_gemm import E4M3, E5M2, _gemm_impl, _name, _quant_impl, fp8_gemm, fp8_quantize

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


# ----------------------------------------------------------------------------- validation


def _validate_linear(x, weight, recipe) -> None:
    check_float(x, "x")
    check_float(weight, "weight")
    if x.dim() < 1:
        raise ValueError("x: expected at least 1 dimension (..., in_features), got a 0-d tensor")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"weight: expected shape (out_features, {x.shape[-1]}) to match the last dim of x, got {tuple(weight.shape)}"
        )
    if weight.dtype != x.dtype:
        raise TypeError(f"weight: expected dtype {_name(x.dtype)} (the dtype of x), got {_name(weight.dtype)}")
    if recipe not in RECIPES:
        raise ValueError(f"recipe: expected one of {RECIPES}, got {recipe!r}")
    check_same_device({"x": x, "weight": weight})


# ----------------------------------------------------------------------------- recipe math


def linear_fwd(x2: torch.Tensor, weight: torch.Tensor, recipe: str) -> torch.Tensor:
    """y (M, N) = x2 (M, K) @ weight (N, K)^T in float8 per ``recipe``, in x2.dtype."""
    quant, gemm = _quant_impl(x2.device)[0], _gemm_impl(x2.device)
    gran, pow2 = ("tensorwise", False) if recipe == "tensorwise" else ("rowwise", True)
    xq, xs = quant(x2, E4M3, gran, pow2)
    wq, ws = quant(weight, E4M3, gran, pow2)
    return gemm(xq, wq, xs, ws, x2.dtype, None, True)


def linear_bwd_prequantized(
    dy2: torch.Tensor, xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
    x_dtype: torch.dtype, w_dtype: torch.dtype, compute_dx: bool, compute_dweight: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Backward of the tensorwise recipe from tensorwise-quantized x (M, K) and W (N, K): dy is
    cast to e5m2 once and used by both GEMMs (its transpose needs no new scale).

    Goes through the public ops (eager fast path, or the custom ops when traced), so that it also
    runs inside a compiled autograd.Function (the FSDP2 float8 all-gather path of Float8Linear).
    """
    dyq, dys = fp8_quantize(dy2, dtype=E5M2)
    dx = fp8_gemm(dyq, wq.t(), dys, ws, out_dtype=x_dtype) if compute_dx else None
    dw = fp8_gemm(dyq.t(), xq.t(), dys, xs, out_dtype=w_dtype) if compute_dweight else None
    return dx, dw


def linear_bwd(
    dy2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, recipe: str, compute_dx: bool, compute_dweight: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dx (M, K) in x2.dtype, dW (N, K) in weight.dtype) per ``recipe``; None where not asked."""
    quant, gemm = _quant_impl(x2.device)[0], _gemm_impl(x2.device)
    if recipe == "tensorwise":
        xq, xs = quant(x2, E4M3, "tensorwise", False) if compute_dweight else (None, None)
        wq, ws = quant(weight, E4M3, "tensorwise", False) if compute_dx else (None, None)
        return linear_bwd_prequantized(dy2, xq, xs, wq, ws, x2.dtype, weight.dtype, compute_dx, compute_dweight)
    dx = dw = None
    if compute_dx:
        dyq, dys = quant(dy2, E4M3, "rowwise", True)
        if recipe == "rowwise":
            # Scales of W along N (its columns): colwise codes, whose transpose is row-major (K, N).
            wq, ws = quant(weight, E4M3, "colwise", True)
            dx = gemm(dyq, wq.t(), dys, ws.t(), x2.dtype, None, False)
        else:
            wq, ws = quant(weight, E4M3, "tensorwise", True)
            dx = gemm(dyq, wq.t(), dys, ws, x2.dtype, None, False)
    if compute_dweight:
        if recipe == "rowwise":
            # dW = dy^T x reduces over tokens (M): colwise scales for both.
            dyq, dys = quant(dy2, E4M3, "colwise", True)
            xq, xs = quant(x2, E4M3, "colwise", True)
            dw = gemm(dyq.t(), xq.t(), dys.t(), xs.t(), weight.dtype, None, False)
        else:
            dw = torch.mm(dy2.t(), x2).to(weight.dtype)
    return dx, dw


def _rows(t: torch.Tensor) -> torch.Tensor:
    # Explicit row count: reshape(-1, 0) is ambiguous for an empty last dim.
    return t.reshape(t.shape[:-1].numel(), t.shape[-1])


def _unflatten(t: torch.Tensor, lead: torch.Size, cols: int) -> torch.Tensor:
    # _unsafe_view (as aten.matmul does): the result is not tracked as a view of the 2-D GEMM
    # output, so callers may modify it in place (FSDP2 and autograd warn about returned views).
    return torch.ops.aten._unsafe_view(t, (*lead, cols))


# ----------------------------------------------------------------------------- ops


@torch.library.custom_op("titan::fp8_linear", mutates_args=())
def fp8_linear_op(x: torch.Tensor, weight: torch.Tensor, recipe: str) -> torch.Tensor:
    """y = x @ weight^T with float8 GEMMs per ``recipe``. x (..., K), weight (N, K) -> (..., N) in
    x.dtype, contiguous."""
    return _unflatten(linear_fwd(_rows(x), weight, recipe), x.shape[:-1], weight.shape[0])


@fp8_linear_op.register_fake
def _(x, weight, recipe):
    return torch.empty((*x.shape[:-1], weight.shape[0]), dtype=x.dtype, device=x.device)


@torch.library.custom_op("titan::fp8_linear_backward", mutates_args=())
def fp8_linear_backward_op(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, recipe: str, compute_dx: bool, compute_dweight: bool,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of fp8_linear. dy (..., N), x (..., K), weight (N, K). Returns dx (..., K) in
    x.dtype and dW (N, K) in weight.dtype, each contiguous; a gradient whose ``compute_*`` flag is
    False comes back empty with its last dim 0 ((..., 0) and (N, 0)), a placeholder of the same
    rank, so that every DTensor placement of the real gradient is valid for it too. ``backend``:
    the backend request in force when the forward ran (None: the one in force now)."""
    return _linear_backward(dy, x, weight, recipe, compute_dx, compute_dweight, backend)


@fp8_linear_backward_op.register_fake
def _(dy, x, weight, recipe, compute_dx, compute_dweight, backend=None):
    dx = x.new_empty((*x.shape[:-1], x.shape[-1] if compute_dx else 0))
    dw = weight.new_empty((weight.shape[0], weight.shape[1] if compute_dweight else 0))
    return dx, dw


# ----------------------------------------------------------------------------- the one autograd definition
# The eager fast path (``_Fp8LinearFn``) and the op path (``register_autograd``) save with ``_save`` and
# differentiate with ``_grads``; the backward's quantize and GEMM kernels run under the backend
# request captured when the forward ran (``request_context``), whichever path ran.


def request_context(request: str | None):
    """A context in which the titan ops see ``request`` (a backend name, "" for automatic, None:
    leave the current request as it is)."""
    if request is None:
        return contextlib.nullcontext()
    if request == "":
        return _backend.automatic()
    return _backend.use_backend(request)


def refuse_double_backward(op: str, *tensors) -> None:
    """Raise when a backward runs with ``create_graph=True`` through an op whose backward has no
    derivative (the float8 casts are not differentiable)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError(f"titan::{op}: double backward (create_graph=True through a float8 linear) is not "
                           "supported; its float8 casts are not differentiable")


def _linear_backward(dy, x, weight, recipe, compute_dx, compute_dweight, request):
    with request_context(request):
        dx, dw = linear_bwd(_rows(dy), _rows(x), weight, recipe, compute_dx, compute_dweight)
    dx = _unflatten(dx, x.shape[:-1], x.shape[-1]) if dx is not None else x.new_empty((*x.shape[:-1], 0))
    dw = dw if dw is not None else weight.new_empty((weight.shape[0], 0))
    return dx, dw


def _save(ctx, x, weight, recipe, request):
    ctx.save_for_backward(x, weight)
    ctx.recipe, ctx.request = recipe, request


def _grads(ctx, dy, through_op: bool):
    x, weight = ctx.saved_tensors
    refuse_double_backward("fp8_linear", dy, x, weight)
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if through_op:
        dx, dw = torch.ops.titan.fp8_linear_backward(dy, x, weight, ctx.recipe, need_dx, need_dw, ctx.request)
    else:
        dx, dw = _linear_backward(dy, x, weight, ctx.recipe, need_dx, need_dw, ctx.request)
    return (dx if need_dx else None), (dw if need_dw else None), None


def _setup_fp8_linear(ctx, inputs, output):
    x, weight, recipe = inputs
    # Under torch.compile the request cannot be traced: the backward reads the one in force then.
    request = None if torch.compiler.is_compiling() else (_backend.requested_backend() or "")
    _save(ctx, x, weight, recipe, request)


def _backward_fp8_linear(ctx, dy):
    return _grads(ctx, dy, through_op=True)


fp8_linear_op.register_autograd(_backward_fp8_linear, setup_context=_setup_fp8_linear)


class _Fp8LinearFn(torch.autograd.Function):
    """The eager fast path: the same forward, ``_save`` and ``_grads`` as the op, without the dispatcher."""

    @staticmethod
    def forward(ctx, x, weight, recipe):
        _save(ctx, x, weight, recipe, _backend.requested_backend() or "")
        return _unflatten(linear_fwd(_rows(x), weight, recipe), x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        return _grads(ctx, dy, through_op=False)


# ----------------------------------------------------------------------------- public API


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, recipe: str = "tensorwise") -> torch.Tensor:
    """``x @ weight.T`` with its forward, grad_input and grad_weight GEMMs in float8 per ``recipe``.

    Args:
        x: (..., K) float32 / bfloat16 / float16.
        weight: (N, K), the same dtype as x.
        recipe: "tensorwise", "rowwise" or "rowwise_with_gw_hp" (torchao's meanings; see the
            module docstring for the dtype and scaling of each GEMM).

    Returns:
        (..., N) in x.dtype. Differentiable in x and weight (dx in x.dtype, dW in weight.dtype).

    Raises:
        TypeError: x or weight not float32/bf16/fp16, or their dtypes differ.
        ValueError: weight not (N, K) with K = x.shape[-1], unknown recipe, mixed devices.

    Source: torchao.float8 recipes; Micikevicius et al. 2022, section 4.
    """
    _validate_linear(x, weight, recipe)
    if eager_fast_path(x, weight):
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            return _Fp8LinearFn.apply(x, weight, recipe)
        return _unflatten(linear_fwd(_rows(x), weight, recipe), x.shape[:-1], weight.shape[0])
    return torch.ops.titan.fp8_linear(x, weight, recipe)
