"""Attention sinks (GPT-OSS): a learned logit per head that joins every row's softmax denominator and
outputs nothing, applied exactly to any backend's (out, lse) as an epilogue.

With a row's log-sum-exp ``lse`` over its keys and the head's sink logit ``s``:
    lse' = logaddexp(lse, s),   out' = out * exp(lse - lse')
(a row with no visible key: lse = -inf, so lse' = s and out' = 0: the row's softmax is over the
sink alone). The backward needs no kernel of
its own: the probabilities with the sink are P'_ij = exp(S_ij - lse'_i), and every backend's
backward recomputes P from the (out, lse) it is handed, so handing it (out', lse') gives the exact
dq, dk, dv of the attention with the sink (dS = P' * (dP - delta'), delta' = dout . out'; an LSE
gradient dlse' adds P' * dlse' as before). The sink's own gradient, from
d out'_i / d s = -out'_i * p_i and d lse'_i / d s = p_i with p_i = exp(s - lse'_i):
    dsink = sum over rows of p_i * (dlse'_i - dout_i . out'_i).

The LSE returned with sinks is lse' (the log of the denominator the output is normalized by, sink
included), as FlashAttention-3 returns it; its gradient is taken with respect to lse'.

Infinite sinks are limits, never NaN: a sink of -inf is no sink (its head's rows are plain
attention; a row with no visible key keeps out' = 0 and lse' = -inf, where exp(lse - lse') would be
exp(-inf + inf)); a sink of +inf takes the whole row (out' = 0, lse' = +inf). Where lse' equals the
sink (a row with no visible key, or an infinite sink) the sink's probability p_i is 1, its limit.

Where: every backend, as this epilogue (one elementwise pass over out in the forward, one reduction
of dout . out' in the backward: O(seq * head_dim), against attention's O(seq^2 * head_dim)). No
kernel change is cheaper: the kernels' backward already takes (out', lse'). Ring attention applies
it once, after merging its blocks.
"""
from __future__ import annotations

import torch


def _lse_view(sinks: torch.Tensor, varlen: bool) -> torch.Tensor:
    # lse is (batch, heads, seq) dense, (heads, total) varlen.
    s = sinks.float()
    return s[:, None] if varlen else s[None, :, None]


def _row_weight(w: torch.Tensor, varlen: bool) -> torch.Tensor:
    # (.., heads, seq) weights -> broadcastable against out: (batch, seq, heads, 1) / (total, heads, 1).
    return (w.t() if varlen else w.transpose(1, 2)).unsqueeze(-1)


def apply_attention_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, varlen: bool):
    """Attention sinks applied to one attention call's result: (out', lse') with
    ``lse' = logaddexp(lse, sink)`` and ``out' = out * exp(lse - lse')`` (module docstring).

    Args:
        out: (batch, seq, heads, head_dim_v) dense or (total, heads, head_dim_v) varlen, any float dtype.
        lse: float32 log-sum-exp of each row over its keys, (batch, heads, seq) / (heads, total);
            -inf for a row with no visible key.
        sinks: (heads,) float logits (math in float32). varlen: which layout out and lse are in.

    Returns:
        (out' in out.dtype, lse' float32), both contiguous; a row with no visible key gets out' = 0
        and lse' = its sink. Ring attention applies it once, to the merged (out, lse) of its blocks.

    Source: OpenAI's gpt-oss model card 2025 (sinks); the epilogue form is derived in the module docstring.
    """
    lse2 = torch.logaddexp(lse, _lse_view(sinks, varlen))
    # 0 for a row with no visible key, also where lse2 is -inf too (a sink of -inf: exp(nan) otherwise).
    w = torch.exp(lse - lse2).masked_fill_(lse == float("-inf"), 0.0)
    return (out.float() * _row_weight(w, varlen)).to(out.dtype), lse2.contiguous()


def attention_sinks_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None,
                         sinks: torch.Tensor, varlen: bool) -> torch.Tensor:
    """d loss / d sinks = sum over rows of p_i * (dlse'_i - dout_i . out'_i), p_i = exp(sink - lse'_i).

    Args: dout (out's shape), out' and lse' as ``apply_attention_sinks`` returned them, dlse (lse's
    shape) or None, sinks (heads,), varlen (the layout). Returns (heads,) in sinks' dtype, summed in
    float32 over batch and rows. The gradients of q, k and v need nothing more: a backend's backward
    handed (out', lse') gives them exactly (module docstring).
    """
    s = _lse_view(sinks, varlen)
    # (.., heads, seq): the sink's probability per row; 1 where lse' is the sink itself (module
    # docstring: also for an infinite sink, where s - lse' would be inf - inf).
    p = torch.where(s == lse, 1.0, torch.exp(s - lse))
    delta = (dout.float() * out.float()).sum(-1)  # (batch, seq, heads) / (total, heads)
    delta = delta.t() if varlen else delta.transpose(1, 2)
    g = p * ((dlse.float() if dlse is not None else 0.0) - delta)
    return (g.sum(1) if varlen else g.sum((0, 2))).to(sinks.dtype)
