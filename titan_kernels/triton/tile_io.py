"""Loads and stores of 2-D tiles, shared by the row-wise Triton kernels (RMSNorm, SwiGLU).

``rows`` and ``cols`` are the tile's row and column indices (int64 where tensors may exceed 2^31
elements), ``mask`` its (rows, cols) bounds. These are @triton.jit helpers: Triton inlines them, so a
kernel compiles to what it would with the expressions written in place.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_2d(P, rows, cols, stride_m, stride_n, mask):
    """The tile of a strided 2-D tensor in its storage dtype, 0 where masked."""
    return tl.load(P + rows[:, None] * stride_m + cols[None, :] * stride_n, mask=mask, other=0.0)


@triton.jit
def store_rows(P, rows, cols, N, value, mask):
    """Stores the tile into a contiguous (M, N) tensor, converted to its dtype."""
    tl.store(P + rows[:, None] * N + cols[None, :], value.to(P.dtype.element_ty), mask=mask)
