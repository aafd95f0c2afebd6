"""RMSNorm ops: ``torch.ops.titan.rms_norm``, ``torch.ops.titan.add_rms_norm`` and their backward
``torch.ops.titan.rms_norm_backward``.

Math: Zhang & Sennrich 2019, "Root Mean Square Layer Normalization", eq. 4 (see
``titan_kernels.reference.rms_norm`` for the forward and backward formulas).

Every op is a ``torch.library.custom_op`` whose real implementation picks the backend at run time
(``titan_kernels.backend``), with a fake implementation (torch.compile, FakeTensorMode), autograd
through ``register_autograd`` (the backward is itself an op) and DTensor sharding rules
(``titan_kernels.dtensor``). In plain eager mode the public functions skip the dispatcher and call the
backend directly through a ``torch.autograd.Function`` (``eager_fast_path``), which costs about a
third of a ``custom_op`` call. On CUDA, traced code can use the ``triton_op`` variant instead
(``rms_norm_triton_op.py``, ``TITAN_KERNELS_TRITON_OP=1``), which Inductor traces into.

One autograd definition: the eager ``autograd.Function``s, the custom ops' ``register_autograd`` and
the triton_op variant all save with ``_save`` and differentiate with ``_grads``. The backend request
(``use_backend`` / ``TITAN_KERNELS_BACKEND``; None = automatic) is captured when the forward runs and
handed to the backward (the ``backend`` argument of ``titan::rms_norm_backward``), so the backward
runs on the forward's backend in every path, whatever context it runs in. Under torch.compile the
request is captured when the graph is traced.

Double backward (create_graph=True) is implemented: ``_grads`` then computes the gradients with the
differentiable float32 reference math (``reference.rms_norm.rms_norm_bwd_differentiable``, which
recomputes rstd from x) instead of the kernel, so second derivatives are exact in both paths.
"""
from __future__ import annotations

import os

import torch

from titan_kernels import backend as _backend
from titan_kernels.ops._common import check_eps, check_float, check_same_device, check_tensor, eager_fast_path
from titan_kernels.reference import rms_norm as _ref

OP = "rms_norm"
_backend.register_impl(OP, "reference", (_ref.rms_norm_fwd, _ref.rms_norm_bwd))


def _register_triton() -> None:
    try:
        from titan_kernels.triton import rms_norm as _tri
    except ImportError:  # triton not installed: the backend reports itself unavailable
        return
    _backend.register_impl(OP, "triton", (_tri.rms_norm_fwd, _tri.rms_norm_bwd))


def _native_fwd(x, residual, weight, eps):
    return tuple(torch.ops.titan.rms_norm_fwd_native(x, residual, weight, eps))


def _native_bwd(dy, x, weight, rstd, dresidual, compute_dweight):
    dx, dw = torch.ops.titan.rms_norm_bwd_native(dy, x, weight, rstd, dresidual, compute_dweight)
    return dx, (dw if compute_dweight and weight is not None else None)


_register_triton()
for _name in ("cpu", "cuda"):
    _backend.register_impl(OP, _name, (_native_fwd, _native_bwd))


def _impl(device: torch.device, backend: str | None = None):
    return _backend.get_impl(OP, device, backend)


# ----------------------------------------------------------------------------- forward / backward functions
# The only functions that run kernels; the ops, the triton_op variant and the eager fast path call them.


def _forward(x, residual, weight, eps, backend: str | None):
    """(y, h or None, rstd) on ``backend`` (None: the automatic choice)."""
    return _impl(x.device, backend)[0](x, residual, weight, eps)


def _backward_kernel(dy, x, weight, rstd, dresidual, compute_dweight, backend: str | None):
    """(dx, dweight or None) on ``backend``: the forward's request."""
    return _impl(x.device, backend)[1](dy, x, weight, rstd, dresidual, compute_dweight)


# ----------------------------------------------------------------------------- validation


def _validate(x, weight, eps, residual=None) -> float:
    check_float(x, "x")
    if x.dim() < 1:
        raise ValueError(f"x: expected at least 1 dimension (..., hidden), got a 0-d tensor")
    if residual is not None:
        check_float(residual, "residual")
        if residual.shape != x.shape:
            raise ValueError(f"residual: expected shape {tuple(x.shape)} (the shape of x), got {tuple(residual.shape)}")
        if residual.dtype != x.dtype:
            raise TypeError(f"residual: expected dtype {x.dtype} (the dtype of x), got {residual.dtype}")
    if weight is not None:
        check_float(weight, "weight")
        if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
            raise ValueError(
                f"weight: expected shape ({x.shape[-1]},) to match the last dim of x, got {tuple(weight.shape)}"
            )
    check_same_device({"x": x, "residual": residual, "weight": weight})
    return check_eps(eps)


# ----------------------------------------------------------------------------- ops


@torch.library.custom_op("titan::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """y = x * rsqrt(mean(x^2, -1) + eps) * weight, and the per-row rstd.

    x: (..., N) float32/bf16/fp16; weight: (N,) or None. Returns y (..., N) in x.dtype and
    rstd (...,) float32 (saved for the backward).
    """
    y, _, rstd = _forward(x, None, weight, eps, None)
    return y, rstd


@rms_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("titan::add_rms_norm", mutates_args=())
def add_rms_norm_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h = x + residual (in x.dtype); y = rms_norm(h). Returns (y, h, rstd); shapes as rms_norm."""
    y, h, rstd = _forward(x, residual, weight, eps, None)
    return y, h, rstd


@add_rms_norm_op.register_fake
def _(x, residual, weight, eps):
    return (
        torch.empty(x.shape, dtype=x.dtype, device=x.device),
        torch.empty(x.shape, dtype=x.dtype, device=x.device),
        x.new_empty(x.shape[:-1], dtype=torch.float32),
    )


def dweight_or_empty(dw: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """dweight as the backward ops return it: an empty (0,) tensor (weight's dtype, else x's) for
    None. Shared with the triton_op variant (``rms_norm_triton_op``)."""
    if dw is None:
        dw = x.new_empty((0,), dtype=weight.dtype if weight is not None else x.dtype)
    return dw


@torch.library.custom_op("titan::rms_norm_backward", mutates_args=())
def rms_norm_backward_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    dresidual: torch.Tensor | None,
    compute_dweight: bool,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of rms_norm. dy, x: (..., N); rstd: (...,) float32; dresidual: (..., N) or None,
    added to dx (the residual branch of add_rms_norm). Returns dx (..., N) in x.dtype, a fresh
    buffer (never an alias of dy or dresidual), and dweight (N,) in weight.dtype accumulated in
    float32, or an empty (0,) tensor when ``compute_dweight`` is False or weight is None.
    ``backend``: the forward's request (None: the automatic choice).
    """
    dx, dw = _backward_kernel(dy, x, weight, rstd, dresidual, compute_dweight, backend)
    return dx, dweight_or_empty(dw, x, weight)


@rms_norm_backward_op.register_fake
def _(dy, x, weight, rstd, dresidual, compute_dweight, backend=None):
    n = x.shape[-1] if (compute_dweight and weight is not None) else 0
    return (
        torch.empty(x.shape, dtype=x.dtype, device=x.device),
        x.new_empty((n,), dtype=weight.dtype if weight is not None else x.dtype),
    )


# ----------------------------------------------------------------------------- the one autograd definition


def _save(ctx, x, weight, rstd, eps, backend: str | None) -> None:
    """x: the normalized input (h for add_rms_norm, an output there: double backward flows through it)."""
    ctx.save_for_backward(x, weight, rstd)
    ctx.eps = eps
    ctx.backend = backend


def _create_graph(*tensors) -> bool:
    # Grad mode is on inside a backward only under create_graph=True.
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _grads(ctx, dy, dresidual, need_dw: bool, backward_op):
    """(dx, dweight or None) from the saved state, on the forward's backend. ``backward_op()`` is the
    op path's backward op (``titan::rms_norm_backward`` or the triton_op variant's); None on the eager
    fast path, which calls the same kernel function without the dispatcher. Under create_graph the
    differentiable reference math runs instead (double backward)."""
    x, weight, rstd = ctx.saved_tensors
    if dy is None:  # only h's gradient reached add_rms_norm (the op path does not materialize zeros)
        dy = torch.zeros_like(x)
    if _create_graph(dy, x, weight, dresidual):
        dx, dw = _ref.rms_norm_bwd_differentiable(dy, x, weight, ctx.eps, dresidual, need_dw)
    elif backward_op is None:
        dx, dw = _backward_kernel(dy, x, weight, rstd, dresidual, need_dw, ctx.backend)
    else:
        dx, dw = backward_op()(dy, x, weight, rstd, dresidual, need_dw, ctx.backend)
    return dx, (dw if need_dw else None)


def _setup_rms_norm(ctx, inputs, output):
    x, weight, eps = inputs
    _save(ctx, x, weight, output[1], eps, _backend.capture_request(OP))


def make_rms_norm_backward(backward_op):
    """The autograd backward of rms_norm, calling ``backward_op()`` off the fast path (the custom op,
    or the triton_op variant's backward in ``rms_norm_triton_op``): one definition for all."""

    def _backward_rms_norm(ctx, dy, _drstd):
        dx, dw = _grads(ctx, dy, None, ctx.needs_input_grad[1], backward_op)
        return dx, dw, None

    return _backward_rms_norm


def _backward_op():
    return torch.ops.titan.rms_norm_backward


rms_norm_op.register_autograd(make_rms_norm_backward(_backward_op), setup_context=_setup_rms_norm)


def _setup_add_rms_norm(ctx, inputs, output):
    _, _, weight, eps = inputs
    _save(ctx, output[1], weight, output[2], eps, _backend.capture_request(OP))


def make_add_rms_norm_backward(backward_op):
    """The autograd backward of add_rms_norm, calling ``backward_op()`` (see make_rms_norm_backward)."""

    def _backward_add_rms_norm(ctx, dy, dh, _drstd):
        dx, dw = _grads(ctx, dy, dh, ctx.needs_input_grad[2], backward_op)
        # d(x + residual)/dx = d/dresidual = 1: both inputs get the same gradient, as aten.add's backward.
        return dx, dx, dw, None

    return _backward_add_rms_norm


add_rms_norm_op.register_autograd(make_add_rms_norm_backward(_backward_op), setup_context=_setup_add_rms_norm)


# ----------------------------------------------------------------------------- eager fast path


class _RMSNormFn(torch.autograd.Function):
    """The eager fast path of titan::rms_norm: the same ``_forward``, ``_save`` and ``_grads``."""

    @staticmethod
    def forward(ctx, x, weight, eps, backend):
        y, _, rstd = _forward(x, None, weight, eps, backend)
        _save(ctx, x, weight, rstd, eps, backend)
        return y

    @staticmethod
    def backward(ctx, dy):
        dx, dw = _grads(ctx, dy, None, ctx.needs_input_grad[1], None)
        return dx, dw, None, None


class _AddRMSNormFn(torch.autograd.Function):
    """The eager fast path of titan::add_rms_norm: the same ``_forward``, ``_save`` and ``_grads``."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, backend):
        y, h, rstd = _forward(x, residual, weight, eps, backend)
        _save(ctx, h, weight, rstd, eps, backend)
        return y, h

    @staticmethod
    def backward(ctx, dy, dh):
        dx, dw = _grads(ctx, dy, dh, ctx.needs_input_grad[2], None)
        return dx, dx, dw, None, None


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# The triton_op variant (rms_norm_triton_op.py) on the traced CUDA path; off by default until measured.
TRITON_OP_ENV = "TITAN_KERNELS_TRITON_OP"
_TRITON_OP = os.environ.get(TRITON_OP_ENV, "0") == "1"


def _route_triton_op(*tensors) -> bool:
    if not _TRITON_OP or tensors[0].device.type != "cuda":
        return False
    from torch.distributed.tensor import DTensor

    return not any(isinstance(t, DTensor) for t in tensors if t is not None)


# ----------------------------------------------------------------------------- public API


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """Root-mean-square normalization over the last dim, fused in one kernel.

    Same result as ``torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)``.

    Args:
        x: (..., N), float32 / bfloat16 / float16, any strides; zero-size allowed.
        weight: (N,) float tensor or None (no affine scale).
        eps: finite float > 0 added to the mean square.

    Returns:
        (..., N) tensor in x.dtype; statistics are computed in float32.

    Raises:
        TypeError: x or weight not a float32/bf16/fp16 tensor, eps not a number.
        ValueError: weight shape != (N,), mixed devices, eps <= 0 or not finite.
        RuntimeError: the requested backend cannot run on x's device.

    Source: Zhang & Sennrich 2019, "Root Mean Square Layer Normalization", eq. 4.
    """
    eps = _validate(x, weight, eps)
    if eager_fast_path(x, weight):
        if _needs_grad(x, weight):  # the request is captured only when a backward will need it
            return _RMSNormFn.apply(x, weight, eps, _backend.capture_request(OP))
        return _forward(x, None, weight, eps, None)[0]
    if _route_triton_op(x, weight):
        return torch.ops.titan.rms_norm_triton(x, weight, eps)[0]
    return torch.ops.titan.rms_norm(x, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused pre-norm residual step: returns ``(rms_norm(x + residual, weight, eps), x + residual)``.

    One pass reads x and residual once and writes the sum and the normalized output; the backward
    adds the residual-stream gradient into dx in the same kernel.

    Args:
        x, residual: (..., N), the same shape and dtype (float32 / bfloat16 / float16).
        weight: (N,) or None. eps: finite float > 0.

    Returns:
        (normed, h): both (..., N) in x.dtype; h = x + residual rounded to x.dtype.

    Raises:
        TypeError / ValueError as ``rms_norm``, plus residual shape or dtype different from x.

    Source: Zhang & Sennrich 2019, eq. 4; the residual layout of the Llama pre-norm block.
    """
    check_tensor(residual, "residual")
    eps = _validate(x, weight, eps, residual)
    if eager_fast_path(x, residual, weight):
        if _needs_grad(x, residual, weight):
            return _AddRMSNormFn.apply(x, residual, weight, eps, _backend.capture_request(OP))
        y, h, _ = _forward(x, residual, weight, eps, None)
        return y, h
    if _route_triton_op(x, residual, weight):
        y, h, _ = torch.ops.titan.add_rms_norm_triton(x, residual, weight, eps)
        return y, h
    y, h, _ = torch.ops.titan.add_rms_norm(x, residual, weight, eps)
    return y, h


def _register_triton_op() -> None:
    try:
        from titan_kernels.ops import rms_norm_triton_op  # noqa: F401  (defines the titan::*_triton ops)
    except ImportError:  # no triton, or a torch without torch.library.triton_op: the custom op only
        global _TRITON_OP
        _TRITON_OP = False


_register_triton_op()
