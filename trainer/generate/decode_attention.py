"""Decode attention on the CPU: one query per row over a head-major KV cache, as two batched matmuls
and a softmax (DESIGN.md section 4b).

Why not ``flash_attn`` here: on the CPU its kernel (aten's flash attention) tiles for long queries;
with one query it reads the cache views at about half the speed of a plain batched matmul, and the
op's Python layer (validation, backend choice) costs ~40 us per call, per layer and step (profile and
numbers: ``bench/bench_generate.py``). The cache stores each kv head's keys contiguously
(batch, kv_heads, slots, d), so the ``g = heads / kv_heads`` queries of a group read their keys as
one (g, d) x (d, n) product: ``rows * kv_heads`` of them in one ``baddbmm``, no copy of the cache and
no repeat of the kv heads (GQA). Math: softmax(scale * q k^T) v over the n visible slots, the
scale applied inside the product (alpha), the softmax in float32 when the cache is.
"""
from __future__ import annotations

import torch


def grouped_decode_attention(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, plan,
                             softmax_scale: float | None = None) -> torch.Tensor:
    """Attention of one query per row over the first ``n`` slots of its cache, for each run
    ``(first row, last row + 1, n)`` of ``plan`` (``CacheState.decode_plan``).

    Args:
        q: (batch, 1, heads, d) queries, heads grouped by kv head (head h reads kv head h // g).
        k_store / v_store: the cache's storage (batch, kv_heads, slots, d) / (..., dv), head-major
            (each head's slots contiguous: ``KVCache._allocate``); slots past ``n`` are never read.
        softmax_scale: the score scale; None: d ** -0.5.

    Returns (batch, 1, heads, dv) in q's dtype. The result equals ``flash_attn(q, k, v, causal=False)``
    on the same slots up to float rounding (checked against the full forward, 1e-5 in float32).
    """
    b, _, heads, d = q.shape
    kv = k_store.shape[1]
    g = heads // kv
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    outs = []
    for lo, hi, n in plan:
        rows = hi - lo
        qg = q[lo:hi].reshape(rows * kv, g, d)
        keys = k_store[lo:hi, :, :n].flatten(0, 1)  # (rows * kv, n, d): a view (each head contiguous)
        values = v_store[lo:hi, :, :n].flatten(0, 1)
        scores = torch.baddbmm(qg.new_empty(()).expand(rows * kv, g, n), qg, keys.transpose(1, 2),
                               beta=0.0, alpha=scale)
        probs = torch.softmax(scores, dim=-1)
        outs.append(torch.bmm(probs, values).view(rows, 1, heads, -1))
    return outs[0] if len(outs) == 1 else torch.cat(outs)
