"""Triton kernels of the Newton-Schulz iteration (math: titan_kernels/reference/newton_schulz.py).

Each step is three products on X (r x c, r <= c, batched over a leading dim):
    A = X X^T             ``_sym_kernel``: symmetric, so only the tiles on and below the diagonal
                          are computed and each is stored twice (itself and its mirror)
    B = b A + c A A       the same kernel on A (A A = A A^T since A is symmetric), with C = A
    X' = a X + B X        ``_mm_kernel``: a plain tiled GEMM with the a X epilogue
The symmetric kernel halves the FLOPs of the first two products: a step costs 3 r^2 c + r^3
multiply-adds x 2 instead of 4 r^2 c + 2 r^3 (a square matrix: 2/3 of the work). Products
accumulate in float32; operands and results are in the iteration's dtype (bf16 on GPUs: tensor
cores; float32 runs IEEE products, not TF32). Tiles: ``config(dtype)``; rows, columns and K are
masked, so any shape runs (1-row, odd sizes).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from titan_kernels.triton import triton_interpret


@triton.jit
def _dot(a, b, acc, F32_DOT: tl.constexpr):
    # F32_DOT: float32 operands (IEEE products, not TF32), and 16-bit ones in the interpreter, which
    # multiplies bfloat16 blocks as raw bits (numpy has no bfloat16); compiled 16-bit code runs
    # them on the tensor cores.
    if F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


def _f32_dot(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or triton_interpret()


@triton.jit
def _tri_index(pid):
    # Tile pair (i, j), j <= i, of linear index pid = i (i + 1) / 2 + j.
    i = ((tl.sqrt(8.0 * pid.to(tl.float32) + 1.0) - 1.0) * 0.5).to(tl.int32)
    i = tl.where((i + 1) * (i + 2) // 2 <= pid, i + 1, i)
    i = tl.where(i * (i + 1) // 2 > pid, i - 1, i)
    return i, pid - i * (i + 1) // 2


@triton.jit
def _mm_acc(acc, A, B, rows, cols, M, N, K, s_am, s_ak, s_bk, s_bn, F32_DOT: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + A[rows, :K] @ B[:K, cols] in float32, masked to rows < M, cols < N and K."""
    ks = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        a = tl.load(A + rows[:, None] * s_am + kk[None, :] * s_ak, mask=(rows < M)[:, None] & (kk < K)[None, :],
                    other=0.0)
        b = tl.load(B + kk[:, None] * s_bk + cols[None, :] * s_bn, mask=(kk < K)[:, None] & (cols < N)[None, :],
                    other=0.0)
        acc = _dot(a, b, acc, F32_DOT)
    return acc


@triton.jit
def _sym_kernel(
    X, C, OUT, R, K,
    sxb, sxr, sxk, scb, scr, scc, sob, sor, soc,
    alpha, beta,
    HAS_C: tl.constexpr, F32_DOT: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """OUT = alpha X X^T (+ beta C) for X (R, K); tile (i, j <= i) stored at (i, j) and (j, i)."""
    ti, tj = _tri_index(tl.program_id(0))
    bz = tl.program_id(1).to(tl.int64)
    rows = ti * BLOCK + tl.arange(0, BLOCK)
    cols = tj * BLOCK + tl.arange(0, BLOCK)
    xb = X + bz * sxb
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    acc = _mm_acc(acc, xb, xb, rows, cols, R, R, K, sxr, sxk, sxk, sxr, F32_DOT, BLOCK_K)  # X X^T
    out = alpha * acc
    mask = (rows < R)[:, None] & (cols < R)[None, :]
    if HAS_C:
        cv = tl.load(C + bz * scb + rows[:, None] * scr + cols[None, :] * scc, mask=mask, other=0.0)
        out += beta * cv.to(tl.float32)
    out = out.to(OUT.dtype.element_ty)
    ob = OUT + bz * sob
    tl.store(ob + rows[:, None] * sor + cols[None, :] * soc, out, mask=mask)
    if ti != tj:
        tl.store(ob + rows[:, None] * soc + cols[None, :] * sor, out, mask=mask)


@triton.jit
def _mm_kernel(
    Bm, X, OUT, R, N,
    sbb, sbr, sbk, sxb, sxr, sxc, sob, sor, soc,
    a_coef,
    F32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """OUT = Bm @ X + a_coef X for Bm (R, R), X (R, N)."""
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    bz = tl.program_id(2).to(tl.int64)
    rows = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    xb = X + bz * sxb
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _mm_acc(acc, Bm + bz * sbb, xb, rows, cols, R, N, R, sbr, sbk, sxr, sxc, F32_DOT, BLOCK_K)
    mask = (rows < R)[:, None] & (cols < N)[None, :]
    xv = tl.load(xb + rows[:, None] * sxr + cols[None, :] * sxc, mask=mask, other=0.0)
    out = acc + a_coef * xv.to(tl.float32)
    tl.store(OUT + bz * sob + rows[:, None] * sor + cols[None, :] * soc, out.to(OUT.dtype.element_ty), mask=mask)


def config(dtype: torch.dtype) -> dict:
    """Tiles and warps: 128 x 128 x 64 for 16-bit operands on a GPU, 64 x 64 x 32 in float32, 32 in
    the interpreter (numpy runs the tiles; small tests)."""
    if triton_interpret():
        return {"block": 32, "block_k": 32, "num_warps": 4, "num_stages": 1}
    if dtype == torch.float32:
        return {"block": 64, "block_k": 32, "num_warps": 4, "num_stages": 3}
    return {"block": 128, "block_k": 64, "num_warps": 8, "num_stages": 3}


def sym_product(x: torch.Tensor, out: torch.Tensor, alpha: float = 1.0, c: torch.Tensor | None = None,
                beta: float = 0.0) -> torch.Tensor:
    """out = alpha x x^T (+ beta c) for x (B, R, K) -> out (B, R, R); returns out."""
    bsz, r, k = x.shape
    cfg = config(x.dtype)
    t = triton.cdiv(r, cfg["block"])
    cc = c if c is not None else out
    _sym_kernel[(t * (t + 1) // 2, bsz)](
        x, cc, out, r, k, *x.stride(), *cc.stride(), *out.stride(), alpha, beta,
        HAS_C=c is not None, F32_DOT=_f32_dot(x.dtype), BLOCK=cfg["block"], BLOCK_K=cfg["block_k"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


def mm_axpy(bm: torch.Tensor, x: torch.Tensor, out: torch.Tensor, a: float) -> torch.Tensor:
    """out = bm @ x + a x for bm (B, R, R), x (B, R, N); returns out."""
    bsz, r, n = x.shape
    cfg = config(x.dtype)
    blk = cfg["block"]
    grid = (triton.cdiv(r, blk), triton.cdiv(n, blk), bsz)
    _mm_kernel[grid](
        bm, x, out, r, n, *bm.stride(), *x.stride(), *out.stride(), a,
        F32_DOT=_f32_dot(x.dtype), BLOCK_M=blk, BLOCK_N=blk, BLOCK_K=cfg["block_k"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


def newton_schulz(g: torch.Tensor, steps: int, a: float, b: float, c: float, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """Triton backend of ``titan::newton_schulz``: the iteration in ``dtype`` (float32 / bfloat16 /
    float16); returns a contiguous tensor of g's shape and dtype. The normalisation is aten's."""
    from titan_kernels.reference.newton_schulz import normalized_wide

    if g.numel() == 0:
        return torch.zeros_like(g, memory_format=torch.contiguous_format)
    x, tall = normalized_wide(g, eps, dtype)
    lead = x.shape[:-2]
    x = x.reshape(-1, *x.shape[-2:]).contiguous()
    bsz, r, _ = x.shape
    am = torch.empty(bsz, r, r, device=x.device, dtype=dtype)
    bmat = torch.empty_like(am)
    nxt = torch.empty_like(x)
    for _ in range(steps):
        sym_product(x, am)
        sym_product(am, bmat, alpha=c, c=am, beta=b)
        mm_axpy(bmat, x, nxt, a)
        x, nxt = nxt, x
    x = x.reshape(*lead, *x.shape[-2:])
    return (x.mT if tall else x).to(g.dtype).contiguous()
