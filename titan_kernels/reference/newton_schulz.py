"""Newton-Schulz orthogonalisation in plain PyTorch: the ground truth of ``titan::newton_schulz``.

Math (Jordan et al., "Muon: An optimizer for hidden layers in neural networks", 2024; the quintic
iteration of ``torch.optim.Muon``), for each matrix G (m x n) of a (..., m, n) batch:
    X <- G / max(||G||_F, eps)                 (spectral norm <= 1; the norm taken scale-safely,
                                               ``normalized_wide``: any finite G, huge or tiny)
    X <- X^T if m > n                          (work on the wide side: X is r x c, r <= c)
    repeat ``steps`` times:
        A <- X X^T                             (r x r, symmetric)
        B <- b A + c A A
        X <- a X + B X
    return X (transposed back)
with (a, b, c) = (3.4445, -4.7750, 2.0315): the odd polynomial p(s) = a s + b s^3 + c s^5 applied to
every singular value, which drives them into about [0.7, 1.2] in 5 steps (not exactly 1: Jordan's
choice of a steep slope at zero). The result approximates U V^T of the SVD G = U S V^T.

FLOPs per step: 2 r^2 c (A) + 2 r^3 (A A) + 2 r^2 c (B X) = 4 r^2 c + 2 r^3 (``flops``).
"""
from __future__ import annotations

import torch

COEFFICIENTS = (3.4445, -4.7750, 2.0315)
STEPS = 5
EPS = 1e-7


def newton_schulz_flops(m: int, n: int, steps: int = STEPS, batch: int = 1) -> float:
    """FLOPs (multiply-adds x 2) of ``steps`` Newton-Schulz iterations on ``batch`` matrices of m x n:
    each iteration on the wide r x c form (r = min(m, n)) costs A = X X^T (2 r^2 c), A A (2 r^3) and
    B X (2 r^2 c). Used for the time estimate of Muon's orthogonalisation (module docstring)."""
    r, c = min(m, n), max(m, n)
    return batch * steps * (4.0 * r * r * c + 2.0 * r ** 3)


def normalized_wide(g: torch.Tensor, eps: float, dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """(X, transposed): ``g`` (..., m, n) divided by its per-matrix Frobenius norm (at least eps),
    in ``dtype``, transposed to (..., n, m) when m > n. The norm is taken in float32 (float64 input:
    float64), scale-safely: each matrix is first divided by the power of two just above its largest
    |entry| (exact: only the exponents change), so the squares neither overflow (float32 entries from
    about 1.8e19: ||G||^2 would be inf and X zero) nor underflow (entries below about 1e-19: ||G||^2
    would be 0). Hence X is the same for G and c G, c > 0, as long as ||c G||_F >= eps; a matrix with
    ||G||_F < eps (a zero matrix, a tiny update) gives G / eps: never blown up, zero stays zero.
    A non-finite entry makes the matrix non-finite (NaN)."""
    acc = torch.promote_types(g.dtype, torch.float32)
    ga = g.to(acc)
    big = ga.abs().amax(dim=(-2, -1), keepdim=True) if ga.numel() else ga.new_ones((*ga.shape[:-2], 1, 1))
    mantissa, _ = torch.frexp(big)  # big = mantissa * 2^e, mantissa in [0.5, 1)
    # 2^e exactly (a quotient that is representable is exact); dividing by it changes exponents only.
    scale = torch.where(big > 0, big / mantissa, 1.0)
    y = ga / scale  # entries in (-1, 1)
    norm_y = torch.linalg.vector_norm(y, dim=(-2, -1), keepdim=True)
    # ||G|| = scale ||y|| (inf when past the dtype's range: far above eps, where X = y / ||y||).
    small = scale * norm_y < eps
    x = torch.where(small, ga / eps, y / torch.where(small, 1.0, norm_y)).to(dtype)
    tall = g.shape[-2] > g.shape[-1]
    return (x.mT if tall else x), tall


def newton_schulz(g: torch.Tensor, steps: int = STEPS, a: float = COEFFICIENTS[0], b: float = COEFFICIENTS[1],
                  c: float = COEFFICIENTS[2], eps: float = EPS) -> torch.Tensor:
    """The iteration of the module docstring on every matrix of ``g`` (..., m, n), in float32 (float64
    for float64 input); returns a new contiguous tensor of g's shape and dtype."""
    acc = torch.promote_types(g.dtype, torch.float32)
    x, tall = normalized_wide(g, eps, acc)
    for _ in range(steps):
        am = x @ x.mT
        bm = b * am + c * (am @ am)
        x = a * x + bm @ x
    return (x.mT if tall else x).to(g.dtype).contiguous()
