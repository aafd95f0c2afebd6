"""SwiGLU ops: ``torch.ops.titan.swiglu`` (y = silu(gate) * up, or GPT-OSS's clamped variant
y = (clamp(up, -limit, limit) + up_offset) * g_c * sigmoid(alpha * g_c) with g_c = min(gate, limit))
and its backward ``torch.ops.titan.swiglu_backward``.

Math: Shazeer 2020, "GLU Variants Improve Transformer", eq. 5; the variant after OpenAI's gpt-oss
reference and Hugging Face ``GptOssExperts._apply_gate`` (see ``titan_kernels.reference.swiglu`` for
the backward and second-derivative formulas). The forward saves only its inputs; the backward
recomputes sigmoid in the same kernel (Liger's scheme), so the activation is never stored. The
variant's scalars (alpha, limit, up_offset) ride along as op arguments and autograd attributes; the
plain SwiGLU (alpha 1, no limit, up_offset 0) runs every backend's unchanged plain code.

Both ops are built by the op scaffold (``titan_kernels.ops._scaffold``): custom ops with fakes, one
autograd definition for the op path and the eager fast path (the backward is itself an op, with its
own autograd: double backward is implemented), the forward's request handed to the backward, and
the sharding rules below.

Backends (automatic order: cpu > reference on CPU tensors; triton > reference on CUDA):
``reference`` (aten ops in float32), ``triton`` and ``cpu`` (csrc/cpu, at::vec + OpenMP).
On this repository's 2-core CPU the native kernel beats the reference; ``bench/bench_swiglu.py``
measures it.
"""
from __future__ import annotations

import math

import torch

from titan_kernels.ops._common import check_float, check_same_device, check_tensor, dtype_name
from titan_kernels.ops._scaffold import Op
from titan_kernels.reference import swiglu as _ref

OP = "swiglu"
swiglu_def = Op(OP)
# Every implementation takes (gate, up[, alpha, limit, up_offset]) / (dy, gate, up[, ...]): the plain
# SwiGLU passes no scalars, so its calls are exactly what they were before the variant existed.
swiglu_def.register("reference", (_ref.swiglu_fwd, _ref.swiglu_bwd))
swiglu_def.register_triton("titan_kernels.triton.swiglu", "swiglu_fwd", "swiglu_bwd")


def _native_fwd(gate, up, *scalars):
    if scalars:
        return torch.ops.titan.swiglu_clamped_fwd_native(gate, up, *scalars)
    return torch.ops.titan.swiglu_fwd_native(gate, up)


def _native_bwd(dy, gate, up, *scalars):
    if scalars:
        return tuple(torch.ops.titan.swiglu_clamped_bwd_native(dy, gate, up, *scalars))
    return tuple(torch.ops.titan.swiglu_bwd_native(dy, gate, up))


swiglu_def.register_native((_native_fwd, _native_bwd), families=("cpu",))


# ----------------------------------------------------------------------------- validation


def _validate(gate, up) -> None:
    check_float(gate, "gate")
    check_tensor(up, "up")
    if gate.dim() < 1:
        raise ValueError("gate: expected at least 1 dimension (..., hidden), got a 0-d tensor")
    if up.shape != gate.shape:
        raise ValueError(f"up: expected shape {tuple(gate.shape)} (the shape of gate), got {tuple(up.shape)}")
    if up.dtype != gate.dtype:
        raise TypeError(f"up: expected dtype {dtype_name(gate.dtype)} (the dtype of gate), got {dtype_name(up.dtype)}")
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
        raise TypeError(f"dy: expected dtype {dtype_name(gate.dtype)} (the dtype of gate), got {dtype_name(dy.dtype)}")
    check_same_device({"gate": gate, "dy": dy})


# ----------------------------------------------------------------------------- the op


def _plain(alpha, limit, up_offset) -> bool:
    return limit is None and alpha == 1.0 and up_offset == 0.0


def forward(gate: torch.Tensor, up: torch.Tensor, alpha: float = 1.0, limit: float | None = None,
            up_offset: float = 0.0, backend: str | None = None) -> torch.Tensor:
    """y = (clamp(up, -limit, limit) + up_offset) * g_c * sigmoid(alpha * g_c), g_c = min(gate, limit);
    silu(gate) * up with the defaults. gate, up: (..., H) of one dtype (float32/bf16/fp16), any
    strides. Returns a new contiguous (..., H) tensor in that dtype, computed in float32. ``backend``:
    the request (None: the one in force). See ``titan_kernels.swiglu`` (which validates the tensors;
    the fake checks them too, the scalars are checked here)."""
    fwd = swiglu_def.kernels(gate.device, backend).forward
    if _plain(alpha, limit, up_offset):  # the plain call, no argument unpacking (it measurably costs)
        return fwd(gate, up)
    return fwd(gate, up, *_variant(alpha, limit, up_offset))


def _fake(gate, up, alpha=1.0, limit=None, up_offset=0.0, backend=None):
    _validate(gate, up)
    _variant(alpha, limit, up_offset)
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)


def backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, alpha: float = 1.0,
             limit: float | None = None, up_offset: float = 0.0,
             backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of titan::swiglu with the same scalars: (dgate, dup) = (dy * v * sw'(g_c) * [gate <=
    limit], dy * sw(g_c) * [-limit <= up <= limit]) with sw(x) = x * sigmoid(alpha x), v = u_c +
    up_offset, sigmoid recomputed; plain (dy * up * silu'(gate), dy * silu(gate)) with the defaults.
    dy, gate, up: (..., H) of one dtype; returns new contiguous tensors in that dtype, computed in
    float32."""
    _validate_backward(dy, gate, up)
    bwd = swiglu_def.kernels(gate.device, backend).backward
    if _plain(alpha, limit, up_offset):
        return bwd(dy, gate, up)
    return bwd(dy, gate, up, *_variant(alpha, limit, up_offset))


def _fake_backward(dy, gate, up, alpha=1.0, limit=None, up_offset=0.0, backend=None):
    _validate_backward(dy, gate, up)
    _variant(alpha, limit, up_offset)
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device), torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:-4])  # (gate, up) or, for the backward op, (dy, gate, up)
    ctx.scalars = inputs[-4:-1]  # (alpha, limit, up_offset)


def _grads(ctx, dy):
    gate, up = ctx.saved_tensors
    return (*swiglu_def.backward(dy, gate, up, *ctx.scalars, ctx.backend), None, None, None)


def _double_backward(ctx, ddgate, ddup):
    # In differentiable aten ops (float32 math), so any order of gradient is exact: the clamps' masks
    # are piecewise constant (reference.swiglu.swiglu_bwd_bwd).
    dy, gate, up = ctx.saved_tensors
    return (*_ref.swiglu_bwd_bwd(ddgate, ddup, dy, gate, up, *_variant(*ctx.scalars)), None, None, None)


def _sharding(gate, up, *rest):
    # Elementwise: gate and up split the same way on any dim run locally, the hidden dim included
    # (tensor parallel: w1/w3 colwise give Shard(-1) outputs), and the output keeps that placement.
    # Partial inputs are not local (silu is not linear): DTensor reduces them first. The clamped
    # variant's scalars change nothing. rest: the scalars and backend (no placement).
    from torch.distributed.tensor import Replicate, Shard

    flags = [None] * len(rest)
    return [([p], [p, p, *flags]) for p in (Replicate(), *map(Shard, range(len(gate.shape))))]


def _backward_sharding(dy, gate, up, *rest):
    from torch.distributed.tensor import Replicate, Shard

    flags = [None] * len(rest)
    return [([p, p], [p, p, p, *flags]) for p in (Replicate(), *map(Shard, range(len(gate.shape))))]


swiglu_def.define(forward, _fake, setup=_setup, grads=_grads, backward=backward, backward_fake=_fake_backward,
                  backward_setup=_setup, backward_grads=_double_backward, sharding=_sharding,
                  backward_sharding=_backward_sharding)


# ----------------------------------------------------------------------------- public API


def swiglu_backward(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, backend: str | None = None, alpha: float = 1.0,
    limit: float | None = None, up_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) of ``swiglu`` with the same alpha, limit, up_offset, for an incoming gradient dy,
    all (..., H) of one dtype. ``backend``: the forward's request (None: the one in force).
    Differentiable (double backward). Raises as ``swiglu``, plus dy of another shape or dtype."""
    _variant(alpha, limit, up_offset)
    return swiglu_def.backward(dy, gate, up, alpha, limit, up_offset, backend)


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
    if not (limit is None and alpha == 1.0 and up_offset == 0.0 and type(alpha) in _NUM and type(up_offset) in _NUM):
        _variant(alpha, limit, up_offset)  # the plain SwiGLU's check is the line above (the eager per-call cost)
    return swiglu_def(gate, up, alpha, limit, up_offset)
