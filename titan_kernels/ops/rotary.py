"""Rotary position embedding ops: ``torch.ops.titan.rotary`` and its backward
``torch.ops.titan.rotary_backward``, plus the cos/sin table builder ``rope_cos_sin``.

Math: Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding", eq. 34 (see
``titan_kernels.reference.rotary``); the tables and their Llama 3.1 / YaRN frequency scaling in
``titan_kernels.ops.rope_tables``.

Both ops are built by the op scaffold (``titan_kernels.ops._scaffold``): custom ops with fakes, one
autograd definition for the op path and the eager fast path, the backend request handed from the
forward to the backward, and the sharding rules below. Double backward is implemented, to any order:
rotary is the linear map R(theta) of q and k, its backward is R(-theta) and the backward's adjoint is
R(theta) again.
"""
from __future__ import annotations

import torch

from titan_kernels.ops._common import check_float, check_same_device, check_tensor
from titan_kernels.ops._scaffold import Op
from titan_kernels.ops.rope_tables import rope_cos_sin  # noqa: F401  (re-exported: the tables' builder)
from titan_kernels.reference import rotary as _ref

OP = "rotary"
rotary_def = Op(OP)
# Every implementation: fwd(q, k, cos, sin, position_ids, interleaved) -> (q_out, k_out) = R(theta)(q, k);
# bwd(dq, dk, cos, sin, position_ids, interleaved) -> R(-theta)(dq, dk).
rotary_def.register("reference", (_ref.rotary_fwd, _ref.rotary_bwd))
rotary_def.register_triton("titan_kernels.triton.rotary", "rotary_fwd", "rotary_bwd")


def _native_fwd(q, k, cos, sin, position_ids, interleaved):
    return tuple(torch.ops.titan.rotary_fwd_native(q, k, cos, sin, position_ids, interleaved))


def _native_bwd(dq, dk, cos, sin, position_ids, interleaved):
    return tuple(torch.ops.titan.rotary_bwd_native(dq, dk, cos, sin, position_ids, interleaved))


rotary_def.register_native((_native_fwd, _native_bwd))  # available where the csrc extension is built

POSITION_DTYPES = (torch.int32, torch.int64)

# ----------------------------------------------------------------------------- validation


def _validate(q, k, cos, sin, position_ids, interleaved) -> None:
    """Shape, dtype and device checks (static: safe under torch.compile)."""
    check_float(q, "q")
    check_tensor(k, "k")
    check_tensor(cos, "cos")
    check_tensor(sin, "sin")
    if q.dim() != 4:
        raise ValueError(f"q: expected 4 dims (batch, seq, n_heads, head_dim), got shape {tuple(q.shape)}")
    if k.dim() != 4:
        raise ValueError(f"k: expected 4 dims (batch, seq, n_kv_heads, head_dim), got shape {tuple(k.shape)}")
    if k.dtype != q.dtype:
        raise TypeError(f"k: expected dtype {q.dtype} (the dtype of q), got {k.dtype}")
    batch, seq, n_heads, head_dim = q.shape
    for i, name in ((0, "batch"), (1, "seq"), (3, "head_dim")):
        if k.shape[i] != q.shape[i]:
            raise ValueError(
                f"k: expected {name} {q.shape[i]} (dim {i} of q, shape {tuple(q.shape)}), got shape {tuple(k.shape)}"
            )
    n_kv_heads = k.shape[2]
    if n_kv_heads < 1 or n_heads % n_kv_heads != 0:
        raise ValueError(
            f"k: expected n_kv_heads (dim 2) >= 1 dividing n_heads = {n_heads} (grouped-query attention), "
            f"got n_kv_heads = {n_kv_heads}"
        )
    for t, name in ((cos, "cos"), (sin, "sin")):
        if t.dtype != torch.float32:
            raise TypeError(f"{name}: expected dtype float32 (see rope_cos_sin), got {t.dtype}")
        if t.dim() != 2:
            raise ValueError(f"{name}: expected 2 dims (max_positions, rotary_dim // 2), got shape {tuple(t.shape)}")
        if t.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"{name}: no gradient flows into the rotary tables; pass a tensor with requires_grad=False")
    if sin.shape != cos.shape:
        raise ValueError(f"sin: expected shape {tuple(cos.shape)} (the shape of cos), got {tuple(sin.shape)}")
    half = cos.shape[1]
    if half < 1 or 2 * half > head_dim:
        raise ValueError(
            f"cos: expected rotary_dim // 2 columns with 1 <= rotary_dim // 2 <= head_dim // 2 = {head_dim // 2}, "
            f"got shape {tuple(cos.shape)}"
        )
    max_positions = cos.shape[0]
    if position_ids is None:
        if seq > max_positions:
            raise ValueError(
                f"q: seq = {seq} is longer than cos/sin (max_positions = {max_positions}); build larger tables "
                f"or pass position_ids"
            )
    else:
        check_tensor(position_ids, "position_ids")
        if position_ids.dtype not in POSITION_DTYPES:
            raise TypeError(f"position_ids: expected dtype int32 or int64, got {position_ids.dtype}")
        if tuple(position_ids.shape) not in ((seq,), (batch, seq)):
            raise ValueError(
                f"position_ids: expected shape ({seq},) or ({batch}, {seq}) (seq or batch, seq of q), "
                f"got {tuple(position_ids.shape)}"
            )
    if not isinstance(interleaved, bool):
        raise TypeError(f"interleaved: expected a bool, got {type(interleaved).__name__}")
    check_same_device({"q": q, "k": k, "cos": cos, "sin": sin, "position_ids": position_ids})


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # DTensor: each rank checks its own shard, no collective
    return to_local() if callable(to_local) else t


def _check_position_values(position_ids: torch.Tensor | None, max_positions: int) -> None:
    """Raise for positions outside [0, max_positions) in eager mode.

    Reading the values costs one host-device sync. It is skipped where values are not available or
    a sync is not allowed (torch.compile, fake/proxy tracing, CUDA graph capture); there the kernels
    mask out-of-range rows, which come out NaN instead of reading out of bounds.
    """
    if position_ids is None or torch.compiler.is_compiling():
        return
    p = _local(position_ids)
    if type(p) is not torch.Tensor or p.numel() == 0:
        return
    for key in (torch._C._TorchDispatchModeKey.FAKE, torch._C._TorchDispatchModeKey.PROXY):
        if torch._C._get_dispatch_mode(key) is not None:
            return
    if p.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    lo, hi = (int(v) for v in torch.aminmax(p))
    if lo < 0 or hi >= max_positions:
        raise ValueError(
            f"position_ids: expected values in [0, {max_positions}) (the rows of cos/sin), got min {lo}, max {hi}"
        )


# ----------------------------------------------------------------------------- the ops


def forward(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            position_ids: torch.Tensor | None, interleaved: bool,
            backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q (batch, seq, n_heads, head_dim) and k (batch, seq, n_kv_heads, head_dim)
    with cos/sin (max_positions, R) float32 at position_ids (None, (seq,) or (batch, seq) int).
    Returns new contiguous (q_out, k_out) in the input dtype; see ``apply_rotary_emb``. ``backend``:
    the request (None: the one in force)."""
    return rotary_def.kernels(q.device, backend).forward(q, k, cos, sin, position_ids, interleaved)


def backward(dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             position_ids: torch.Tensor | None, interleaved: bool,
             backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of titan::rotary with respect to q and k: (dq, dk) rotated by -theta. Shapes and
    dtypes as titan::rotary; returns new contiguous tensors. ``backend``: the forward's request."""
    return rotary_def.kernels(dq.device, backend).backward(dq, dk, cos, sin, position_ids, interleaved)


def _fake(a, b, *rest):
    return torch.empty(a.shape, dtype=a.dtype, device=a.device), torch.empty(b.shape, dtype=b.dtype, device=b.device)


def _save(ctx, inputs, output) -> None:
    _, _, cos, sin, position_ids, interleaved, _ = inputs
    ctx.save_for_backward(cos, sin, position_ids)
    ctx.interleaved = interleaved


def _grads(ctx, da, db):
    """The adjoint of R(theta) (titan::rotary): R(-theta), differentiable."""
    cos, sin, position_ids = ctx.saved_tensors
    return (*rotary_def.backward(da, db, cos, sin, position_ids, ctx.interleaved, ctx.backend), None, None, None, None)


def _grads_of_backward(ctx, da, db):
    """The adjoint of R(-theta) (titan::rotary_backward): R(theta) again (double backward, any order)."""
    cos, sin, position_ids = ctx.saved_tensors
    return (*rotary_def.call(da, db, cos, sin, position_ids, ctx.interleaved, ctx.backend), None, None, None, None)


def _sharding(q, k, cos, sin, position_ids, interleaved, backend=None):
    """Every head of every token is rotated on its own, by angles that depend only on the token's
    position: q/k split on batch (dim 0) or heads (dim 2) run locally with cos/sin replicated and
    2-D position_ids split on batch like q. k may stay replicated while q is split on heads (fewer kv
    heads than ranks). seq (dim 1) is local only with explicit position_ids split the same way
    (without them each shard would count positions from 0). head_dim (dim 3) is never split: a pair
    may straddle ranks, so DTensor gathers it first. DTensor requires cos/sin (and position_ids) to
    be DTensors too (e.g. Replicate), or the call to run under ``implicit_replication()``. The
    backward has the same signature and the same rules."""
    from torch.distributed.tensor import Replicate, Shard

    rep, flags = Replicate(), [None, None]
    pos = rep if position_ids is not None else None
    rules = [
        ([rep, rep], [rep, rep, rep, rep, pos, *flags]),
        ([Shard(2), Shard(2)], [Shard(2), Shard(2), rep, rep, pos, *flags]),
        ([Shard(2), rep], [Shard(2), rep, rep, rep, pos, *flags]),
    ]
    pos_batch = None if position_ids is None else (Shard(0) if position_ids.ndim == 2 else rep)
    rules.append(([Shard(0), Shard(0)], [Shard(0), Shard(0), rep, rep, pos_batch, *flags]))
    if position_ids is not None:
        rules.append(([Shard(1), Shard(1)], [Shard(1), Shard(1), rep, rep, Shard(position_ids.ndim - 1), *flags]))
    return rules


rotary_def.define(forward, _fake, setup=_save, grads=_grads, backward=backward, backward_fake=_fake,
                  backward_setup=_save, backward_grads=_grads_of_backward, sharding=_sharding,
                  backward_sharding=_sharding)


# ----------------------------------------------------------------------------- public API


def apply_rotary_emb(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool = False,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of queries and keys, fused: one kernel for q and k.

    Each pair (x1, x2) of the first ``rotary_dim`` dims of a head is rotated by the angle of its
    token's position: ``(x1 cos - x2 sin, x2 cos + x1 sin)``; dims past rotary_dim are copied.

    Args:
        q: (batch, seq, n_heads, head_dim), float32 / bfloat16 / float16, any strides (e.g. a
            slice of a fused qkv projection); zero-size allowed.
        k: (batch, seq, n_kv_heads, head_dim), same dtype and device; n_heads % n_kv_heads == 0.
        cos, sin: (max_positions, rotary_dim // 2) float32 tables, ``rotary_dim <= head_dim``
            (see ``rope_cos_sin``). No gradient flows into them.
        interleaved: pairs are (2i, 2i+1), the complex-number layout of Meta's llama and
            torchtitan (True), or (i, i + rotary_dim/2), the rotate-half layout of Hugging Face
            (False). Checkpoints convert between them by permuting the rows of wq/wk.
        position_ids: None (positions 0..seq-1), or int32/int64 (seq,) or (batch, seq): each
            token's row of cos/sin (packed documents, context-parallel shards, offsets).

    Returns:
        (q_out, k_out): new contiguous tensors of the input shapes and dtype (the inputs are not
        modified); the math runs in float32.

    Raises:
        TypeError: q not float32/bf16/fp16, k of another dtype, cos/sin not float32, position_ids
            not int32/int64, interleaved not a bool.
        ValueError: q or k not 4-D, k with another batch/seq/head_dim, n_heads not a multiple of
            n_kv_heads, cos/sin shapes that do not fit head_dim, seq longer than the tables without
            position_ids, position_ids of a wrong shape or (eager mode) outside [0, max_positions),
            cos/sin requiring grad, mixed devices.
        RuntimeError: the requested backend cannot run on q's device.

    In eager mode the range check of position_ids reads their min/max (one host sync). Under
    torch.compile it is skipped; an out-of-range position then yields NaN in its rotated dims and
    is never read out of bounds.

    Source: Su et al. 2021 (RoFormer), eq. 34.
    """
    _validate(q, k, cos, sin, position_ids, interleaved)
    _check_position_values(position_ids, cos.shape[0])
    return rotary_def(q, k, cos, sin, position_ids, interleaved)
