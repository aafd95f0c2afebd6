"""SwiGLU ops: ``torch.ops.titan.swiglu`` (y = silu(gate) * up) and its backward
``torch.ops.titan.swiglu_backward``.

Math: Shazeer 2020, "GLU Variants Improve Transformer", eq. 5 (see ``titan_kernels.reference.swiglu``
for the backward and second-derivative formulas). The forward saves only its inputs; the backward
recomputes sigmoid(gate) in the same kernel (Liger's scheme), so the activation is never stored.

Both ops are ``torch.library.custom_op``s with fake implementations, autograd through
``register_autograd`` (the backward is itself an op, with its own autograd: double backward is
implemented) and DTensor sharding rules (``titan_kernels.dtensor``). In plain eager mode
``swiglu`` skips the dispatcher and runs the same forward/backward functions through a
``torch.autograd.Function`` (``eager_fast_path``). One autograd definition serves both paths
(``_setup``/``_backward`` and ``_setup_bwd``/``_backward_bwd``), and the backend is chosen once, when
the forward runs, and passed on to the backward, so both always run the same backend.

Backends (automatic order: cpu > reference on CPU tensors; triton > reference on CUDA):
``reference`` (aten ops in float32), ``triton`` and ``cpu`` (csrc/cpu, at::vec + OpenMP).
On this repository's 2-core CPU the native kernel beats the reference; ``bench/bench_swiglu.py``
measures it.
"""
from __future__ import annotations

import torch

from titan_kernels import backend as _backend
from titan_kernels.ops._common import check_float, check_same_device, check_tensor, eager_fast_path
from titan_kernels.reference import swiglu as _ref

OP = "swiglu"
_backend.register_impl(OP, "reference", (_ref.swiglu_fwd, _ref.swiglu_bwd))


def _register_triton() -> None:
    try:
        from titan_kernels.triton import swiglu as _tri
    except ImportError:  # triton not installed: the backend reports itself unavailable
        return
    _backend.register_impl(OP, "triton", (_tri.swiglu_fwd, _tri.swiglu_bwd))


def _native_fwd(gate, up):
    return torch.ops.titan.swiglu_fwd_native(gate, up)


def _native_bwd(dy, gate, up):
    return tuple(torch.ops.titan.swiglu_bwd_native(dy, gate, up))


_register_triton()
_backend.register_impl(OP, "cpu", (_native_fwd, _native_bwd))  # available where csrc is built (backend.py)


@torch.compiler.assume_constant_result
def _choose(device_type: str) -> str:
    """The backend for this call (explicit > use_backend > env > automatic). Under torch.compile it
    is decided once, when the graph is traced (reading the use_backend context cannot be traced)."""
    return _backend.resolve(OP, device_type)


def _impl(device: torch.device, backend: str | None):
    return _backend.get_impl(OP, device, backend)


# ----------------------------------------------------------------------------- validation


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _validate(gate, up) -> None:
    check_float(gate, "gate")
    check_tensor(up, "up")
    if gate.dim() < 1:
        raise ValueError("gate: expected at least 1 dimension (..., hidden), got a 0-d tensor")
    if up.shape != gate.shape:
        raise ValueError(f"up: expected shape {tuple(gate.shape)} (the shape of gate), got {tuple(up.shape)}")
    if up.dtype != gate.dtype:
        raise TypeError(f"up: expected dtype {_dt(gate.dtype)} (the dtype of gate), got {_dt(up.dtype)}")
    check_same_device({"gate": gate, "up": up})


def _validate_backward(dy, gate, up) -> None:
    _validate(gate, up)
    check_tensor(dy, "dy")
    if dy.shape != gate.shape:
        raise ValueError(f"dy: expected shape {tuple(gate.shape)} (the shape of gate), got {tuple(dy.shape)}")
    if dy.dtype != gate.dtype:
        raise TypeError(f"dy: expected dtype {_dt(gate.dtype)} (the dtype of gate), got {_dt(dy.dtype)}")
    check_same_device({"gate": gate, "dy": dy})


# ----------------------------------------------------------------------------- forward / backward functions
# The only functions that run kernels; both the op path and the eager fast path call them.


def _forward(gate: torch.Tensor, up: torch.Tensor, backend: str | None) -> torch.Tensor:
    return _impl(gate.device, backend)[0](gate, up)


def _backward_kernel(dy, gate, up, backend: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    return _impl(gate.device, backend)[1](dy, gate, up)


# ----------------------------------------------------------------------------- ops


@torch.library.custom_op("titan::swiglu", mutates_args=())
def swiglu_op(gate: torch.Tensor, up: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """y = silu(gate) * up. gate, up: (..., H) of one dtype (float32/bf16/fp16), any strides.
    Returns a new contiguous (..., H) tensor in that dtype, computed in float32. ``backend``: the
    implementation to run (None: the automatic choice). See ``titan_kernels.swiglu``."""
    return _forward(gate, up, backend)


@swiglu_op.register_fake
def _(gate, up, backend=None):
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)


@torch.library.custom_op("titan::swiglu_backward", mutates_args=())
def swiglu_backward_op(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of titan::swiglu: (dgate, dup) = (dy * up * silu'(gate), dy * silu(gate)), with
    sigmoid(gate) recomputed. dy, gate, up: (..., H) of one dtype; returns new contiguous tensors in
    that dtype, computed in float32."""
    _validate_backward(dy, gate, up)
    return _backward_kernel(dy, gate, up, backend)


@swiglu_backward_op.register_fake
def _(dy, gate, up, backend=None):
    return (
        torch.empty(gate.shape, dtype=gate.dtype, device=gate.device),
        torch.empty(gate.shape, dtype=gate.dtype, device=gate.device),
    )


# ----------------------------------------------------------------------------- autograd (one definition)


def _setup(ctx, inputs, output):
    gate, up, backend = inputs
    ctx.save_for_backward(gate, up)
    # The forward's choice, handed to the backward (a direct op call with None resolves it here).
    ctx.backend = backend if backend is not None else _backend.resolve(OP, gate.device)


def _backward(ctx, dy):
    gate, up = ctx.saved_tensors
    dgate, dup = swiglu_backward(dy, gate, up, ctx.backend)
    return dgate, dup, None


def _setup_bwd(ctx, inputs, output):
    dy, gate, up, _ = inputs
    ctx.save_for_backward(dy, gate, up)


def _backward_bwd(ctx, ddgate, ddup):
    # Double backward in differentiable aten ops (float32 math), so any order of gradient is exact.
    dy, gate, up = ctx.saved_tensors
    d_dy, d_gate, d_up = _ref.swiglu_bwd_bwd(ddgate, ddup, dy, gate, up)
    return d_dy, d_gate, d_up, None


swiglu_op.register_autograd(_backward, setup_context=_setup)
swiglu_backward_op.register_autograd(_backward_bwd, setup_context=_setup_bwd)


class _SwiGLUFn(torch.autograd.Function):
    """Eager fast path of titan::swiglu: the same functions as the op's autograd."""

    @staticmethod
    def forward(ctx, gate, up, backend):
        y = _forward(gate, up, backend)
        _setup(ctx, (gate, up, backend), y)
        return y

    @staticmethod
    def backward(ctx, dy):
        return _backward(ctx, dy)


class _SwiGLUBackwardFn(torch.autograd.Function):
    """Eager fast path of titan::swiglu_backward when its result needs a gradient (create_graph)."""

    @staticmethod
    def forward(ctx, dy, gate, up, backend):
        out = _backward_kernel(dy, gate, up, backend)
        _setup_bwd(ctx, (dy, gate, up, backend), out)
        return out

    @staticmethod
    def backward(ctx, ddgate, ddup):
        return _backward_bwd(ctx, ddgate, ddup)


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


# ----------------------------------------------------------------------------- public API


def swiglu_backward(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) of ``swiglu`` for an incoming gradient dy, all (..., H) of one dtype. ``backend``
    as chosen by the forward (None: the automatic choice). Differentiable (double backward)."""
    if eager_fast_path(dy, gate, up):
        _validate_backward(dy, gate, up)
        if _needs_grad(dy, gate, up):
            return _SwiGLUBackwardFn.apply(dy, gate, up, backend)
        return _backward_kernel(dy, gate, up, backend)
    return torch.ops.titan.swiglu_backward(dy, gate, up, backend)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Fused SwiGLU activation: ``silu(gate) * up`` in one kernel, forward and backward.

    Same result as ``torch.nn.functional.silu(gate) * up`` computed in float32. The backward
    recomputes sigmoid(gate) instead of saving silu(gate): only gate and up are kept for it.

    Args:
        gate: (..., H) float32 / bfloat16 / float16, any strides (e.g. the w1 projection, or a
            slice of a fused w1/w3 projection); zero-size allowed.
        up: same shape, dtype and device as gate (the w3 projection).

    Returns:
        (..., H) contiguous tensor in gate.dtype; math in float32, rounded once.

    Raises:
        TypeError: gate not a float32/bf16/fp16 tensor, up not a tensor or of another dtype.
        ValueError: gate 0-d, up of another shape, mixed devices.
        RuntimeError: the requested backend cannot run on gate's device.

    Gradients: dgate = dy * up * s * (1 + gate * (1 - s)), dup = dy * gate * s with s =
    sigmoid(gate); second derivatives are implemented (``titan_kernels.reference.swiglu``).

    Source: Shazeer 2020, "GLU Variants Improve Transformer", eq. 5; silu (swish) of Elfwing et al.
    2017 and Ramachandran et al. 2017.
    """
    _validate(gate, up)
    backend = _choose(gate.device.type)
    if eager_fast_path(gate, up):
        if _needs_grad(gate, up):
            return _SwiGLUFn.apply(gate, up, backend)
        return _forward(gate, up, backend)
    return torch.ops.titan.swiglu(gate, up, backend)
