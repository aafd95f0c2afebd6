"""MoE token routing ops: ``torch.ops.titan.moe_permute`` (tokens to expert order, each group padded
to a multiple of ``align``) and ``torch.ops.titan.moe_unpermute`` (back to token order, the top-k
expert outputs summed with the router scores as weights), with their backward ops
``titan::moe_permute_backward`` and ``titan::moe_unpermute_backward``.

The index math (which row each (token, choice) slot goes to) is ``moe_routing``: a stable argsort of
the expert ids and a histogram, vectorized torch ops that trace under torch.compile, no loop over
experts. The data movement is one fused kernel per direction (``titan_kernels.triton.moe_permute``):
permute writes every buffer row once (a copy or the zeros of a padding row), unpermute reads the
top-k rows of a token and sums them weighted in float32; the unpermute backward computes the
buffer's gradient and the scores' gradient in one pass. Math: ``titan_kernels.reference.moe``.

Backends (``titan_kernels.backend``): ``reference`` (aten index ops in float32; also registered as
``cpu``, aten's native CPU index kernels, the automatic choice on CPU tensors) and ``triton`` (the
automatic choice on CUDA). The backend is chosen once in the forward and handed to the backward; the
eager fast path and the ops' ``register_autograd`` run the same functions. Double backward is
refused with a RuntimeError naming the op.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from titan_kernels import backend as _backend
from titan_kernels.ops._common import (
    check_float, check_same_device, check_tensor, eager_fast_path, needs_grad, no_setup, refuse_create_graph,
    refuse_double_backward, replicate_like,
)
from titan_kernels.reference import moe as _ref

OP = "moe_permute"


def _float64_on_reference(device, float64: bool) -> str | None:
    # The automatic choice's case key is whether the rows are float64: the kernels accumulate in float32.
    return "float64 runs on the reference (the kernels accumulate in float32)" if float64 else None


_backend.register_impl(OP, "reference", (_ref.permute_rows, _ref.combine_rows))
# aten's CPU index kernels
_backend.register_impl(OP, "cpu", (_ref.permute_rows, _ref.combine_rows), auto=_float64_on_reference)


def _register_triton() -> None:
    try:
        from titan_kernels.triton import moe_permute as _tri
    except ImportError:  # triton not installed: the backend reports itself unavailable
        return
    _backend.register_impl(OP, "triton", (_tri.permute_rows, _tri.combine_rows), auto=_float64_on_reference)


_register_triton()

_INT = (torch.int32, torch.int64)
_FLOAT = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@torch.compiler.assume_constant_result
def _choose(device_type: str, float64: bool = False) -> str:
    """The backend for this call (use_backend > env > automatic); under torch.compile decided once,
    when the graph is traced. Float64 runs on the reference unless asked otherwise (the kernels
    accumulate in float32)."""
    return _backend.resolve(OP, device_type, key=bool(float64))


def _impl(device: torch.device, backend: str | None):
    return _backend.get_impl(OP, device, backend)


def _dt(dtype) -> str:
    return str(dtype).replace("torch.", "")


# ----------------------------------------------------------------------------- routing index


class MoERouting(NamedTuple):
    """What ``moe_unpermute`` (and the grouped GEMM between them) needs from ``moe_permute``.

    offsets: (E,) int32 cumulative group ends of the permuted buffer (padded groups), the
        ``offsets`` of ``titan_kernels.grouped_mm``.
    counts: (E,) int64 tokens routed to each expert (unpadded): the load-balancing statistic.
    dst: (T, top_k) int64 row of the buffer of each (token, choice) slot.
    src: (R,) int64 slot ``t * top_k + j`` of each buffer row, -1 for a padding row.
    """

    offsets: torch.Tensor
    counts: torch.Tensor
    dst: torch.Tensor
    src: torch.Tensor


def _check_int(value, arg: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{arg}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{arg}: expected an int >= {minimum}, got {value}")
    return value


def moe_routing(expert_indices: torch.Tensor, num_experts: int, align: int = 1) -> MoERouting:
    """The permutation of top-k routed tokens to expert order, as indices (no data moves).

    Args:
        expert_indices: (T, top_k) int32/int64 expert of each token's choices, in [0, num_experts).
        num_experts: E >= 1.
        align: every expert group is padded with zero rows to a multiple of ``align`` (>= 1); the
            buffer has R = T * top_k + E * (align - 1) rows whatever the routing (a static shape).

    Returns: ``MoERouting(offsets, counts, dst, src)``. Slots of one expert keep token order.
    Raises: TypeError (not an integer tensor, non-int E/align), ValueError (rank, E/align < 1,
        indices out of range: checked in eager mode on CPU, where it costs no device sync).
    """
    check_tensor(expert_indices, "expert_indices")
    if expert_indices.dtype not in _INT:
        raise TypeError(f"expert_indices: expected dtype int32 or int64, got {_dt(expert_indices.dtype)}")
    if expert_indices.dim() != 2:
        raise ValueError(f"expert_indices: expected 2 dims (tokens T, top_k), got shape {tuple(expert_indices.shape)}")
    _check_int(num_experts, "num_experts", 1)
    _check_int(align, "align", 1)
    if eager_fast_path(expert_indices) and expert_indices.device.type == "cpu" and expert_indices.numel():
        lo, hi = int(expert_indices.min()), int(expert_indices.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"expert_indices: expected values in [0, {num_experts}) (num_experts), got [{lo}, {hi}]")
    # Replicated indices (DTensor): the same routing on every rank, computed on the local copy.
    dst, src, offsets, counts = _ref.routing_index(getattr(expert_indices, "_local_tensor", expert_indices),
                                                   num_experts, align)
    return MoERouting(offsets, counts, dst, src)


# ----------------------------------------------------------------------------- forward / backward functions
# The only functions that run kernels; the ops and the eager fast path call them.


def _permute(x, src, top_k, backend):
    return _impl(x.device, backend)[0](x, src, top_k)[0]


def _permute_backward(dxp, dst, backend):
    return _impl(dxp.device, backend)[1](dxp, dst, None)


def _unpermute(yp, dst, scores, backend):
    return _impl(yp.device, backend)[1](yp, dst, scores)


def _unpermute_backward(dout, yp, src, top_k, scores, need_dscores, backend):
    """(dyp (R, D) in yp.dtype, dscores (T, top_k) in scores.dtype or None)."""
    dot_with = yp if (need_dscores and scores is not None) else None
    dyp, dots = _impl(yp.device, backend)[0](dout, src, top_k, scores, dot_with)
    return dyp, (dots.to(scores.dtype) if dots is not None else None)


# ----------------------------------------------------------------------------- ops


@torch.library.custom_op("titan::moe_permute", mutates_args=())
def moe_permute_op(x: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """xp (R, D) in x.dtype: xp[r] = x[src[r] // top_k], zero where src[r] = -1. x (T, D); src (R,)
    and dst (T, top_k) int64 from ``moe_routing``. ``backend``: None = the automatic choice."""
    return _permute(x, src, dst.shape[1], backend)


@moe_permute_op.register_fake
def _(x, src, dst, backend=None):
    return x.new_empty((src.shape[0], x.shape[1]))


@torch.library.custom_op("titan::moe_permute_backward", mutates_args=())
def moe_permute_backward_op(dxp: torch.Tensor, dst: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """dx (T, D) in dxp.dtype: dx[t] = sum_j dxp[dst[t, j]] (float32 accumulation)."""
    return _permute_backward(dxp, dst, backend)


@moe_permute_backward_op.register_fake
def _(dxp, dst, backend=None):
    return dxp.new_empty((dst.shape[0], dxp.shape[1]))


@torch.library.custom_op("titan::moe_unpermute", mutates_args=())
def moe_unpermute_op(
    yp: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, scores: torch.Tensor | None, backend: str | None = None
) -> torch.Tensor:
    """out (T, D) in yp.dtype: out[t] = sum_j scores[t, j] * yp[dst[t, j]] (scores None: 1), float32
    accumulation. yp (R, D); src (R,), dst (T, top_k) int64; scores (T, top_k) float."""
    return _unpermute(yp, dst, scores, backend)


@moe_unpermute_op.register_fake
def _(yp, src, dst, scores, backend=None):
    return yp.new_empty((dst.shape[0], yp.shape[1]))


@torch.library.custom_op("titan::moe_unpermute_backward", mutates_args=())
def moe_unpermute_backward_op(
    dout: torch.Tensor, yp: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, scores: torch.Tensor | None,
    need_dscores: bool, backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dyp (R, D) in yp.dtype: dyp[dst[t, j]] = scores[t, j] * dout[t], padding rows 0;
    dscores (T, top_k) in scores.dtype: <dout[t], yp[dst[t, j]]>, or an empty (T, 0) tensor when not
    asked for or scores is None), in one pass."""
    dyp, ds = _unpermute_backward(dout, yp, src, dst.shape[1], scores, need_dscores, backend)
    if ds is None:
        ds = yp.new_empty((dst.shape[0], 0), dtype=scores.dtype if scores is not None else yp.dtype)
    return dyp, ds


@moe_unpermute_backward_op.register_fake
def _(dout, yp, src, dst, scores, need_dscores, backend=None):
    k = dst.shape[1] if (need_dscores and scores is not None) else 0
    return (yp.new_empty(yp.shape), yp.new_empty((dst.shape[0], k), dtype=scores.dtype if scores is not None else yp.dtype))


# ----------------------------------------------------------------------------- autograd (one definition)


def _setup_permute(ctx, inputs, output):
    x, src, dst, backend = inputs
    ctx.save_for_backward(dst)
    ctx.backend = backend if backend is not None else _choose(x.device.type, x.dtype == torch.float64)


def _grads_permute(ctx, dxp, fast: bool):
    refuse_create_graph("moe_permute", dxp)
    (dst,) = ctx.saved_tensors
    if fast:
        return _permute_backward(dxp, dst, ctx.backend)
    return torch.ops.titan.moe_permute_backward(dxp, dst, ctx.backend)


def _backward_permute(ctx, dxp):
    return _grads_permute(ctx, dxp, fast=False), None, None, None


def _setup_unpermute(ctx, inputs, output):
    yp, src, dst, scores, backend = inputs
    ctx.save_for_backward(yp, src, dst, scores)
    ctx.backend = backend if backend is not None else _choose(yp.device.type, yp.dtype == torch.float64)


def _grads_unpermute(ctx, dout, fast: bool):
    yp, src, dst, scores = ctx.saved_tensors
    refuse_create_graph("moe_unpermute", dout, yp, scores)
    need_ds = scores is not None and ctx.needs_input_grad[3]
    if fast:
        dyp, ds = _unpermute_backward(dout, yp, src, dst.shape[1], scores, need_ds, ctx.backend)
    else:
        dyp, ds = torch.ops.titan.moe_unpermute_backward(dout, yp, src, dst, scores, need_ds, ctx.backend)
    return (dyp if ctx.needs_input_grad[0] else None), (ds if need_ds else None)


def _backward_unpermute(ctx, dout):
    dyp, ds = _grads_unpermute(ctx, dout, fast=False)
    return dyp, None, None, ds, None


moe_permute_op.register_autograd(_backward_permute, setup_context=_setup_permute)
moe_unpermute_op.register_autograd(_backward_unpermute, setup_context=_setup_unpermute)
moe_permute_backward_op.register_autograd(refuse_double_backward("moe_permute_backward"), setup_context=no_setup)
moe_unpermute_backward_op.register_autograd(refuse_double_backward("moe_unpermute_backward"), setup_context=no_setup)


class _PermuteFn(torch.autograd.Function):
    """The eager fast path of titan::moe_permute: the same functions as the op's autograd."""

    @staticmethod
    def forward(ctx, x, src, dst, backend):
        xp = _permute(x, src, dst.shape[1], backend)
        _setup_permute(ctx, (x, src, dst, backend), xp)
        return xp

    @staticmethod
    def backward(ctx, dxp):
        return _grads_permute(ctx, dxp, fast=True), None, None, None


class _UnpermuteFn(torch.autograd.Function):
    """The eager fast path of titan::moe_unpermute: the same functions as the op's autograd."""

    @staticmethod
    def forward(ctx, yp, src, dst, scores, backend):
        out = _unpermute(yp, dst, scores, backend)
        _setup_unpermute(ctx, (yp, src, dst, scores, backend), out)
        return out

    @staticmethod
    def backward(ctx, dout):
        dyp, ds = _grads_unpermute(ctx, dout, fast=True)
        return dyp, None, None, ds, None


# ----------------------------------------------------------------------------- public API


def moe_permute(
    x: torch.Tensor, expert_indices: torch.Tensor, num_experts: int, align: int = 1
) -> tuple[torch.Tensor, MoERouting]:
    """Scatter tokens to expert order for a grouped GEMM: one fused copy, no loop over experts.

    Args:
        x: (T, D) float32/bfloat16/float16/float64 tokens, any strides.
        expert_indices: (T, top_k) int32/int64 experts chosen for each token (the router's top-k).
        num_experts: E >= 1.
        align: pad every expert's group with zero rows to a multiple of ``align`` (e.g. a kernel's
            tile; 1: no padding).

    Returns:
        (xp, routing): xp (R, D) in x.dtype, R = T * top_k + E * (align - 1): row dst[t, j] holds
        x[t], groups in expert order (slots of one expert in token order), padding rows and rows
        past the last group zero; routing the ``MoERouting`` (offsets for ``grouped_mm``, counts,
        dst, src) that ``moe_unpermute`` takes.

    Raises:
        TypeError / ValueError as ``moe_routing``, and for x not a 2-D float tensor, a token count
        other than x's, mixed devices.

    Gradient: dx[t] = sum_j dxp[dst[t, j]]. Source: token-choice top-k routing (Shazeer et al.
    2017, "Outrageously Large Neural Networks"), the permute/pad layout of torchtitan's MoE.
    """
    check_float(x, "x", _FLOAT)
    if x.dim() != 2:
        raise ValueError(f"x: expected 2 dims (tokens T, dim), got shape {tuple(x.shape)}")
    check_tensor(expert_indices, "expert_indices")
    if expert_indices.dim() == 2 and expert_indices.shape[0] != x.shape[0]:
        raise ValueError(f"expert_indices: expected shape ({x.shape[0]}, top_k) (T = x.shape[0]), "
                         f"got {tuple(expert_indices.shape)}")
    check_same_device({"x": x, "expert_indices": expert_indices})
    routing = moe_routing(expert_indices, num_experts, align)
    backend = _choose(x.device.type, x.dtype == torch.float64)
    if eager_fast_path(x):
        if needs_grad(x):
            return _PermuteFn.apply(x, routing.src, routing.dst, backend), routing
        return _permute(x, routing.src, routing.dst.shape[1], backend), routing
    src, dst = routing.src, routing.dst
    if torch.distributed.is_available():  # a DTensor x (split on dim): the indices are replicated
        src, dst = replicate_like(x, src), replicate_like(x, dst)
    return torch.ops.titan.moe_permute(x, src, dst, backend), routing


def moe_unpermute(yp: torch.Tensor, routing: MoERouting, scores: torch.Tensor | None = None) -> torch.Tensor:
    """Gather expert outputs back to token order, weighted by the router scores, in one fused pass.

    Args:
        yp: (R, D) float expert outputs in the order of ``moe_permute``'s buffer (padding rows ignored).
        routing: the ``MoERouting`` of that ``moe_permute`` call.
        scores: (T, top_k) float router weights of each token's choices (any float dtype), or None
            for a plain sum.

    Returns:
        (T, D) in yp.dtype: out[t] = sum_j scores[t, j] * yp[dst[t, j]], accumulated in float32.

    Raises:
        TypeError: yp/scores not float tensors, routing not a MoERouting.
        ValueError: yp rows != routing's buffer rows, scores shape != (T, top_k), mixed devices.

    Gradients: dyp[dst[t, j]] = scores[t, j] * dout[t] (padding rows 0); dscores[t, j] =
    <dout[t], yp[dst[t, j]]>. Source: the combine step of top-k MoE (Shazeer et al. 2017, eq. 1).
    """
    check_float(yp, "yp", _FLOAT)
    if not isinstance(routing, MoERouting):
        raise TypeError(f"routing: expected the MoERouting returned by moe_permute, got {type(routing).__name__}")
    if yp.dim() != 2 or yp.shape[0] != routing.src.shape[0]:
        raise ValueError(f"yp: expected shape ({routing.src.shape[0]}, dim) (the permuted buffer's rows), "
                         f"got {tuple(yp.shape)}")
    if scores is not None:
        check_float(scores, "scores", _FLOAT)
        if tuple(scores.shape) != tuple(routing.dst.shape):
            raise ValueError(f"scores: expected shape {tuple(routing.dst.shape)} (T, top_k), got {tuple(scores.shape)}")
    check_same_device({"yp": yp, "dst": routing.dst, "scores": scores})
    backend = _choose(yp.device.type, yp.dtype == torch.float64)
    if eager_fast_path(yp, scores):
        if needs_grad(yp, scores):
            return _UnpermuteFn.apply(yp, routing.src, routing.dst, scores, backend)
        return _unpermute(yp, routing.dst, scores, backend)
    src, dst = routing.src, routing.dst
    if torch.distributed.is_available():
        src, dst = replicate_like(yp, src), replicate_like(yp, dst)
        scores = replicate_like(yp, scores) if scores is not None else None
    return torch.ops.titan.moe_unpermute(yp, src, dst, scores, backend)
