"""Float8 rowwise grouped GEMM over experts in plain PyTorch, float32 math: the quantizers and the two
scaled grouped GEMM forms every backend of ``titan::fp8_grouped_mm`` implements (the ground truth).

Layout as ``titan_kernels.reference.moe``: x (T, K) tokens sorted by expert, w (E, K, N), offsets
(E,) int32 cumulative group ends (group e = rows [o_{e-1}, o_e), o_{-1} = 0; rows >= o_{E-1} belong
to no group).

Quantization: dynamic e4m3 scaling (``reference.fp8``: amax floored at 1e-12, multiplier
448 / amax rounded down to a power of two, codes = saturated round-to-nearest-even cast, scale =
1 / multiplier), one scale per group of elements that a GEMM reduces over, so that every scale
factors out of its dot products:
    rows(t)          t (T, C): one scale per row over C                      -> codes (T, C), scale (T,)
    w_fwd(w)         w (E, K, N): one per (expert, column n) over K          -> codes (E, K, N), scale (E, N)
    w_dgrad(w)       w (E, K, N): one per (expert, row k) over N             -> codes (E, K, N), scale (E, K)
    group_cols(t)    t (T, C): one per (group e, column c) over the group's rows -> codes (T, C), scale (E, C)
Scaled grouped GEMMs (float32 accumulation, rounded once to the output dtype):
    gmm:     out[rows of e] = (a * sa[:, None])[rows of e] @ (b[e] * sb[e][None, :])
             a (T, Kc), sa (T,), b (E, Kc, No), sb (E, No) -> (T, No); rows past the last group 0
    gmm_dw:  out[e] = (a * sa[e])[rows of e]^T @ (b * sb[e])[rows of e]
             a (T, Kd), sa (E, Kd), b (T, Nd), sb (E, Nd) -> (E, Kd, Nd); an empty group gives 0
The training GEMMs of y[group e] = x[group e] @ w[e] (torchao's float8 rowwise MoE recipe):
    forward  y  = gmm(rows(x), w_fwd(w))                       reduce over K
    dgrad    dx = gmm(rows(dy), w_dgrad(w)^T)                  reduce over N
    wgrad    dw = gmm_dw(group_cols(x), group_cols(dy))        reduce over each group's tokens
"""
from __future__ import annotations

import torch

from titan_kernels.reference.fp8 import cast_with_mult, scale_from_amax
from titan_kernels.reference.moe import group_bounds

E4M3 = torch.float8_e4m3fn
POW2 = True  # scales rounded to powers of two, as torchao's rowwise recipes do


def _scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return scale_from_amax(amax, E4M3, POW2)


def _amax(t: torch.Tensor, dim: int) -> torch.Tensor:
    a = t.float().abs()
    if a.shape[dim] == 0:
        shape = list(a.shape)
        shape[dim] = 1
        return a.new_zeros(shape)
    return a.amax(dim=dim, keepdim=True)


def rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes (T, C) row-major e4m3, scale (T,) float32): one scale per row of t (T, C)."""
    mult, scale = _scales(_amax(t, 1))
    return cast_with_mult(t, mult, E4M3).contiguous(), scale.reshape(-1)


def w_fwd(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes (E, K, N), scale (E, N)): one scale per (expert, output column) over K. The codes are
    column-major per expert (strides (K*N, 1, K)), the layout torch._scaled_grouped_mm takes."""
    e, k, n = w.shape
    mult, scale = _scales(_amax(w, 1))  # (E, 1, N)
    codes = torch.empty((e, n, k), dtype=E4M3, device=w.device).transpose(1, 2)
    codes.copy_(cast_with_mult(w, mult, E4M3))
    return codes, scale.reshape(e, n)


def w_dgrad(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes (E, K, N) row-major, scale (E, K)): one scale per (expert, row k) over N, for
    dx = dy @ w^T (whose reduction runs over N)."""
    e, k, _ = w.shape
    mult, scale = _scales(_amax(w, 2))  # (E, K, 1)
    return cast_with_mult(w, mult, E4M3).contiguous(), scale.reshape(e, k)


def group_ids(offsets: torch.Tensor, t: int) -> torch.Tensor:
    """(T,) int64: the group of each row (E for rows past the last group), on the device, no sync."""
    r = torch.arange(t, device=offsets.device, dtype=torch.int32)
    return torch.searchsorted(offsets, r, right=True)


def group_cols(t: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes (T, C) column-major (strides (1, T)), scale (E, C)): one scale per (group, column)
    over the group's rows, for the weight gradient (whose reduction runs over a group's tokens).
    An empty group gets the scale of amax 0; rows past the last group get zero codes."""
    n_rows, c = t.shape
    e = offsets.shape[0]
    gid = group_ids(offsets, n_rows)
    amax = torch.zeros((e + 1, c), dtype=torch.float32, device=t.device)
    if n_rows and c:
        amax.scatter_reduce_(0, gid.unsqueeze(1).expand(n_rows, c), t.float().abs(), "amax", include_self=True)
    mult, scale = _scales(amax[:e])
    mult = torch.cat([mult, mult.new_zeros((1, c))])  # rows past the last group: codes 0
    codes = torch.empty((c, n_rows), dtype=E4M3, device=t.device).t()
    codes.copy_(cast_with_mult(t, mult.index_select(0, gid), E4M3))
    return codes, scale


def gmm(a, sa, b, sb, offsets, out_dtype: torch.dtype) -> torch.Tensor:
    """out (T, No) in out_dtype = per group (a * sa[:, None]) @ (b[e] * sb[e]); see the module docstring."""
    out = torch.zeros((a.shape[0], b.shape[2]), dtype=torch.float32, device=a.device)
    bounds = group_bounds(offsets)
    if a.shape[0]:
        deq = a.float() * sa.float().reshape(-1, 1)
        for e in range(b.shape[0]):
            lo, hi = bounds[e], bounds[e + 1]
            if hi > lo:
                torch.mm(deq[lo:hi], b[e].float() * sb[e].float().reshape(1, -1), out=out[lo:hi])
    return out.to(out_dtype)


def gmm_dw(a, sa, b, sb, offsets, out_dtype: torch.dtype) -> torch.Tensor:
    """out (E, Kd, Nd) in out_dtype = per group (a[rows] * sa[e])^T @ (b[rows] * sb[e])."""
    e_count = offsets.shape[0]
    out = torch.zeros((e_count, a.shape[1], b.shape[1]), dtype=torch.float32, device=a.device)
    bounds = group_bounds(offsets)
    for e in range(e_count):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            torch.mm((a[lo:hi].float() * sa[e].float()).t(), b[lo:hi].float() * sb[e].float(), out=out[e])
    return out.to(out_dtype)
