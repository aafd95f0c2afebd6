"""Mixture-of-experts math in plain PyTorch: the grouped GEMM over experts and token routing
(permute to expert order, unpermute weighted by the router scores). Float32 math for
float32/bf16/fp16 inputs, float64 for float64 ones; the ground truth the other backends are tested
against, and the fallback where no kernel takes a case.

Grouped GEMM (the layout of ``torch._grouped_mm``'s 2-D x 3-D "offs" form): tokens x (T, K) sorted by
expert, weights w (E, K, N), offsets (E,) int32 cumulative group ends, o_{-1} = 0. Group e is the
rows [o_{e-1}, o_e) of x:
    y[o_{e-1}:o_e] = x[o_{e-1}:o_e] @ w[e]                rows >= o_{E-1}: 0 (belong to no group)
Backward (the product rule of each group's matmul):
    dx[o_{e-1}:o_e] = dy[o_{e-1}:o_e] @ w[e]^T            dw[e] = x[o_{e-1}:o_e]^T @ dy[o_{e-1}:o_e]
(an empty group gives dw[e] = 0).

Routing (token choice, Shazeer et al. 2017; the layout of torchtitan's MoE): token t goes to the
experts expert_indices[t, j], j < top_k, with router score scores[t, j]. Slot s = t * top_k + j is
placed at row dst[t, j] of the permuted buffer, ordered by expert, slots of one expert in slot order
(a stable sort). With ``align`` > 1 every group is padded with zero rows to a multiple of align
(grouped GEMM kernels want whole tiles); the buffer has T * top_k + E * (align - 1) rows (a bound
that does not depend on the routing) and the rows past the last group are zero too.
    permute:    xp[dst[t, j]] = x[t]  (other rows 0; computed per row r from src, the inverse of dst)
    unpermute:  out[t] = sum_j scores[t, j] * yp[dst[t, j]]
Backward:  dx[t] = sum_j dxp[dst[t, j]];   dyp[dst[t, j]] = scores[t, j] * dout[t] (other rows 0);
           dscores[t, j] = <dout[t], yp[dst[t, j]]>.
"""
from __future__ import annotations

import torch


def acc_dtype(x: torch.Tensor) -> torch.dtype:
    # float32 math for float32/bf16/fp16; float64 inputs (tests, gradcheck) stay float64.
    return torch.promote_types(x.dtype, torch.float32)


def group_bounds(offsets: torch.Tensor) -> list[int]:
    """[0, o_0, ..., o_{E-1}] as Python ints (a host copy: the reference is not a fast path)."""
    return [0] + [int(o) for o in offsets.tolist()]


# ----------------------------------------------------------------------------- grouped GEMM


def grouped_mm_fwd(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """y (T, N) in x.dtype: each group's rows times its expert's weight; rows past the last group 0."""
    acc = acc_dtype(x)
    y = x.new_zeros((x.shape[0], w.shape[2]), dtype=acc)
    b = group_bounds(offsets)
    for e in range(w.shape[0]):
        if b[e + 1] > b[e]:
            torch.mm(x[b[e]:b[e + 1]].to(acc), w[e].to(acc), out=y[b[e]:b[e + 1]])
    return y.to(x.dtype)


def grouped_mm_bwd(dy, x, w, offsets, need_dx: bool = True, need_dw: bool = True):
    """(dx (T, K) in x.dtype or None, dw (E, K, N) in w.dtype or None), float32 accumulation."""
    acc = acc_dtype(x)
    b = group_bounds(offsets)
    dx = x.new_zeros(x.shape, dtype=acc) if need_dx else None
    dw = w.new_zeros(w.shape, dtype=acc) if need_dw else None
    for e in range(w.shape[0]):
        lo, hi = b[e], b[e + 1]
        if hi <= lo:
            continue
        dy_e = dy[lo:hi].to(acc)
        if need_dx:
            torch.mm(dy_e, w[e].to(acc).t(), out=dx[lo:hi])
        if need_dw:
            torch.mm(x[lo:hi].to(acc).t(), dy_e, out=dw[e])
    return (dx.to(x.dtype) if need_dx else None), (dw.to(w.dtype) if need_dw else None)


# ----------------------------------------------------------------------------- routing


def padded_rows(n_slots: int, num_experts: int, align: int) -> int:
    """Rows of the permuted buffer: every slot plus the worst-case padding of each group."""
    return n_slots + num_experts * (align - 1)


def routing_index(expert_indices: torch.Tensor, num_experts: int, align: int = 1):
    """Where each (token, choice) slot goes, vectorized (a stable argsort and a histogram, no loop).

    expert_indices: (T, top_k) integer, values in [0, num_experts). Returns
      dst (T, top_k) int64: the row of the permuted buffer of each slot;
      src (R,) int64, R = padded_rows(T * top_k, E, align): the slot t * top_k + j in each row, -1
          for a padding row (the inverse of dst);
      offsets (E,) int32: cumulative (padded) group ends;
      counts (E,) int64: tokens routed to each expert (unpadded).
    """
    flat = expert_indices.reshape(-1).long()
    n = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + (align - 1)) // align * align
    ends = torch.cumsum(padded, 0)
    starts_padded = ends - padded
    starts = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)  # slots by expert, slot order within an expert
    rank = torch.arange(n, device=flat.device)
    e_sorted = flat[order]
    dst = torch.empty(n, dtype=torch.int64, device=flat.device)
    dst[order] = starts_padded[e_sorted] + (rank - starts[e_sorted])
    src = torch.full((padded_rows(n, num_experts, align),), -1, dtype=torch.int64, device=flat.device)
    src[dst] = rank
    return dst.view(expert_indices.shape), src, ends.to(torch.int32), counts


def permute_rows(x, src, top_k: int, weights=None, dot_with=None):
    """out (R, D) in x.dtype: out[r] = weights[s] * x[s // top_k] for s = src[r] >= 0, else 0
    (weights None: 1). The permute forward (weights None) and the unpermute backward (weights =
    scores, the incoming gradient as x). With ``dot_with`` (R, D) also returns the per-slot dot
    products <x[s // top_k], dot_with[r]> as a (T, top_k) float32 tensor (the scores' gradient)."""
    acc = acc_dtype(x)
    if x.shape[0] * top_k == 0:  # no slot at all: every row is padding
        dots = x.new_zeros((x.shape[0], top_k), dtype=acc) if dot_with is not None else None
        return x.new_zeros((src.shape[0], x.shape[1])), dots
    valid = src >= 0
    s = src.clamp_min(0)
    rows = x.to(acc).index_select(0, s // top_k)
    out = rows
    if weights is not None:
        out = out * weights.reshape(-1).to(acc).index_select(0, s).unsqueeze(1)
    out = torch.where(valid.unsqueeze(1), out, 0).to(x.dtype)
    if dot_with is None:
        return out, None
    n = x.shape[0] * top_k
    d = (rows * dot_with.to(acc)).sum(1)
    dots = torch.zeros(n, dtype=acc, device=x.device)
    dots.index_copy_(0, src[valid], d[valid])
    return out, dots.view(x.shape[0], top_k)


def combine_rows(y: torch.Tensor, dst: torch.Tensor, weights: torch.Tensor | None = None):
    """out (T, D) in y.dtype: out[t] = sum_j weights[t, j] * y[dst[t, j]] (weights None: 1), float32
    accumulation. The unpermute forward (weights = scores) and the permute backward (weights None)."""
    acc = acc_dtype(y)
    g = y.to(acc).index_select(0, dst.reshape(-1)).view(dst.shape[0], dst.shape[1], y.shape[1])
    if weights is not None:
        g = g * weights.to(acc).unsqueeze(-1)
    return g.sum(1).to(y.dtype)
