"""RMSNorm ops: ``torch.ops.titan.rms_norm``, ``torch.ops.titan.add_rms_norm`` and their backward
``torch.ops.titan.rms_norm_backward``.

Math: Zhang & Sennrich 2019, "Root Mean Square Layer Normalization", eq. 4 (see
``titan_kernels.reference.rms_norm`` for the forward and backward formulas).

Built by the op scaffold (``titan_kernels.ops._scaffold``): custom ops with fakes, autograd, the
eager fast path and the sharding rules below. ``add_rms_norm`` shares rms_norm's implementations and
backward op. On CUDA, traced code can use the ``triton_op`` variant instead (``rms_norm_triton_op.py``,
``TITAN_KERNELS_TRITON_OP=1``), which Inductor traces into; it saves and differentiates with the same
``save_*`` and ``gradients``.

Double backward (create_graph=True) is implemented: ``gradients`` then computes them with the
differentiable float32 reference math (``reference.rms_norm.rms_norm_bwd_differentiable``, which
recomputes rstd from x) instead of the kernel, so second derivatives are exact in both paths.
"""
from __future__ import annotations


import torch

from titan_kernels.ops._common import check_eps, check_float, check_same_device, check_tensor, eager_fast_path, needs_grad
from titan_kernels.ops._scaffold import Op
from titan_kernels.reference import rms_norm as _ref

OP = "rms_norm"
rms_norm_def = Op(OP)
add_rms_norm_def = Op("add_rms_norm", impls=OP)
# Every implementation: fwd(x, residual, weight, eps) -> (y, h or None, rstd);
# bwd(dy, x, weight, rstd, dresidual, compute_dweight) -> (dx, dweight or None).
rms_norm_def.register("reference", (_ref.rms_norm_fwd, _ref.rms_norm_bwd))
rms_norm_def.register_triton("titan_kernels.triton.rms_norm", "rms_norm_fwd", "rms_norm_bwd")


def _native_fwd(x, residual, weight, eps):
    return tuple(torch.ops.titan.rms_norm_fwd_native(x, residual, weight, eps))


def _native_bwd(dy, x, weight, rstd, dresidual, compute_dweight):
    dx, dw = torch.ops.titan.rms_norm_bwd_native(dy, x, weight, rstd, dresidual, compute_dweight)
    return dx, (dw if compute_dweight and weight is not None else None)


rms_norm_def.register_native((_native_fwd, _native_bwd))

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


# ----------------------------------------------------------------------------- the ops


def forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
            backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """y = x * rsqrt(mean(x^2, -1) + eps) * weight, and the per-row rstd.

    x: (..., N) float32/bf16/fp16; weight: (N,) or None. Returns y (..., N) in x.dtype and
    rstd (...,) float32 (saved for the backward). ``backend``: the request (None: the one in force).
    """
    y, _, rstd = rms_norm_def.kernels(x.device, backend).forward(x, None, weight, eps)
    return y, rstd


def _fake(x, weight, eps, backend=None):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), x.new_empty(x.shape[:-1], dtype=torch.float32)


def add_forward(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float,
                backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h = x + residual (in x.dtype); y = rms_norm(h). Returns (y, h, rstd); shapes as rms_norm."""
    y, h, rstd = rms_norm_def.kernels(x.device, backend).forward(x, residual, weight, eps)
    return y, h, rstd


def _add_fake(x, residual, weight, eps, backend=None):
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty(x.shape, dtype=x.dtype, device=x.device),
            x.new_empty(x.shape[:-1], dtype=torch.float32))


def dweight_or_empty(dw: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """dweight as the backward ops return it: an empty (0,) tensor (weight's dtype, else x's) for
    None. Shared with the triton_op variant (``rms_norm_triton_op``)."""
    if dw is None:
        dw = x.new_empty((0,), dtype=weight.dtype if weight is not None else x.dtype)
    return dw


def backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor,
             dresidual: torch.Tensor | None, compute_dweight: bool,
             backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of rms_norm. dy, x: (..., N); rstd: (...,) float32; dresidual: (..., N) or None,
    added to dx (the residual branch of add_rms_norm). Returns dx (..., N) in x.dtype, a fresh
    buffer (never an alias of dy or dresidual), and dweight (N,) in weight.dtype accumulated in
    float32, or an empty (0,) tensor when ``compute_dweight`` is False or weight is None.
    ``backend``: the forward's request.
    """
    dx, dw = rms_norm_def.kernels(x.device, backend).backward(dy, x, weight, rstd, dresidual, compute_dweight)
    return dx, dweight_or_empty(dw, x, weight)


def _backward_fake(dy, x, weight, rstd, dresidual, compute_dweight, backend=None):
    n = x.shape[-1] if (compute_dweight and weight is not None) else 0
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device),
            x.new_empty((n,), dtype=weight.dtype if weight is not None else x.dtype))


# ----------------------------------------------------------------------------- the one autograd definition
# Shared with the triton_op variant, which passes its own backward op to ``gradients``.


def save_rms_norm(ctx, inputs, output) -> None:
    x, weight, eps = inputs[:3]
    ctx.save_for_backward(x, weight, output[1])
    ctx.eps = eps


def save_add_rms_norm(ctx, inputs, output) -> None:
    # h, an output, is the normalized input: double backward flows through it.
    ctx.save_for_backward(output[1], inputs[2], output[2])
    ctx.eps = inputs[3]


def gradients(ctx, dy, dresidual, need_dw: bool, run_backward):
    """(dx, dweight or None) from the saved (x or h, weight, rstd): ``run_backward`` (the backward op's
    call) on the forward's backend, or under create_graph the differentiable reference math."""
    x, weight, rstd = ctx.saved_tensors
    if dy is None:  # only h's gradient reached add_rms_norm (the op path does not materialize zeros)
        dy = torch.zeros_like(x)
    if needs_grad(dy, x, weight, dresidual):  # grad mode is on inside a backward only under create_graph
        dx, dw = _ref.rms_norm_bwd_differentiable(dy, x, weight, ctx.eps, dresidual, need_dw)
    else:
        dx, dw = run_backward(dy, x, weight, rstd, dresidual, need_dw, ctx.backend)
    return dx, (dw if need_dw else None)


def _grads(ctx, dy, _drstd):
    dx, dw = gradients(ctx, dy, None, ctx.needs_input_grad[1], rms_norm_def.backward)
    return dx, dw, None


def _add_grads(ctx, dy, dh, _drstd):
    dx, dw = gradients(ctx, dy, dh, ctx.needs_input_grad[2], rms_norm_def.backward)
    # d(x + residual)/dx = d/dresidual = 1: both inputs get the same gradient, as aten.add's backward.
    return dx, dx, dw, None


# ----------------------------------------------------------------------------- sharding rules
# Mirrors PyTorch's rules for aten._fused_rms_norm: rows (every dim but the last) shard freely, the
# hidden dim must be whole on every rank, the weight is replicated and its gradient comes out Partial
# (a per-rank sum over local rows, reduced later by whoever owns the parameter, e.g. FSDP or TP).
# A placement not listed makes DTensor redistribute first, never compute a wrong answer.


def _row_placements(x) -> list:
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate(), *map(Shard, range(len(x.shape) - 1))]


def _sharding(x, weight, eps, backend=None):
    from torch.distributed.tensor import Replicate

    w = Replicate() if weight is not None else None
    return [([p, p], [p, w, None, None]) for p in _row_placements(x)]


def _add_sharding(x, residual, weight, eps, backend=None):
    from torch.distributed.tensor import Replicate

    w = Replicate() if weight is not None else None
    return [([p, p, p], [p, p, w, None, None]) for p in _row_placements(x)]


def _backward_sharding(dy, x, weight, rstd, dresidual, compute_dweight, backend=None):
    from torch.distributed.tensor import Partial, Replicate

    w = Replicate() if weight is not None else None
    rules = []
    for p in _row_placements(x):
        # With no weight, dweight is an empty placeholder: keep it Replicate (nothing to reduce).
        dw = Partial() if (weight is not None and p != Replicate()) else Replicate()
        rules.append(([p, dw], [p, p, w, p, p if dresidual is not None else None, None, None]))
    return rules


rms_norm_def.define(forward, _fake, setup=save_rms_norm, grads=_grads, backward=backward,
                    backward_fake=_backward_fake, sharding=_sharding, backward_sharding=_backward_sharding)
add_rms_norm_def.define(add_forward, _add_fake, setup=save_add_rms_norm, grads=_add_grads, sharding=_add_sharding)

# ----------------------------------------------------------------------------- the triton_op route

# The triton_op variant (rms_norm_triton_op.py) on the traced CUDA path; off by default until measured.
# It is registered on request only (``titan_kernels.ops.triton_op.enable_triton_op``, or this variable
# set when ``titan_kernels`` is imported): its module imports Inductor, which costs seconds at import.
TRITON_OP_ENV = "TITAN_KERNELS_TRITON_OP"
_TRITON_OP = False


def set_triton_op_route(on: bool) -> None:
    """Route traced CUDA calls to the triton_op variant (``on``) or keep the custom op; the variant
    must be registered first (``enable_triton_op`` does both)."""
    global _TRITON_OP
    _TRITON_OP = bool(on)


def _route_triton_op(*tensors) -> bool:
    """Whether a call goes to the triton_op variant: asked for, CUDA, traced (not the eager fast
    path), no DTensor (only the custom op has sharding rules), and the variant registered."""
    if not _TRITON_OP or tensors[0].device.type != "cuda" or eager_fast_path(*tensors):
        return False
    from torch.distributed.tensor import DTensor

    return not any(isinstance(t, DTensor) for t in tensors if t is not None) and hasattr(torch.ops.titan, "rms_norm_triton")


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
    if _TRITON_OP and _route_triton_op(x, weight):
        return torch.ops.titan.rms_norm_triton(x, weight, eps)[0]
    return rms_norm_def(x, weight, eps)[0]


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
    if _TRITON_OP and _route_triton_op(x, residual, weight):
        y, h, _ = torch.ops.titan.add_rms_norm_triton(x, residual, weight, eps)
    else:
        y, h, _ = add_rms_norm_def(x, residual, weight, eps)
    return y, h


