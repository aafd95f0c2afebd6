"""Rotary position embedding (RoPE) in plain PyTorch, float32 math (or float64 for float64 inputs).

Math (Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding", eq. 34):
each pair (x1, x2) of a head vector is rotated by the angle theta = position * freq_i,
    y1 = x1 cos(theta) - x2 sin(theta),   y2 = x2 cos(theta) + x1 sin(theta).
The pairs are (2i, 2i+1) in the interleaved layout (Meta's llama reference, torchtitan: a complex
multiplication) and (i, i + R) in the rotate-half layout (Hugging Face), for i < R = rotary_dim / 2.
Dims past rotary_dim pass through unchanged. A rotation is orthogonal, so the backward is the
rotation by -theta: the same formula with -sin.

Contract shared by every backend (``rotary_fwd`` / ``rotary_bwd``):
  q (batch, seq, n_heads, head_dim), k (batch, seq, n_kv_heads, head_dim), any strides;
  cos, sin (max_positions, R) float32; position_ids None (= arange(seq)), (seq,) or (batch, seq) int.
  Returns new contiguous tensors of the input shapes and dtype. A position outside
  [0, max_positions) is never read: its rotated dims come out NaN (the public op raises before that
  in eager mode).
"""
from __future__ import annotations

import torch


def _table_rows(
    table: torch.Tensor, position_ids: torch.Tensor | None, seq: int, dtype: torch.dtype
) -> torch.Tensor:
    """Rows of cos or sin for every token, shaped (1 or batch, seq, 1, R) to broadcast over heads."""
    if position_ids is None:
        rows = table[:seq].to(dtype)
    else:
        n = table.shape[0]
        p = position_ids.long()
        valid = (p >= 0) & (p < n)
        # Clamp so the gather stays in bounds; the out-of-range rows are then replaced by NaN.
        rows = table[p.clamp(0, max(n - 1, 0))].to(dtype) if n > 0 else table.new_empty((*p.shape, table.shape[1]))
        rows = torch.where(valid.unsqueeze(-1), rows, torch.full_like(rows, float("nan")))
    if rows.dim() == 2:
        rows = rows.unsqueeze(0)
    return rows.unsqueeze(-2)


def _rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, sign: float
) -> torch.Tensor:
    half = cos.shape[-1]
    rd = 2 * half
    dtype = torch.promote_types(torch.promote_types(x.dtype, cos.dtype), torch.float32)
    xr = x[..., :rd].to(dtype)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
    s = sin * sign
    y1 = x1 * cos - x2 * s
    y2 = x2 * cos + x1 * s
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous, whatever x's strides
    if interleaved:
        out[..., 0:rd:2] = y1
        out[..., 1:rd:2] = y2
    else:
        out[..., :half] = y1
        out[..., half:rd] = y2
    out[..., rd:] = x[..., rd:]
    return out


def _apply(q, k, cos, sin, position_ids, interleaved, sign):
    dtype = torch.promote_types(torch.promote_types(q.dtype, cos.dtype), torch.float32)
    c = _table_rows(cos, position_ids, q.shape[1], dtype)
    s = _table_rows(sin, position_ids, q.shape[1], dtype)
    return _rotate(q, c, s, interleaved, sign), _rotate(k, c, s, interleaved, sign)


def rotary_fwd(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               position_ids: torch.Tensor | None, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (batch, seq, n_heads, head_dim) and k (batch, seq, n_kv_heads, head_dim) by the
    angles in cos/sin (max_positions, R) at ``position_ids``. Returns (q_out, k_out), contiguous,
    in the input dtypes."""
    return _apply(q, k, cos, sin, position_ids, interleaved, 1.0)


def rotary_bwd(dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               position_ids: torch.Tensor | None, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``rotary_fwd`` with respect to q and k: the rotation by -theta of (dq, dk)."""
    return _apply(dq, dk, cos, sin, position_ids, interleaved, -1.0)
