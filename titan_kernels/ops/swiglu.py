"""SwiGLU ops: ``torch.ops.titan.swiglu`` (y = silu(gate) * up, or GPT-OSS's clamped variant
y = (clamp(up, -limit, limit) + up_offset) * g_c * sigmoid(alpha * g_c) with g_c = min(gate, limit))
and its backward ``torch.ops.titan.swiglu_backward``.

Math: Shazeer 2020, "GLU Variants Improve Transformer", eq. 5; the variant after OpenAI's gpt-oss
reference and Hugging Face ``GptOssExperts._apply_gate`` (see ``titan_kernels.reference.swiglu`` for
the backward and second-derivative formulas). The forward saves only its inputs; the backward
recomputes sigmoid in the same kernel (Liger's scheme), so the activation is never stored. The
variant's scalars (alpha, limit, up_offset) ride along as op arguments and autograd attributes; the
plain SwiGLU (alpha 1, no limit, up_offset 0) runs every backend's unchanged plain code.

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

import math

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


# Every implementation takes (gate, up[, alpha, limit, up_offset]) / (dy, gate, up[, ...]): the plain
# SwiGLU passes no scalars (see _variant), so its calls are exactly what they were.


def _native_fwd(gate, up, *scalars):
    if scalars:
        return torch.ops.titan.swiglu_clamped_fwd_native(gate, up, *scalars)
    return torch.ops.titan.swiglu_fwd_native(gate, up)


def _native_bwd(dy, gate, up, *scalars):
    if scalars:
        return tuple(torch.ops.titan.swiglu_clamped_bwd_native(dy, gate, up, *scalars))
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


_NUM = (float, int)


def _finite_float(x: object, arg: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float, torch.SymInt, torch.SymFloat)):
        raise TypeError(f"{arg}: expected a float, got {type(x).__name__}")
    x = float(x)
    if not -math.inf < x < math.inf:  # not math.isfinite: it takes no symbolic float (torch.compile)
        raise ValueError(f"{arg}: expected a finite value, got {x}")
    return x


def _variant(alpha: object, limit: object, up_offset: object) -> tuple:
    """The scalars to hand to the kernels, checked: () for the plain SwiGLU (alpha 1, no limit,
    up_offset 0: every implementation's defaults), else (alpha, limit, up_offset) as floats with alpha
    finite > 0, limit None or finite > 0, up_offset finite."""
    if limit is None and alpha == 1.0 and up_offset == 0.0 and type(alpha) in _NUM and type(up_offset) in _NUM:
        return ()  # the common case, checked in one line (the eager per-call cost)
    alpha = _finite_float(alpha, "alpha")
    if alpha <= 0:
        raise ValueError(f"alpha: expected a finite value > 0, got {alpha}")
    if limit is not None:
        limit = _finite_float(limit, "limit")
        if limit <= 0:
            raise ValueError(f"limit: expected None (no clamp) or a finite value > 0, got {limit}")
    up_offset = _finite_float(up_offset, "up_offset")
    return () if _ref.is_plain(alpha, limit, up_offset) else (alpha, limit, up_offset)


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


# scalars: (alpha, limit, up_offset), checked, or () for the plain SwiGLU, whose call stays the plain
# (gate, up) one: no argument unpacking on the eager hot path (it measurably costs there).


def _forward(gate: torch.Tensor, up: torch.Tensor, backend: str | None, scalars: tuple = ()) -> torch.Tensor:
    fwd = _impl(gate.device, backend)[0]
    return fwd(gate, up, *scalars) if scalars else fwd(gate, up)


def _backward_kernel(dy, gate, up, backend: str | None, scalars: tuple = ()) -> tuple[torch.Tensor, torch.Tensor]:
    bwd = _impl(gate.device, backend)[1]
    return bwd(dy, gate, up, *scalars) if scalars else bwd(dy, gate, up)


# ----------------------------------------------------------------------------- ops


# backend stays the third argument (callers pass it positionally); the variant's scalars follow it.


@torch.library.custom_op("titan::swiglu", mutates_args=())
def swiglu_op(
    gate: torch.Tensor, up: torch.Tensor, backend: str | None = None, alpha: float = 1.0,
    limit: float | None = None, up_offset: float = 0.0,
) -> torch.Tensor:
    """y = (clamp(up, -limit, limit) + up_offset) * g_c * sigmoid(alpha * g_c), g_c = min(gate, limit);
    silu(gate) * up with the defaults. gate, up: (..., H) of one dtype (float32/bf16/fp16), any
    strides. Returns a new contiguous (..., H) tensor in that dtype, computed in float32. ``backend``:
    the implementation to run (None: the automatic choice). See ``titan_kernels.swiglu`` (which
    validates the tensors; the fake checks them too, the scalars are checked here)."""
    return _forward(gate, up, backend, _variant(alpha, limit, up_offset))


@swiglu_op.register_fake
def _(gate, up, backend=None, alpha=1.0, limit=None, up_offset=0.0):
    _validate(gate, up)
    _variant(alpha, limit, up_offset)
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)


@torch.library.custom_op("titan::swiglu_backward", mutates_args=())
def swiglu_backward_op(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, backend: str | None = None, alpha: float = 1.0,
    limit: float | None = None, up_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of titan::swiglu with the same scalars: (dgate, dup) = (dy * v * sw'(g_c) * [gate <=
    limit], dy * sw(g_c) * [-limit <= up <= limit]) with sw(x) = x * sigmoid(alpha x), v = u_c +
    up_offset, sigmoid recomputed; plain (dy * up * silu'(gate), dy * silu(gate)) with the defaults.
    dy, gate, up: (..., H) of one dtype; returns new contiguous tensors in that dtype, computed in
    float32."""
    _validate_backward(dy, gate, up)
    return _backward_kernel(dy, gate, up, backend, _variant(alpha, limit, up_offset))


@swiglu_backward_op.register_fake
def _(dy, gate, up, backend=None, alpha=1.0, limit=None, up_offset=0.0):
    _validate_backward(dy, gate, up)
    _variant(alpha, limit, up_offset)
    return (
        torch.empty(gate.shape, dtype=gate.dtype, device=gate.device),
        torch.empty(gate.shape, dtype=gate.dtype, device=gate.device),
    )


# ----------------------------------------------------------------------------- autograd (one definition)


def _setup(ctx, inputs, output):
    gate, up, backend = inputs[0], inputs[1], inputs[2]
    ctx.save_for_backward(gate, up)
    # The forward's choice, handed to the backward (a direct op call with None resolves it here).
    ctx.backend = backend if backend is not None else _backend.resolve(OP, gate.device)
    ctx.scalars = inputs[3:]  # (alpha, limit, up_offset) as given, () on the plain fast path


def _backward(ctx, dy):
    gate, up = ctx.saved_tensors
    dgate, dup = swiglu_backward(dy, gate, up, ctx.backend, *ctx.scalars)
    return dgate, dup, None, *(None,) * len(ctx.scalars)


def _setup_bwd(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1], inputs[2])
    ctx.scalars = inputs[4:]


def _backward_bwd(ctx, ddgate, ddup):
    # Double backward in differentiable aten ops (float32 math), so any order of gradient is exact:
    # the clamps' masks are piecewise constant (reference.swiglu.swiglu_bwd_bwd).
    dy, gate, up = ctx.saved_tensors
    d_dy, d_gate, d_up = _ref.swiglu_bwd_bwd(ddgate, ddup, dy, gate, up, *ctx.scalars)
    return d_dy, d_gate, d_up, None, *(None,) * len(ctx.scalars)


swiglu_op.register_autograd(_backward, setup_context=_setup)
swiglu_backward_op.register_autograd(_backward_bwd, setup_context=_setup_bwd)


class _SwiGLUFn(torch.autograd.Function):
    """Eager fast path of titan::swiglu: the same functions as the op's autograd."""

    @staticmethod
    def forward(ctx, gate, up, backend, *scalars):
        y = _forward(gate, up, backend, scalars)
        _setup(ctx, (gate, up, backend) + scalars, y)
        return y

    @staticmethod
    def backward(ctx, dy):
        return _backward(ctx, dy)


class _SwiGLUBackwardFn(torch.autograd.Function):
    """Eager fast path of titan::swiglu_backward when its result needs a gradient (create_graph)."""

    @staticmethod
    def forward(ctx, dy, gate, up, backend, *scalars):
        out = _backward_kernel(dy, gate, up, backend, scalars)
        _setup_bwd(ctx, (dy, gate, up, backend) + scalars, out)
        return out

    @staticmethod
    def backward(ctx, ddgate, ddup):
        return _backward_bwd(ctx, ddgate, ddup)


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


# ----------------------------------------------------------------------------- public API


def swiglu_backward(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, backend: str | None = None, alpha: float = 1.0,
    limit: float | None = None, up_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) of ``swiglu`` with the same alpha, limit, up_offset, for an incoming gradient dy,
    all (..., H) of one dtype. ``backend`` as chosen by the forward (None: the automatic choice).
    Differentiable (double backward)."""
    var = _variant(alpha, limit, up_offset)
    if eager_fast_path(dy, gate, up):
        _validate_backward(dy, gate, up)
        if _needs_grad(dy, gate, up):
            return _SwiGLUBackwardFn.apply(dy, gate, up, backend, *var)
        return _backward_kernel(dy, gate, up, backend, var)
    return torch.ops.titan.swiglu_backward(dy, gate, up, backend, *var)


def swiglu(
    gate: torch.Tensor, up: torch.Tensor, *, alpha: float = 1.0, limit: float | None = None, up_offset: float = 0.0
) -> torch.Tensor:
    """Fused SwiGLU activation: ``silu(gate) * up`` in one kernel, forward and backward; with alpha,
    limit and up_offset, GPT-OSS's clamped SwiGLU.

    Computes, in float32 and rounded once to gate.dtype::

        g_c = min(gate, limit)              (from above only; no clamp when limit is None)
        u_c = clamp(up, -limit, limit)
        y   = (u_c + up_offset) * g_c * sigmoid(alpha * g_c)

    The defaults (alpha 1, no limit, up_offset 0) give ``torch.nn.functional.silu(gate) * up``, on
    the same kernels as before the variant existed. GPT-OSS's experts use alpha=1.702, limit=7.0,
    up_offset=1.0 (its ``gate_up_proj`` interleaves the two: gate = h[..., ::2], up = h[..., 1::2],
    which can be passed as they are). The backward recomputes the sigmoid instead of saving the
    activation: only gate and up are kept for it.

    Args:
        gate: (..., H) float32 / bfloat16 / float16, any strides (e.g. the w1 projection, or a
            slice of a fused w1/w3 projection); zero-size allowed.
        up: same shape, dtype and device as gate (the w3 projection).
        alpha: the sigmoid's slope, a finite float > 0.
        limit: None (no clamp) or a finite float > 0: gate is clamped to at most limit, up to
            [-limit, limit].
        up_offset: a finite float added to the clamped up.

    Returns:
        (..., H) contiguous tensor in gate.dtype; math in float32, rounded once.

    Raises:
        TypeError: gate not a float32/bf16/fp16 tensor, up not a tensor or of another dtype, a
            scalar not a real number.
        ValueError: gate 0-d, up of another shape, mixed devices; alpha not finite and > 0, limit
            not None or finite and > 0, up_offset not finite.
        RuntimeError: the requested backend cannot run on gate's device.

    Gradients, with s = sigmoid(alpha * g_c): dgate = dy * (u_c + up_offset) * s * (1 + alpha * g_c
    * (1 - s)) where gate <= limit, else 0; dup = dy * g_c * s where -limit <= up <= limit, else 0
    (torch.clamp's convention: bounds included, 0 at NaN). Plain: dgate = dy * up * s * (1 + gate *
    (1 - s)), dup = dy * gate * s. Second derivatives are implemented for both
    (``titan_kernels.reference.swiglu``).

    Source: Shazeer 2020, "GLU Variants Improve Transformer", eq. 5; silu (swish) of Elfwing et al.
    2017 and Ramachandran et al. 2017; the clamped variant from OpenAI's gpt-oss reference
    implementation (2025) and Hugging Face ``GptOssExperts._apply_gate``.
    """
    _validate(gate, up)
    # The plain SwiGLU's check inline (this is the eager per-call cost); _variant checks the rest.
    plain = limit is None and alpha == 1.0 and up_offset == 0.0 and type(alpha) in _NUM and type(up_offset) in _NUM
    var = () if plain else _variant(alpha, limit, up_offset)
    backend = _choose(gate.device.type)
    if eager_fast_path(gate, up):
        if _needs_grad(gate, up):
            return _SwiGLUFn.apply(gate, up, backend, *var)
        return _forward(gate, up, backend, var)
    return torch.ops.titan.swiglu(gate, up, backend, *var)
