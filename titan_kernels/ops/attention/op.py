"""The attention ops ``torch.ops.titan.flash_attn`` / ``titan::flash_attn_backward``, their one autograd
definition, and ``call``, which the public functions (``api.py``) run.

Math: softmax(softcap(c Q K^T) + mask) V with optional sinks (Vaswani et al. 2017, eq. 1) computed as
FlashAttention does (Dao et al. 2022; Dao 2023), with the float32 log-sum-exp (LSE) of each query
row; see ``titan_kernels.reference.attention``, ``titan_kernels.attention_mask`` and ``sinks.py``.

The non-tensor arguments travel as one frozen ``AttentionArgs`` record (the op schemas stay flat:
``AttentionArgs.op_args`` / ``from_op``). Every backend implements ``fwd(q, k, v, cu_q, cu_k, a) ->
(out, lse)`` and ``bwd(dout, q, k, v, out, lse, dlse, cu_q, cu_k, a) -> (dq, dk, dv)``; sinks are
applied here, to any backend's (out, lse) (``sinks.py``), so no backend sees them.

One autograd definition: the eager fast path (a ``torch.autograd.Function``, no dispatcher) and the op
path (``register_autograd``) both save with ``_save`` and differentiate with ``_grads``. The backend
request (the ``backend=`` argument, else ``use_backend`` / ``TITAN_KERNELS_BACKEND``) is captured when
the forward runs and the backward resolves the same request, so both passes run on the same backend
whichever path ran and whatever context the backward runs in. When the backward carries a case the
forward's backend cannot take (an LSE gradient; FlashAttention-3's backward with v's head_dim
different from q/k's): an explicitly requested backend raises RuntimeError (in both paths); an
automatic choice moves to the first backend of the order that takes it (every backend shares the
out/lse conventions, so any backward is valid with any forward's out and lse). Under
``torch.compile`` the request is read when the op runs.

Conventions every backend follows: the mask of ``titan_kernels.attention_mask`` (bottom-right
aligned); a row with no visible key has out = 0 and lse = -inf (with sinks: the sink's logit); out
and lse are fresh contiguous tensors.
"""
from __future__ import annotations

import torch

from titan_kernels import backend as _backend
from titan_kernels.attention_mask import AttentionArgs
from titan_kernels.ops._common import eager_fast_path
from titan_kernels.ops.attention import dispatch as _d
from titan_kernels.ops.attention.sinks import apply_sinks, sinks_grad

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


def _empty_fwd(q, v, cu_q):
    out = torch.zeros(_out_shape(q, v), dtype=q.dtype, device=q.device)
    return out, torch.full(_lse_shape(q, cu_q), float("-inf"), dtype=torch.float32, device=q.device)


def _no_sinks_grad(q) -> torch.Tensor:
    return torch.empty((0,), dtype=torch.float32, device=q.device)


def _run(request, q, k, v, cu_q, a, backward, has_dlse, call):
    """``call(fns)`` on the implementation ``titan_kernels.backend`` chooses for this case (cached per
    key). An automatically chosen backend that raises (a kernel or library that fails on this device)
    is recorded, with a warning, and the next one runs."""
    key = _d.case_key(q, k, v, cu_q, a, backward, has_dlse)
    while True:
        choice = _backend.choose(_d.OP, q.device, key, backend=request or None,
                                 case=lambda: _d.make_case(q, k, v, cu_q, a, backward, has_dlse))
        try:
            return call(choice.fn)
        except (RuntimeError, NotImplementedError) as e:
            _failed(choice, q.device, key, e)


def _failed(choice, device, key, error) -> None:
    """Re-raise what an explicit request, the reference or memory raised; else record the failure
    (the next automatic choice passes the backend over)."""
    if isinstance(error, torch.OutOfMemoryError) or choice.explicit or choice.backend == "reference":
        raise error
    _backend.mark_failed(_d.OP, choice, device, key, error)


def forward(request, q, k, v, cu_q, cu_k, sinks, a: AttentionArgs):
    """(out, lse) of one call on the chosen backend, sinks applied; out contiguous, lse in the
    kernel's layout (made contiguous where it leaves: the op, return_lse, the backward), since a copy
    of it is a tenth of a small call."""
    if (q.numel() == 0 or k.shape[1] == 0) if cu_q is None else _trivial(q, k, cu_q):  # inline: every call
        out, lse = _empty_fwd(q, v, cu_q)
    else:
        # The first try inline, without _run's closures: this is most of a small call's overhead.
        key = _d.case_key(q, k, v, cu_q, a)  # key[0] is q.device
        choice = _backend.choose(_d.OP, key[0], key, case=lambda: _d.make_case(q, k, v, cu_q, a),
                                 backend=request or None)
        try:
            out, lse = choice.fn[0](q, k, v, cu_q, cu_k, a)
        except (RuntimeError, NotImplementedError) as e:
            _failed(choice, q.device, key, e)
            out, lse = _run(request, q, k, v, cu_q, a, False, False, lambda fns: fns[0](q, k, v, cu_q, cu_k, a))
        out = out.contiguous()
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks, cu_q is not None)
    return out, lse


def backward(request, dout, q, k, v, out, lse, dlse, cu_q, cu_k, sinks, a: AttentionArgs):
    """(dq, dk, dv, dsinks) from the forward's out and lse (with sinks: out' and lse', which every
    backend's backward differentiates exactly, see sinks.py); dsinks is empty without sinks."""
    if _trivial(q, k, cu_q):
        grads = tuple(torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    else:
        def call(fns):
            g = fns[1](dout, q, k, v, out, lse.contiguous(), dlse, cu_q, cu_k, a)
            return tuple(t.contiguous() for t in g)  # the fake implementation's strides

        grads = _run(request, q, k, v, cu_q, a, True, dlse is not None, call)
    ds = _no_sinks_grad(q) if sinks is None else sinks_grad(dout, out, lse, dlse, sinks, cu_q is not None)
    return (*grads, ds)


# ----------------------------------------------------------------------------- ops


@torch.library.custom_op("titan::flash_attn", mutates_args=())
def flash_attn_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    sinks: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    chunk_size: int,
    return_lse: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward -> (out, lse). Dense when cu_seqlens_q is None: q (b, s_q, h, d),
    k (b, s_k, h_kv, d), v (b, s_k, h_kv, d_v), out (b, s_q, h, d_v), lse (b, h, s_q); varlen:
    q (total_q, h, d), out (total_q, h, d_v), lse (h, total_q) and max_seqlen_* bound the document
    lengths (ignored when dense). sinks: None or (h,) logits. window_left / window_right (-1 =
    unbounded; right 0 = causal), softcap (0 = off), chunk_size (0 = off): ``AttentionArgs``.
    ``backend`` is the request ("" = automatic, read when the op runs). ``return_lse`` says whether
    the caller sees the LSE (only then is its gradient used). out is in q.dtype, lse float32 (with
    sinks, the sink included); both contiguous."""
    a = AttentionArgs.from_op(max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap,
                              chunk_size, return_lse)
    out, lse = forward(backend, q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, a)
    return out, lse.contiguous()  # the fake's strides


@flash_attn_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, *args):
    return (torch.empty(_out_shape(q, v), dtype=q.dtype, device=q.device),
            q.new_empty(_lse_shape(q, cu_seqlens_q), dtype=torch.float32))


@torch.library.custom_op("titan::flash_attn_backward", mutates_args=())
def flash_attn_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    sinks: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    chunk_size: int,
    return_lse: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of flash_attn from its out and lse: (dq, dk, dv, dsinks), fresh contiguous tensors;
    dq, dk, dv shaped and typed like (q, k, v), accumulated in float32; dsinks like sinks, or an
    empty float32 tensor without sinks. dout is shaped like out (any strides); dlse, shaped like lse
    or None, is a gradient for the LSE output. ``backend``: the forward's request."""
    a = AttentionArgs.from_op(max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap,
                              chunk_size, return_lse)
    return backward(backend, dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, sinks, a)


@flash_attn_backward_op.register_fake
def _(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, sinks, *args):
    ds = _no_sinks_grad(q) if sinks is None else torch.empty(sinks.shape, dtype=sinks.dtype, device=sinks.device)
    return (*(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v)), ds)


# ----------------------------------------------------------------------------- the one autograd definition


def _save(ctx, q, k, v, cu_q, cu_k, sinks, out, lse, a: AttentionArgs, request):
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, sinks)
    ctx.args = (a, request)


def _grads(ctx, dout, dlse):
    """(dq, dk, dv, dsinks or None) through ``titan::flash_attn_backward``, on the backend the
    forward's request picks."""
    q, k, v, out, lse, cu_q, cu_k, sinks = ctx.saved_tensors
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (dout, dlse, q, k, v, sinks)):
        # create_graph=True: the backward kernels have no derivative of their own.
        raise RuntimeError("titan::flash_attn: double backward (create_graph=True through attention) is not "
                           "supported; its backward kernels are not differentiable")
    a, request = ctx.args
    if dout is None:
        dout = torch.zeros_like(out)
    dlse = dlse if a.return_lse else None
    dq, dk, dv, ds = torch.ops.titan.flash_attn_backward(dout, q, k, v, out, lse, dlse, cu_q, cu_k, sinks,
                                                         *a.op_args(), request)
    return dq, dk, dv, (ds if sinks is not None else None)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, sinks = inputs[:6]
    _save(ctx, q, k, v, cu_q, cu_k, sinks, output[0], output[1], AttentionArgs.from_op(*inputs[6:14]), inputs[14])


def _op_backward(ctx, dout, dlse):
    dq, dk, dv, ds = _grads(ctx, dout, dlse)
    return (dq, dk, dv, None, None, ds) + (None,) * 9


flash_attn_op.register_autograd(_op_backward, setup_context=_setup_context)


class _FlashAttnFn(torch.autograd.Function):
    """The eager fast path: the same forward, ``_save`` and ``_grads`` as the op, without the dispatcher."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, sinks, a, request):
        out, lse = forward(request, q, k, v, cu_q, cu_k, sinks, a)
        if a.return_lse:
            lse = lse.contiguous()
        _save(ctx, q, k, v, cu_q, cu_k, sinks, out, lse, a, request)
        ctx.set_materialize_grads(False)
        # Without return_lse the caller never sees lse, so it needs no mark_non_differentiable (a
        # microsecond of a small call); _grads ignores its gradient then.
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        dq, dk, dv, ds = _grads(ctx, dout, dlse)
        return dq, dk, dv, None, None, ds, None, None


def call(q, k, v, cu_q, cu_k, sinks, a: AttentionArgs, backend: str):
    """Run one validated call: the eager fast path when nothing needs the dispatcher, else the op."""
    if eager_fast_path(q, k, v, sinks) if cu_q is None else eager_fast_path(q, k, v, cu_q, cu_k, sinks):
        request = backend or _backend.requested_backend(_d.OP) or _backend.AUTO
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or (sinks is not None and sinks.requires_grad)):
            out, lse = _FlashAttnFn.apply(q, k, v, cu_q, cu_k, sinks, a, request)
        else:
            out, lse = forward(request, q, k, v, cu_q, cu_k, sinks, a)
            if a.return_lse:
                lse = lse.contiguous()
    else:
        if not torch.compiler.is_compiling():  # capture the request now (the backward may run elsewhere)
            backend = backend or _backend.requested_backend(_d.OP) or _backend.AUTO
        out, lse = torch.ops.titan.flash_attn(q, k, v, cu_q, cu_k, sinks, *a.op_args(), backend)
    return (out, lse) if a.return_lse else out
