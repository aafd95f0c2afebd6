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
automatic choice on CUDA). Built by the op scaffold (``titan_kernels.ops._scaffold``): the forward's
request is handed to the backward; the eager fast path and the ops' autograd run the same functions.
Double backward is refused with a RuntimeError naming the op.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from titan_kernels.ops._common import (
    check_float, check_same_device, check_tensor, dtype_name, eager_fast_path, refuse_create_graph, replicate_like,
)
from titan_kernels.ops._scaffold import Op
from titan_kernels.reference import moe as _ref

OP = "moe_permute"
moe_permute_def = Op(OP)
moe_unpermute_def = Op("moe_unpermute", impls=OP)


class MoEKernels(NamedTuple):
    """The two row movers of one implementation (contracts: ``reference.moe.permute_rows`` /
    ``combine_rows``): permute (and the unpermute's backward) and combine (and the permute's backward)."""

    permute_rows: Callable
    combine_rows: Callable


def _float64_on_reference(device, float64: bool) -> str | None:
    # The automatic choice's case key is whether the rows are float64: the kernels accumulate in float32.
    return "float64 runs on the reference (the kernels accumulate in float32)" if float64 else None


moe_permute_def.register("reference", MoEKernels(_ref.permute_rows, _ref.combine_rows))
# aten's CPU index kernels
moe_permute_def.register("cpu", MoEKernels(_ref.permute_rows, _ref.combine_rows), auto=_float64_on_reference)
moe_permute_def.register_triton("titan_kernels.triton.moe_permute", "permute_rows", "combine_rows", kind=MoEKernels,
                                auto=_float64_on_reference)

_INT = (torch.int32, torch.int64)
_FLOAT = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


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
        raise TypeError(f"expert_indices: expected dtype int32 or int64, got {dtype_name(expert_indices.dtype)}")
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


# ----------------------------------------------------------------------------- the ops


def _kernels(t: torch.Tensor, backend: str | None) -> MoEKernels:
    # The case key: whether the rows are float64 (the kernels accumulate in float32).
    return moe_permute_def.kernels(t.device, backend, t.dtype == torch.float64)


def permute_forward(x: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """xp (R, D) in x.dtype: xp[r] = x[src[r] // top_k], zero where src[r] = -1. x (T, D); src (R,)
    and dst (T, top_k) int64 from ``moe_routing``. ``backend``: the request (None: the one in force)."""
    return _kernels(x, backend).permute_rows(x, src, dst.shape[1])[0]


def permute_backward(dxp: torch.Tensor, dst: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """dx (T, D) in dxp.dtype: dx[t] = sum_j dxp[dst[t, j]] (float32 accumulation)."""
    return _kernels(dxp, backend).combine_rows(dxp, dst, None)


def unpermute_forward(yp: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, scores: torch.Tensor | None,
                      backend: str | None = None) -> torch.Tensor:
    """out (T, D) in yp.dtype: out[t] = sum_j scores[t, j] * yp[dst[t, j]] (scores None: 1), float32
    accumulation. yp (R, D); src (R,), dst (T, top_k) int64; scores (T, top_k) float."""
    return _kernels(yp, backend).combine_rows(yp, dst, scores)


def unpermute_backward(dout: torch.Tensor, yp: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                       scores: torch.Tensor | None, need_dscores: bool,
                       backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dyp (R, D) in yp.dtype: dyp[dst[t, j]] = scores[t, j] * dout[t], padding rows 0;
    dscores (T, top_k) in scores.dtype: <dout[t], yp[dst[t, j]]>, or an empty (T, 0) tensor when not
    asked for or scores is None), in one pass."""
    dot_with = yp if (need_dscores and scores is not None) else None
    dyp, dots = _kernels(yp, backend).permute_rows(dout, src, dst.shape[1], scores, dot_with)
    if dots is None:
        return dyp, yp.new_empty((dst.shape[0], 0), dtype=scores.dtype if scores is not None else yp.dtype)
    return dyp, dots.to(scores.dtype)


def _unpermute_backward_fake(dout, yp, src, dst, scores, need_dscores, backend=None):
    k = dst.shape[1] if (need_dscores and scores is not None) else 0
    return (yp.new_empty(yp.shape), yp.new_empty((dst.shape[0], k), dtype=scores.dtype if scores is not None else yp.dtype))


def _permute_grads(ctx, dxp):
    refuse_create_graph("moe_permute", dxp)
    (dst,) = ctx.saved_tensors
    return moe_permute_def.backward(dxp, dst, ctx.backend), None, None


def _unpermute_grads(ctx, dout):
    yp, src, dst, scores = ctx.saved_tensors
    refuse_create_graph("moe_unpermute", dout, yp, scores)
    need_ds = scores is not None and ctx.needs_input_grad[3]
    dyp, ds = moe_unpermute_def.backward(dout, yp, src, dst, scores, need_ds, ctx.backend)
    return (dyp if ctx.needs_input_grad[0] else None), None, None, (ds if need_ds else None)


# ----------------------------------------------------------------------------- sharding rules
# Rows move whole: tokens split on the hidden dim (dim 1) permute and combine locally with the routing
# indices (and scores) replicated. Both are linear in the moved rows: a Partial buffer (after a rowwise
# w2) combines to a Partial result, reduced after the (smaller) combine, and the Partial gradient of a
# colwise GEMM's input goes back through the permute still Partial. The unpermute backward on split
# columns (or of a Partial buffer) gives each rank a share of the scores' gradient: Partial.


def _rows(n_index: int) -> list:
    """Rules of a row-moving op: its first tensor (and output) any of Replicate, Shard(1), Partial,
    then ``n_index`` index tensors replicated."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    return [([p], [p, *[Replicate()] * n_index]) for p in (Replicate(), Shard(1), Partial())]


def _flags(rules: list, *rest) -> list:
    """``rules`` with the placements ``rest`` appended to each one's inputs (None: not a tensor)."""
    return [(outs, [*ins, *rest]) for outs, ins in rules]


def _rep_or_none(t):
    from torch.distributed.tensor import Replicate

    return Replicate() if t is not None else None


def _unpermute_backward_sharding(dout, yp, src, dst, scores, need_dscores, backend=None):
    from torch.distributed.tensor import Partial, Replicate, Shard

    rep, s = Replicate(), _rep_or_none(scores)
    return _flags([
        ([rep, rep], [rep, rep, rep, rep, s]),
        ([Shard(1), Partial()], [Shard(1), Shard(1), rep, rep, s]),
        # A Partial buffer (the forward combined it unreduced): dyp = scores * dout needs only dout,
        # and <dout, sum of shares> is the sum of the per-rank dots: dscores Partial.
        ([rep, Partial()], [rep, Partial(), rep, rep, s]),
    ], None, None)


moe_permute_def.define(
    permute_forward, lambda x, src, dst, backend=None: x.new_empty((src.shape[0], x.shape[1])),
    setup=lambda ctx, inputs, output: ctx.save_for_backward(inputs[2]), grads=_permute_grads,
    backward=permute_backward, backward_fake=lambda dxp, dst, backend=None: dxp.new_empty((dst.shape[0], dxp.shape[1])),
    sharding=lambda x, src, dst, backend=None: _flags(_rows(2), None),
    backward_sharding=lambda dxp, dst, backend=None: _flags(_rows(1), None))
moe_unpermute_def.define(
    unpermute_forward, lambda yp, src, dst, scores, backend=None: yp.new_empty((dst.shape[0], yp.shape[1])),
    setup=lambda ctx, inputs, output: ctx.save_for_backward(*inputs[:4]), grads=_unpermute_grads,
    backward=unpermute_backward, backward_fake=_unpermute_backward_fake,
    sharding=lambda yp, src, dst, scores, backend=None: _flags(_rows(2), _rep_or_none(scores), None),
    backward_sharding=_unpermute_backward_sharding)


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
    src, dst = routing.src, routing.dst
    if not eager_fast_path(x) and torch.distributed.is_available():  # a DTensor x: the indices are replicated
        src, dst = replicate_like(x, src), replicate_like(x, dst)
    return moe_permute_def(x, src, dst), routing


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
    src, dst = routing.src, routing.dst
    if not eager_fast_path(yp, scores) and torch.distributed.is_available():
        src, dst = replicate_like(yp, src), replicate_like(yp, dst)
        scores = replicate_like(yp, scores) if scores is not None else None
    return moe_unpermute_def(yp, src, dst, scores)
