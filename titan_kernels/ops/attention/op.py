"""The attention ops ``torch.ops.titan.flash_attn`` / ``titan::flash_attn_backward``, their one autograd
definition, and the public functions ``flash_attn``, ``flash_attn_varlen`` and ``attention_backend``.

Math: softmax(c Q K^T + mask) V (Vaswani et al. 2017, eq. 1) computed as FlashAttention does (Dao et al.
2022; Dao 2023), with the float32 log-sum-exp (LSE) of each query row; see ``titan_kernels.reference.attention``.

One autograd definition: the eager fast path (a ``torch.autograd.Function``, no dispatcher) and the op
path (``register_autograd``) both save with ``_save`` and differentiate with ``_grads``. The backend
request (the ``backend=`` argument, else ``use_backend`` / ``TITAN_KERNELS_BACKEND``) is captured when
the forward runs and the backward resolves the same request, so both passes run on the same backend
whichever path ran and whatever context the backward runs in. When the backward carries an LSE
gradient that the forward's backend cannot take: an explicitly requested backend raises
RuntimeError (in both paths); an automatic choice moves to the first backend of the order that takes
it (every backend shares out/lse conventions, so any backward is valid with any forward's out and lse).
Under ``torch.compile`` the request is read when the op runs.

Conventions every backend follows: bottom-right causal alignment (query i sees key j when
``j <= i + seq_k - seq_q``); a row with no visible key has out = 0 and lse = -inf; out and lse are
fresh contiguous tensors.
"""
from __future__ import annotations

import torch

from titan_kernels import backend as _backend
from titan_kernels.ops._common import eager_fast_path
from titan_kernels.ops.attention import dispatch as _d
from titan_kernels.ops.attention.validate import (
    check_cu_seqlens, check_max_seqlen, check_qkv, validate_dense, validate_varlen,
)

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


def _empty_fwd(q, v, cu_q):
    out = torch.zeros(_out_shape(q, v), dtype=q.dtype, device=q.device)
    shape = (q.shape[1], q.shape[0]) if cu_q is not None else (q.shape[0], q.shape[2], q.shape[1])
    return out, torch.full(shape, float("-inf"), dtype=torch.float32, device=q.device)


def _run(request, q, k, v, cu_q, max_q, max_k, causal, need_lse, backward, has_dlse, call):
    """``call(fns)`` on the implementation ``titan_kernels.backend`` chooses for this case (cached per
    key). An automatically chosen backend that raises (a kernel or library that fails on this device)
    is recorded, with a warning, and the next one runs."""
    key = _d.case_key(q, k, v, cu_q, max_q, max_k, causal, need_lse, backward, has_dlse)

    def case():
        return _d.make_case(q, k, v, cu_q, max_q, max_k, causal, need_lse, backward, has_dlse)

    while True:
        choice = _backend.choose(_d.OP, q.device, key, case=case, backend=request or None)
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


def _fwd_with(fns, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    # out contiguous; lse in the kernel's layout (made contiguous where it leaves: the op, return_lse,
    # the backward), since a copy of it is a tenth of a small call.
    out, lse = fns[0](q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)
    return out.contiguous(), lse


def _forward(request, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, return_lse):
    if (q.numel() == 0 or k.shape[1] == 0) if cu_q is None else _trivial(q, k, cu_q):  # inline: every call
        return _empty_fwd(q, v, cu_q)
    # The first try inline, without _run's closures: this is most of a small call's overhead.
    key = _d.case_key(q, k, v, cu_q, max_q, max_k, causal, return_lse)  # key[0] is q.device
    choice = _backend.choose(_d.OP, key[0], key, case=lambda: _d.make_case(q, k, v, cu_q, max_q, max_k, causal,
                                                                           return_lse), backend=request or None)
    try:
        out, lse = choice.fn[0](q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)
        return out.contiguous(), lse
    except (RuntimeError, NotImplementedError) as e:
        _failed(choice, q.device, key, e)
    return _run(request, q, k, v, cu_q, max_q, max_k, causal, return_lse, False, False,
                lambda fns: _fwd_with(fns, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale))


def _backward(request, dout, q, k, v, out, lse, dlse, cu_q, cu_k, max_q, max_k, causal, scale, return_lse):
    if _trivial(q, k, cu_q):
        return tuple(torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))

    def call(fns):
        extra = {} if dlse is None else {"dlse": dlse}
        grads = fns[1](dout, q, k, v, out, lse.contiguous(), cu_q, cu_k, max_q, max_k, causal, scale, **extra)
        return tuple(g.contiguous() for g in grads)  # the fake implementation's strides

    return _run(request, q, k, v, cu_q, max_q, max_k, causal, return_lse, True, dlse is not None, call)


# ----------------------------------------------------------------------------- ops


@torch.library.custom_op("titan::flash_attn", mutates_args=())
def flash_attn_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    softmax_scale: float,
    return_lse: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward -> (out, lse). Dense when cu_seqlens_q is None: q (b, s_q, h, d),
    k (b, s_k, h_kv, d), v (b, s_k, h_kv, d_v), out (b, s_q, h, d_v), lse (b, h, s_q); varlen:
    q (total_q, h, d), out (total_q, h, d_v), lse (h, total_q) and
    max_seqlen_* bound the document lengths (ignored when dense). ``backend`` is the request ("" =
    automatic, read when the op runs). ``return_lse`` says whether the caller sees the LSE (only then
    is its gradient used). out is in q.dtype, lse float32; both contiguous."""
    out, lse = _forward(backend, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                        softmax_scale, return_lse)
    return out, lse.contiguous()  # the fake's strides


@flash_attn_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, return_lse, backend):
    if cu_seqlens_q is not None:
        lse_shape = (q.shape[1], q.shape[0])
    else:
        lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    return torch.empty(_out_shape(q, v), dtype=q.dtype, device=q.device), q.new_empty(lse_shape, dtype=torch.float32)


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
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    softmax_scale: float,
    return_lse: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of flash_attn from its out and lse: (dq, dk, dv), fresh contiguous tensors shaped and
    typed like (q, k, v), accumulated in float32. dout is shaped like out (any strides); dlse, shaped
    like lse or None, is a gradient for the LSE output. ``backend``: the forward's request."""
    return _backward(backend, dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, causal, softmax_scale, return_lse)


@flash_attn_backward_op.register_fake
def _(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
      return_lse, backend):
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


# ----------------------------------------------------------------------------- the one autograd definition


def _save(ctx, q, k, v, cu_q, cu_k, out, lse, max_q, max_k, causal, scale, return_lse, request):
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.args = (max_q, max_k, causal, scale, return_lse, request)


def _grads(ctx, dout, dlse):
    """(dq, dk, dv) through ``titan::flash_attn_backward``, on the backend the forward's request picks."""
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (dout, dlse, q, k, v)):
        # create_graph=True: the backward kernels have no derivative of their own.
        raise RuntimeError("titan::flash_attn: double backward (create_graph=True through attention) is not "
                           "supported; its backward kernels are not differentiable")
    max_q, max_k, causal, scale, return_lse, request = ctx.args
    if dout is None:
        dout = torch.zeros_like(out)
    dlse = dlse if return_lse else None
    return torch.ops.titan.flash_attn_backward(dout, q, k, v, out, lse, dlse, cu_q, cu_k, max_q, max_k, causal, scale,
                                               return_lse, request)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, return_lse, backend = inputs
    _save(ctx, q, k, v, cu_q, cu_k, output[0], output[1], max_q, max_k, causal, scale, return_lse, backend)


def _op_backward(ctx, dout, dlse):
    return (*_grads(ctx, dout, dlse), None, None, None, None, None, None, None, None)


flash_attn_op.register_autograd(_op_backward, setup_context=_setup_context)


class _FlashAttnFn(torch.autograd.Function):
    """The eager fast path: the same forward, ``_save`` and ``_grads`` as the op, without the dispatcher."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, return_lse, request):
        out, lse = _forward(request, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, return_lse)
        if return_lse:
            lse = lse.contiguous()
        _save(ctx, q, k, v, cu_q, cu_k, out, lse, max_q, max_k, causal, scale, return_lse, request)
        ctx.set_materialize_grads(False)
        # Without return_lse the caller never sees lse, so it needs no mark_non_differentiable (a
        # microsecond of a small call); _grads ignores its gradient then.
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        return (*_grads(ctx, dout, dlse), None, None, None, None, None, None, None, None)


def _call(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, return_lse, backend):
    if eager_fast_path(q, k, v) if cu_q is None else eager_fast_path(q, k, v, cu_q, cu_k):
        request = backend or _backend.requested_backend(_d.OP) or _backend.AUTO
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            out, lse = _FlashAttnFn.apply(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, return_lse, request)
        else:
            out, lse = _forward(request, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, return_lse)
            if return_lse:
                lse = lse.contiguous()
    else:
        if not torch.compiler.is_compiling():  # capture the request now (the backward may run elsewhere)
            backend = backend or _backend.requested_backend(_d.OP) or _backend.AUTO
        out, lse = torch.ops.titan.flash_attn(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, return_lse, backend)
    return (out, lse) if return_lse else out


_BACKEND_NAMES = _d.ATTENTION_BACKENDS + ("cpu", "cuda")


def _check_backend_arg(backend) -> str:
    if backend is None or backend == "":
        return ""
    if not isinstance(backend, str) or backend not in _BACKEND_NAMES:
        raise ValueError(f"backend: expected None or one of {_BACKEND_NAMES}, got {backend!r}")
    return backend


# ----------------------------------------------------------------------------- public API


def flash_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention on the fastest backend that takes the case (FlashAttention API).

    Args:
        q: (batch, seq_q, n_heads, head_dim); k: (batch, seq_k, n_kv_heads, head_dim); v: (batch,
            seq_k, n_kv_heads, head_dim_v). Same dtype (float16 / bfloat16; float32 too, on backends
            that take it: reference, Triton, SDPA) and device; any strides. head_dim and head_dim_v
            up to 256: any multiple of 8 runs everywhere (fast paths at 64, 128, 256), other sizes
            only on the backends that take them (reference, Triton, SDPA; not FlashAttention).
            head_dim_v may differ from head_dim (multi-head latent attention, DeepSeek-V3: 192 and
            128): natively on the reference, Triton, FlashAttention-3's forward (q/k in (128, 192]
            with v in (96, 128], or q/k <= 64) and aten's cuDNN / efficient kernels where torch's
            checks accept it; aten's CPU kernel by zero-padding (its only way); FlashAttention-2 and
            aten's CUDA flash kernel refuse it. n_heads is a multiple of n_kv_heads (GQA/MQA: query
            head h reads K/V head h // (n_heads // n_kv_heads); K/V are never repeated in memory).
        causal: mask aligned bottom-right as FlashAttention >= 2.1: query i sees key j when
            ``j <= i + seq_k - seq_q``. A row with no visible key outputs 0.
        softmax_scale: the scale of Q K^T (finite, > 0); None means 1 / sqrt(head_dim).
        return_lse: also return the float32 log-sum-exp (natural log) of each query row's scaled
            scores, (batch, n_heads, seq_q); -inf for a row with no visible key. Differentiable.
        backend: force one of ``ATTENTION_BACKENDS`` (or "cpu" / "cuda"); None chooses (see module doc).

    Returns:
        out (batch, seq_q, n_heads, head_dim_v) in q.dtype, or (out, lse) with ``return_lse``.

    Raises:
        TypeError: a non-tensor, an unsupported dtype, or k/v dtype != q dtype.
        ValueError: wrong rank, mismatched batch / shapes / devices, k's head_dim != q's, n_heads not
            a multiple of n_kv_heads, a head_dim over 256 (no backend takes it), a bad softmax_scale
            or backend name.
        RuntimeError: a requested backend cannot run the case, e.g. FlashAttention with a head_dim
            that is not a multiple of 8 (the message says why).

    Source: Vaswani et al. 2017 eq. 1; Dao et al. 2022 (FlashAttention) and Dao 2023
    (FlashAttention-2) for the blocked online softmax, the LSE and the backward.
    """
    backend = "" if backend is None else _check_backend_arg(backend)
    scale = validate_dense(q, k, v, softmax_scale)
    return _call(q, k, v, None, None, 0, 0, bool(causal), scale, bool(return_lse), backend)


def flash_attn_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over packed documents: tokens attend only within their own document.

    Args:
        q: (total_q, n_heads, head_dim); k: (total_k, n_kv_heads, head_dim); v: (total_k,
            n_kv_heads, head_dim_v); dtype, head_dim and GQA rules as ``flash_attn``.
        cu_seqlens_q, cu_seqlens_k: int32 (n_docs + 1,) cumulative lengths on q's device: document i
            is rows ``cu[i]:cu[i+1]``; they start at 0, never decrease and end at total_q / total_k.
            Zero-length documents are allowed.
        max_seqlen_q, max_seqlen_k: ints >= the longest document (they size the kernel grids).
        causal, softmax_scale, return_lse, backend: as ``flash_attn``; the causal alignment applies
            per document.

    Returns:
        out (total_q, n_heads, head_dim_v) in q.dtype, or (out, lse) with lse (n_heads, total_q) float32.

    Raises:
        As ``flash_attn``, plus TypeError for cu_seqlens that are not int32 and ValueError for
        cu_seqlens that are not 1-D, differ in length, do not start at 0, decrease, do not end at the
        total, or have a document longer than max_seqlen. The value checks need one device sync and
        run in eager mode only (under torch.compile they are skipped).

    Source: as ``flash_attn``; the varlen layout of FlashAttention's ``flash_attn_varlen_func``.
    """
    backend = _check_backend_arg(backend)
    scale, max_seqlen_q, max_seqlen_k = validate_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale
    )
    return _call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, bool(causal), scale,
                 bool(return_lse), backend)


def attention_backend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    return_lse: bool = False,
    cu_seqlens_q: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    backward: bool = False,
    backend: str | None = None,
) -> _d.AttentionChoice:
    """Which backend ``flash_attn`` (or ``flash_attn_varlen``, when cu_seqlens_q is given) would run
    for these inputs, why, and why each backend before it was skipped.

    Takes the same tensors (dense or varlen layout) and options; ``backward=True`` asks about the
    backward instead. Raises as the attention call would (bad inputs: ValueError / TypeError; a
    requested backend that cannot run: RuntimeError).
    """
    backend = _check_backend_arg(backend)
    if cu_seqlens_q is None:
        validate_dense(q, k, v, None)
    else:
        check_qkv(q, k, v, 3, "(total, heads, head_dim)")
        check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0], q.device, None)
        max_seqlen_q = check_max_seqlen(max_seqlen_q, "max_seqlen_q")
        max_seqlen_k = check_max_seqlen(max_seqlen_k, "max_seqlen_k")
    case = _d.make_case(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal, return_lse, backward)
    return _d.choose_backend(case, backend or None)
