"""The attention ops ``torch.ops.titan.flash_attn`` / ``titan::flash_attn_backward``, built by the op
scaffold (``titan_kernels.ops._scaffold``), and ``call``, which the public functions (``api.py``) run.

Math: softmax(softcap(c Q K^T) + mask) V with optional sinks (Vaswani et al. 2017, eq. 1) computed as
FlashAttention does (Dao et al. 2022; Dao 2023), with the float32 log-sum-exp (LSE) of each query
row; see ``titan_kernels.reference.attention``, ``titan_kernels.attention_mask`` and ``sinks.py``.

The op schemas are flat; the non-tensor arguments travel inside as one frozen ``AttentionArgs``
record (``AttentionArgs.op_args`` / ``from_op``, cached). Every backend implements ``fwd(q, k, v,
cu_q, cu_k, a) -> (out, lse)`` and ``bwd(dout, q, k, v, out, lse, dlse, cu_q, cu_k, a) -> (dq, dk,
dv)``; sinks are applied here, to any backend's (out, lse) (``sinks.py``), so no backend sees them.

The scaffold gives one autograd definition for the eager fast path and the op path, and hands the
forward's request (the ``backend=`` argument, else ``capture_request``) to the backward, which
resolves the same request. When the backward carries a case the forward's backend cannot take (an
LSE gradient; FlashAttention-3's backward with v's head_dim different from q/k's): an explicitly
requested backend raises RuntimeError; an automatic choice moves to the first backend of the order
that takes it (every backend shares the out/lse conventions, so any backward is valid with any
forward's out and lse). An automatically chosen backend that raises at run time (a kernel or
library that fails on this device) is recorded, with a warning, and the next one runs.

Conventions every backend follows: the mask of ``titan_kernels.attention_mask`` (bottom-right
aligned); a row with no visible key has out = 0 and lse = -inf (with sinks: the sink's logit); out
and lse are fresh contiguous tensors.
"""
from __future__ import annotations

import functools

import torch

from titan_kernels import backend as _backend
from titan_kernels.attention_mask import AttentionArgs
from titan_kernels.backend import AUTO, requested_backend
from titan_kernels.backend.registry import EPOCH as _EPOCH
from titan_kernels.ops._common import FAST, eager_route_untraced, needs_grad
from titan_kernels.ops._scaffold import below_views, unwrap_dead
from titan_kernels.ops.attention import dispatch as _d
from titan_kernels.ops.attention.sinks import apply_attention_sinks, attention_sinks_grad

flash_attn_def = _d.flash_attn_def
OP = _d.OP
_record = functools.lru_cache(maxsize=1024)(AttentionArgs.from_op)  # frozen: one record per distinct call

# ----------------------------------------------------------------------------- run one backend


def _trivial(q, k, cu_q) -> bool:
    """No work: no query, no key or no document (every backend's answer is out = 0, lse = -inf), or
    varlen on meta tensors (shapes only: the document offsets have no values)."""
    if cu_q is not None:
        return q.shape[0] == 0 or k.shape[0] == 0 or cu_q.shape[0] <= 1 or q.is_meta
    return q.numel() == 0 or k.shape[1] == 0


def _out_shape(q, v) -> tuple:
    """out has q's shape with v's head_dim (which may differ from q/k's)."""
    return (*q.shape[:-1], v.shape[-1])


def _lse_shape(q, cu_q) -> tuple:
    return (q.shape[1], q.shape[0]) if cu_q is not None else (q.shape[0], q.shape[2], q.shape[1])


def _no_sinks_grad(q) -> torch.Tensor:
    return torch.empty((0,), dtype=torch.float32, device=q.device)


def _run(request, q, k, v, cu_q, a, backward, has_dlse, call):
    """``call(kernels)`` on the implementation ``titan_kernels.backend`` chooses for this case (cached
    per key). An automatically chosen backend that raises is recorded, with a warning, and the next
    one runs; an explicit request, the reference or memory re-raise."""
    key = _d.case_key(q, k, v, cu_q, a, backward, has_dlse)  # key[0] is q.device
    while True:
        choice = _backend.choose(_d.OP, key[0], key, backend=request,
                                 case=lambda: _d.make_case(q, k, v, cu_q, a, backward, has_dlse))
        try:
            return call(choice.kernels)
        except (RuntimeError, NotImplementedError) as e:
            _failed(choice, key, e)


def _failed(choice, key, error) -> None:
    """Re-raise what an explicit request, the reference or memory raised; else record the failure
    (the next automatic choice passes the backend over)."""
    if isinstance(error, torch.OutOfMemoryError) or choice.explicit or choice.backend == "reference":
        raise error
    _backend.mark_failed(_d.OP, choice, key[0], key, error)


def run_forward(request, q, k, v, cu_q, cu_k, sinks, a: AttentionArgs):
    """(out, lse) of one call on the chosen backend, sinks applied; out contiguous, lse in the
    kernel's layout (a planned call: ``_planned_run``)."""
    if (q.numel() == 0 or k.shape[1] == 0) if cu_q is None else _trivial(q, k, cu_q):
        out = torch.zeros(_out_shape(q, v), dtype=q.dtype, device=q.device)
        lse = torch.full(_lse_shape(q, cu_q), float("-inf"), dtype=torch.float32, device=q.device)
    else:
        # The first try inline, without _run's closures: most of a small call's overhead otherwise.
        key = _d.case_key(q, k, v, cu_q, a)
        choice = _backend.choose(_d.OP, key[0], key, backend=request, case=lambda: _d.make_case(q, k, v, cu_q, a))
        try:
            out, lse = choice.kernels.forward(q, k, v, cu_q, cu_k, a)
        except (RuntimeError, NotImplementedError) as e:
            _failed(choice, key, e)
            out, lse = _run(request, q, k, v, cu_q, a, False, False, lambda kern: kern.forward(q, k, v, cu_q, cu_k, a))
        out = out.contiguous()
    if sinks is not None:
        out, lse = apply_attention_sinks(out, lse, sinks, cu_q is not None)
    return out, lse


def run_backward(request, dout, q, k, v, out, lse, dlse, cu_q, cu_k, sinks, a: AttentionArgs):
    """(dq, dk, dv, dsinks) from the forward's out and lse (with sinks: out' and lse', which every
    backend's backward differentiates exactly, see sinks.py); dsinks is empty without sinks."""
    if _trivial(q, k, cu_q):
        grads = tuple(torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    else:
        def call(kern):
            g = kern.backward(dout, q, k, v, out, lse.contiguous(), dlse, cu_q, cu_k, a)
            return tuple(t.contiguous() for t in g)  # the fake implementation's strides

        grads = _run(request, q, k, v, cu_q, a, True, dlse is not None, call)
    ds = _no_sinks_grad(q) if sinks is None else attention_sinks_grad(dout, out, lse, dlse, sinks, cu_q is not None)
    return (*grads, ds)


# ----------------------------------------------------------------------------- the ops


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None, sinks: torch.Tensor | None, max_seqlen_q: int, max_seqlen_k: int,
    softmax_scale: float, window_left: int, window_right: int, softcap: float, chunk_size: int, return_lse: bool,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward -> (out, lse). Dense when cu_seqlens_q is None: q (b, s_q, h, d),
    k (b, s_k, h_kv, d), v (b, s_k, h_kv, d_v), out (b, s_q, h, d_v), lse (b, h, s_q); varlen:
    q (total_q, h, d), out (total_q, h, d_v), lse (h, total_q) and max_seqlen_* bound the document
    lengths (ignored when dense). sinks: None or (h,) logits. window_left / window_right (-1 =
    unbounded; right 0 = causal), softcap (0 = off), chunk_size (0 = off): ``AttentionArgs``.
    ``backend``: the request (None: the one in force). ``return_lse`` says whether the caller sees
    the LSE (only then is its gradient used). out is in q.dtype, lse float32 (with sinks, the sink
    included); both contiguous."""
    a = _record(max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap, chunk_size, return_lse)
    out, lse = run_forward(backend, q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, a)
    return out, lse.contiguous()  # the fake's strides


def _fast_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, max_seqlen_q, max_seqlen_k, softmax_scale, window_left,
                  window_right, softcap, chunk_size, return_lse, backend=None):
    # The eager fast path: lse stays in the kernel's layout unless the caller sees it (a copy of it is
    # a tenth of a small call); the backward makes it contiguous.
    a = _record(max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap, chunk_size, return_lse)
    out, lse = run_forward(backend, q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, a)
    return out, (lse.contiguous() if return_lse else lse)


def _planned_run(plan, q, k, v, backend, request):
    """(out, lse) of a planned call (``call_planned``: dense, no sinks; out contiguous, lse in the
    kernel's layout), where no gradient is recorded (under ``below_views``): ``run_forward``'s first try inline, with the choice kept in the plan while the
    registry's cached choices hold (``EPOCH``) and the request is the same: ``backend`` (what
    ``choose`` gets) and, where it is None, ``request`` (the context's, ``requested_backend``)."""
    a, key, memo = plan
    m = memo[0]
    if m is not None and m[0] == _EPOCH[0] and m[1] == backend and m[2] == request:
        choice = m[3]
    else:
        epoch = _EPOCH[0]  # (read first: a choice made while the cache is cleared is not kept as valid)
        choice = _backend.choose(OP, key[0], key, backend=backend, case=lambda: _d.make_case(q, k, v, None, a))
        memo[0] = (epoch, backend, request, choice)
    try:
        out, lse = choice.kernels.forward(q, k, v, None, None, a)
    except (RuntimeError, NotImplementedError) as e:
        _failed(choice, key, e)
        out, lse = _run(backend, q, k, v, None, a, False, False, lambda kern: kern.forward(q, k, v, None, None, a))
    return out.contiguous(), lse


def _planned_forward(plan, args):
    # ``_fast_forward`` of a planned call (the scaffold's ``planned_forward``): args the op's
    # arguments, the request last. The caller sees out alone unless it asked for the LSE.
    out, lse = _planned_run(plan, args[0], args[1], args[2], args[-1], None)
    if plan[0].return_lse:
        lse = lse.contiguous()
        return (out, lse), (out, lse)
    return (out, lse), out


def _fake(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, *args):
    return (torch.empty(_out_shape(q, v), dtype=q.dtype, device=q.device),
            q.new_empty(_lse_shape(q, cu_seqlens_q), dtype=torch.float32))


def backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    dlse: torch.Tensor | None, cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None,
    sinks: torch.Tensor | None, max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, window_left: int,
    window_right: int, softcap: float, chunk_size: int, return_lse: bool, backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of flash_attn from its out and lse: (dq, dk, dv, dsinks), fresh contiguous tensors;
    dq, dk, dv shaped and typed like (q, k, v), accumulated in float32; dsinks like sinks, or an
    empty float32 tensor without sinks. dout is shaped like out (any strides); dlse, shaped like lse
    or None, is a gradient for the LSE output. ``backend``: the forward's request."""
    a = _record(max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap, chunk_size, return_lse)
    # (autograd checks the gradients it passes; a direct call of the op or of its grad_fn may not)
    for name, got, want in (("dout", dout, out), ("dlse", dlse, lse)):
        if got is not None and got.shape != want.shape:
            raise ValueError(f"titan::flash_attn_backward: {name}: expected shape {tuple(want.shape)} (the forward's "
                             f"{'out' if name == 'dout' else 'lse'}), got {tuple(got.shape)}")
    return run_backward(backend, dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, sinks, a)


def _backward_fake(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, sinks, *args):
    ds = _no_sinks_grad(q) if sinks is None else torch.empty(sinks.shape, dtype=sinks.dtype, device=sinks.device)
    return (*(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v)), ds)


def _save(ctx, inputs, output):
    # (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sinks)
    ctx.save_for_backward(inputs[0], inputs[1], inputs[2], output[0], output[1], inputs[3], inputs[4], inputs[5])
    ctx.flat = inputs[6:14]  # the record's flat arguments, return_lse last


def _grads(ctx, dout, dlse):
    """(dq, dk, dv, dsinks or None) through ``titan::flash_attn_backward``, on the backend the
    forward's request picks."""
    q, k, v, out, lse, cu_q, cu_k, sinks = ctx.saved_tensors
    if needs_grad(dout, dlse, q, k, v, sinks):
        # create_graph=True: the backward kernels have no derivative of their own.
        raise RuntimeError("titan::flash_attn: double backward (create_graph=True through attention) is not "
                           "supported; its backward kernels are not differentiable")
    if dout is None:
        dout = torch.zeros_like(out)
    dlse = dlse if ctx.flat[-1] else None
    dq, dk, dv, ds = flash_attn_def.backward(dout, q, k, v, out, lse, dlse, cu_q, cu_k, sinks, *ctx.flat, ctx.backend)
    return (dq, dk, dv, None, None, (ds if sinks is not None else None)) + (None,) * 8


# ----------------------------------------------------------------------------- sharding rules
# Attention mixes tokens of one sequence and is independent across batch entries and heads. Dense
# q/k/v (batch, seq, heads, d) run locally split on batch (dim 0) or heads (dim 2; lse (batch, heads,
# seq) on dim 1); varlen (total, heads, d) only on heads (dim 1; lse on dim 0), with cu_seqlens
# replicated. Splitting heads keeps GQA groups whole when n_kv_heads divides evenly (the local ratio
# is unchanged); with one KV head (MQA) k/v may stay replicated while q is split, and then dk/dv come
# out Partial (each rank sums over its own query heads). A split sequence is not local (every query
# needs every key): DTensor gathers it; context parallelism (ring attention, which uses the LSE) is
# the layer that handles it without a gather. The rules depend only on tensor arguments (DTensor
# leaves the scalars out of its cache key).


def _sharding(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, *scalars):
    # sinks (n_heads,) follow q's heads: Shard(0) when heads are split, else replicated.
    from torch.distributed.tensor import Replicate, Shard

    rep, flags = Replicate(), [None] * len(scalars)

    def sk(p):
        return p if sinks is not None else None

    if cu_seqlens_q is None:
        rules = [
            ([rep, rep], [rep, rep, rep, None, None, sk(rep), *flags]),
            ([Shard(0), Shard(0)], [Shard(0), Shard(0), Shard(0), None, None, sk(rep), *flags]),
            ([Shard(2), Shard(1)], [Shard(2), Shard(2), Shard(2), None, None, sk(Shard(0)), *flags]),
        ]
        if k.shape[2] == 1:
            rules.append(([Shard(2), Shard(1)], [Shard(2), rep, rep, None, None, sk(Shard(0)), *flags]))
        return rules
    return [
        ([rep, rep], [rep, rep, rep, rep, rep, sk(rep), *flags]),
        ([Shard(1), Shard(0)], [Shard(1), Shard(1), Shard(1), rep, rep, sk(Shard(0)), *flags]),
    ]


def _backward_sharding(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, sinks, *scalars):
    # dsinks sums over batch and rows: Partial when the batch is split, Shard(0) with the heads;
    # without sinks it is an empty tensor, replicated.
    from torch.distributed.tensor import Partial, Replicate, Shard

    rep, flags = Replicate(), [None] * len(scalars)

    def dl(p):
        return p if dlse is not None else None

    def sk(p):
        return p if sinks is not None else None

    def ds(p):
        return p if sinks is not None else rep

    if cu_seqlens_q is None:
        rules = [
            ([rep] * 4, [rep] * 6 + [dl(rep), None, None, sk(rep), *flags]),
            ([Shard(0)] * 3 + [ds(Partial())], [Shard(0)] * 6 + [dl(Shard(0)), None, None, sk(rep), *flags]),
            ([Shard(2)] * 3 + [ds(Shard(0))],
             [Shard(2)] * 5 + [Shard(1), dl(Shard(1)), None, None, sk(Shard(0)), *flags]),
        ]
        if k.shape[2] == 1:
            rules.append(([Shard(2), Partial(), Partial(), ds(Shard(0))],
                          [Shard(2), Shard(2), rep, rep, Shard(2), Shard(1), dl(Shard(1)), None, None,
                           sk(Shard(0)), *flags]))
        return rules
    return [
        ([rep] * 4, [rep] * 6 + [dl(rep), rep, rep, sk(rep), *flags]),
        ([Shard(1)] * 3 + [ds(Shard(0))],
         [Shard(1)] * 5 + [Shard(0), dl(Shard(0)), rep, rep, sk(Shard(0)), *flags]),
    ]


flash_attn_def.define(forward, _fake, setup=_save, grads=_grads, backward=backward, backward_fake=_backward_fake,
                      sharding=_sharding, backward_sharding=_backward_sharding, materialize_grads=False,
                      fast_forward=_fast_forward, planned_forward=_planned_forward)


def call(q, k, v, cu_q, cu_k, sinks, a: AttentionArgs, backend: str | None):
    """Run one validated call (``backend``: an explicit request or None) through the op's scaffold:
    the eager fast path when nothing needs the dispatcher, else the op."""
    if (sinks is None and cu_q is None and not backend and not torch.compiler.is_compiling()
            and eager_route_untraced((q, k, v)) == FAST):
        # Plain eager, no gradient recorded, no sinks: the fast path's body with the record as it is
        # (what the scaffold runs, without flattening the record into the op's arguments and back).
        out, lse = run_forward(None, q, k, v, None, None, None, a)
        return (out, lse.contiguous()) if a.return_lse else out
    if backend:
        out, lse = flash_attn_def.call(q, k, v, cu_q, cu_k, sinks, *a.op_args(), backend)
    else:
        out, lse = flash_attn_def(q, k, v, cu_q, cu_k, sinks, *a.op_args())
    return (out, lse) if a.return_lse else out


# eager_route_untraced's tests, bound once (call_planned runs them inline: every call).
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_modes = torch._C._is_torch_function_mode_enabled
_transforms = torch._C._are_functorch_transforms_active
_grad_enabled = torch.is_grad_enabled


def call_planned(q, k, v, plan: tuple):
    """A validated dense call without sinks whose record and dispatch key were decided once for its
    case: ``plan`` = (record, key, [the kept choice or None]) (``api.flash_attn``, which calls it only
    for plain ``torch.Tensor`` q, k, v, not on the meta device, when nothing is being compiled).
    ``eager_route`` inline: the fast path's body when nothing needs the dispatcher; the op's planned
    autograd carrier (``Op.eager_apply``, with the plan) when only a gradient is recorded; else the op."""
    a = plan[0]
    if _dispatch_modes() or _function_modes() or _transforms():  # (no plan is made for meta tensors)
        out, lse = flash_attn_def(q, k, v, None, None, None, *a.flat)
    elif (q.requires_grad or k.requires_grad or v.requires_grad) and _grad_enabled():
        # (out alone, or (out, lse) with return_lse: see _planned_forward)
        return flash_attn_def.eager_apply(plan, (q, k, v, None, None, None, *a.flat, requested_backend(OP) or AUTO),
                                          unwrap_dead(q), unwrap_dead(k), unwrap_dead(v))
    else:
        with below_views():
            out, lse = _planned_run(plan, q, k, v, None, requested_backend(OP))
        return (out, lse.contiguous()) if a.return_lse else out
    return (out, lse) if a.return_lse else out
