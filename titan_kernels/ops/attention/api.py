"""The public attention functions: ``flash_attn``, ``flash_attn_varlen`` and ``attention_backend``.

They validate every argument (clear errors naming it), build the call's ``AttentionArgs`` record
(normalized: a window side that cuts nothing is unbounded) and hand it to ``op.call``.
"""
from __future__ import annotations

import functools

import torch

from titan_kernels.attention_mask import (
    AttentionArgs, check_causal, check_chunk, check_flag, check_softcap, check_window,
)
from titan_kernels.ops.attention import dispatch as _d
from titan_kernels.ops.attention.op import call, call_planned
from titan_kernels.ops.attention.validate import (
    check_cu_seqlens, check_max_seqlen, check_qkv, check_sinks, validate_dense, validate_varlen,
)

_BACKEND_NAMES = _d.ATTENTION_BACKENDS + ("cpu", "cuda")
_FULL = (-1, -1)


def _check_backend_arg(backend) -> str | None:
    if backend is None:
        return None
    if not isinstance(backend, str) or backend not in _BACKEND_NAMES:
        raise ValueError(f"backend: expected None or one of {_BACKEND_NAMES}, got {backend!r}")
    return backend


_TENSOR = torch.Tensor
_is_compiling = torch.compiler.is_compiling  # (bound once: flash_attn tests it on every call)
_plain_plans: dict[tuple, tuple | None] = {}  # the plain calls' cases -> (record, dispatch key, [choice]) or None
_MAX_PLANS = 4096


def _plain_plan(ck, q, k, v, causal, softmax_scale, return_lse) -> tuple | None:
    """(record, dispatch key, [the choice ``op.call_planned`` keeps]) of a plain dense call, after
    validating it (raising as ``flash_attn`` does); None for a case the general path takes (no work to
    do, meta tensors, options that are not bools). Cached per ``ck``: shapes, dtypes, devices and the
    options, everything the outcome depends on. Not under torch.compile (the caller checks): traced
    code takes the op."""
    if type(causal) is not bool or type(return_lse) is not bool:
        return None
    scale = validate_dense(q, k, v, softmax_scale)
    a = _args(q, k, None, scale, causal, _FULL, 0.0, None, return_lse)
    plan = None if (q.numel() == 0 or k.shape[1] == 0 or q.is_meta) else (a, _d.case_key(q, k, v, None, a), [None])
    if softmax_scale is None or type(softmax_scale) is float:  # (hashable, as validated)
        if len(_plain_plans) >= _MAX_PLANS:
            _plain_plans.clear()
        _plain_plans[ck] = plan
    return plan


@functools.lru_cache(maxsize=256)
def _plain_args(scale: float, causal: bool, return_lse: bool) -> AttentionArgs:
    # The common dense call (full or causal, nothing else): one record per (scale, causal, return_lse).
    return AttentionArgs(scale, -1, 0 if causal else -1, return_lse=return_lse)


def _args(q, k, cu_q, scale, causal, window_size, softcap, chunk_size, return_lse, max_q=0, max_k=0):
    """The validated, normalized record of one call."""
    if cu_q is None and softcap == 0.0 and chunk_size is None and (window_size is _FULL or window_size == _FULL) \
            and type(causal) is bool and type(return_lse) is bool and not torch.compiler.is_compiling():
        return _plain_args(scale, causal, return_lse)
    left, right = check_window(window_size, check_causal(causal))
    a = AttentionArgs(scale, left, right, check_softcap(softcap), check_chunk(chunk_size), max_q, max_k,
                      check_flag(return_lse, "return_lse"))
    if cu_q is None:
        return a.normalized(q.shape[1], k.shape[1])
    return a.normalized(max_q, max_k, dense=False) if a.left >= 0 or a.right > 0 else a


_MASK_DOC = """causal: query i sees key j only when ``j <= p`` with p = i + seq_k - seq_q, its position
            aligned bottom-right (FlashAttention >= 2.1). causal=True means window right = 0.
        window_size: (left, right): query i sees key j only when ``p - left <= j <= p + right``;
            -1 = unbounded. A sliding window of W tokens (GPT-OSS, Mistral) is (W - 1, 0). A right
            bound > 0 needs causal=False. A bound as long as the sequence runs as no bound.
        sinks: None or a (n_heads,) float tensor (float32 usually; math in float32), one learned
            logit per head that joins each row's softmax denominator and outputs nothing (GPT-OSS).
            Differentiable. The returned LSE includes it: lse = logaddexp(lse_keys, sink). A row
            with no visible key has out 0 and lse = its sink; a sink of -inf is no sink for that
            head, +inf takes every row (out 0, lse +inf): limits, never NaN.
        softcap: scores become ``softcap * tanh(scores / softcap)`` after the scale (Gemma 2);
            0 = off. Differentiable.
        chunk_size: None or c >= 1: query i sees key j only when ``j // c == p // c`` (Llama 4's
            chunked local attention: chunks of absolute position; rows at negative positions,
            seq_q > seq_k, see nothing). All of these combine; the full definition is in
            ``titan_kernels.attention_mask``. A row with no visible key outputs 0."""


def flash_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = _FULL,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
    chunk_size: int | None = None,
    return_lse: bool = False,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if (sinks is None and backend is None and window_size is _FULL and softcap == 0.0 and chunk_size is None
            and type(q) is _TENSOR and type(k) is _TENSOR and type(v) is _TENSOR and not _is_compiling()):
        # The common call (full or causal, nothing else): its validation, record and dispatch key are
        # decided once per case and cached (a tiny call's cost is its Python).
        ck = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, causal,
              softmax_scale, return_lse)
        try:
            plan = _plain_plans[ck]
        except (KeyError, TypeError):  # a new case (TypeError: an unhashable argument, which validation names)
            plan = _plain_plan(ck, q, k, v, causal, softmax_scale, return_lse)
        if plan is not None:
            return call_planned(q, k, v, plan)
    # (inline, not through helpers: this runs on every call, and a tiny call's cost is its Python)
    if backend is not None:
        backend = _check_backend_arg(backend)
    scale = validate_dense(q, k, v, softmax_scale)
    if sinks is not None:
        check_sinks(sinks, q)
    return call(q, k, v, None, None, sinks, _args(q, k, None, scale, causal, window_size, softcap, chunk_size,
                                                  return_lse), backend)


flash_attn.__doc__ = f"""Scaled dot-product attention on the fastest backend that takes the case (FlashAttention API).

    Args:
        q: (batch, seq_q, n_heads, head_dim); k: (batch, seq_k, n_kv_heads, head_dim); v: (batch,
            seq_k, n_kv_heads, head_dim_v). Same dtype (float16 / bfloat16; float32 too, on backends
            that take it: reference, Triton, SDPA, the CPU ones) and device; any strides. head_dim and
            head_dim_v up to 256: any multiple of 8 runs everywhere (fast paths at 64, 128, 256),
            other sizes only on the backends that take them (not FlashAttention). head_dim_v may
            differ from head_dim (multi-head latent attention, DeepSeek-V3: 192 and 128): natively on
            the reference, Triton, blockwise, FlashAttention-3's forward (q/k in (128, 192] with v in
            (96, 128], or q/k <= 64) and aten's cuDNN / efficient kernels where torch's checks accept
            it; aten's CPU kernel by zero-padding; FlashAttention-2 and aten's CUDA flash kernel
            refuse it. n_heads is a multiple of n_kv_heads (GQA/MQA: query head h reads K/V head
            h // (n_heads // n_kv_heads); K/V are never repeated in memory).
        {_MASK_DOC}
        softmax_scale: the scale of Q K^T (finite, > 0); None means 1 / sqrt(head_dim).
        return_lse: also return the float32 log-sum-exp (natural log) of each query row's scores,
            (batch, n_heads, seq_q); -inf for a row with no visible key (with sinks: the sink's
            logit). Differentiable.
        backend: force one of ``ATTENTION_BACKENDS`` (or "cpu" / "cuda"); None chooses the fastest
            that takes the case (``attention_backend`` says which and why).

    Returns:
        out (batch, seq_q, n_heads, head_dim_v) in q.dtype, or (out, lse) with ``return_lse``.

    Raises:
        TypeError: a non-tensor, an unsupported dtype, k/v dtype != q dtype, a window_size that is
            not a pair of ints, a non-float softcap, causal or return_lse not a bool.
        ValueError: wrong rank, mismatched batch / shapes / devices, k's head_dim != q's, n_heads not
            a multiple of n_kv_heads, a head_dim over 256 (no backend takes it), a bad softmax_scale,
            window_size (< -1, or right > 0 with causal), softcap (< 0, not finite), chunk_size
            (< 0), sinks (shape, device) or backend name.
        RuntimeError: a requested backend cannot run the case, e.g. FlashAttention with a head_dim
            that is not a multiple of 8, aten's kernels with soft-capping (the message says why).

    Source: Vaswani et al. 2017 eq. 1; Dao et al. 2022 (FlashAttention) and Dao 2023
    (FlashAttention-2) for the blocked online softmax, the LSE and the backward; Beltagy et al.
    2020 (sliding windows); Gemma 2 (soft-capping); OpenAI's gpt-oss model card 2025 (sinks);
    Llama 4 (chunked attention).
    """


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
    window_size: tuple[int, int] = _FULL,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
    chunk_size: int | None = None,
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
        causal, window_size, sinks, softcap, chunk_size, softmax_scale, return_lse, backend: as
            ``flash_attn``; the mask applies per document, positions counted from its start.

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
    if sinks is not None:
        check_sinks(sinks, q)
    a = _args(q, k, cu_seqlens_q, scale, causal, window_size, softcap, chunk_size, return_lse, max_seqlen_q,
              max_seqlen_k)
    return call(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, a, backend)


def attention_backend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    window_size: tuple[int, int] = _FULL,
    softcap: float = 0.0,
    chunk_size: int | None = None,
    return_lse: bool = False,
    cu_seqlens_q: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    backward: bool = False,
    backend: str | None = None,
) -> _d.AttentionChoice:
    """Which backend ``flash_attn`` (or ``flash_attn_varlen``, when cu_seqlens_q is given) would run
    for these inputs, why, and why each backend before it was skipped (``str(choice)`` lists them).

    Takes the same tensors (dense or varlen layout) and options (sinks need no backend of their own:
    they are applied to any backend's output); ``backward=True`` asks about the backward instead.
    Raises as the attention call would (bad inputs: ValueError / TypeError; a requested backend that
    cannot run: RuntimeError).
    """
    backend = _check_backend_arg(backend)
    if cu_seqlens_q is None:
        scale = validate_dense(q, k, v, None)
        max_seqlen_q = max_seqlen_k = 0
    else:
        check_qkv(q, k, v, 3, "(total, heads, head_dim)")
        check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0], q.device, None)
        max_seqlen_q = check_max_seqlen(max_seqlen_q, "max_seqlen_q")
        max_seqlen_k = check_max_seqlen(max_seqlen_k, "max_seqlen_k")
        scale = 1.0
    a = _args(q, k, cu_seqlens_q, scale, causal, window_size, softcap, chunk_size, return_lse, max_seqlen_q,
              max_seqlen_k)
    return _d.choose_backend(_d.make_case(q, k, v, cu_seqlens_q, a, backward), backend)
