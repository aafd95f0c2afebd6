"""RMSNorm in plain PyTorch, float32 math.

Math (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization", eq. 4), per row x of width N:
    rstd = 1 / sqrt(mean(x^2) + eps),   y = x * rstd * w
Backward, with xhat = x * rstd and g = dy * w:
    dx = rstd * (g - xhat * mean(g * xhat)),   dw = sum over rows of dy * xhat
"""
from __future__ import annotations

import torch


def rms_norm_fwd(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Forward of rms_norm / add_rms_norm.

    x, residual: (..., N) float32/bf16/fp16; weight: (N,) or None.
    Returns y (..., N) in x.dtype, h = x + residual in x.dtype (None without residual) and
    rstd (...,) float32.
    """
    h = None
    if residual is not None:
        h = x + residual  # rounded to x.dtype first, as the unfused `rms_norm(x + residual)` does
        x = h
    xf = x.float()
    rstd = torch.rsqrt(xf.square().mean(-1) + eps)
    y = xf * rstd.unsqueeze(-1)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype), h, rstd


def rms_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    dresidual: torch.Tensor | None,
    compute_dweight: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Backward of rms_norm: dx (..., N) in x.dtype (plus ``dresidual`` when given) and dweight (N,)
    in weight.dtype, accumulated in float32 (None unless ``compute_dweight``)."""
    n = x.shape[-1]
    xhat = x.float() * rstd.unsqueeze(-1)
    g = dy.float()
    dw = None
    if compute_dweight and weight is not None:
        dw = (g * xhat).reshape(-1, n).sum(0).to(weight.dtype)
    if weight is not None:
        g = g * weight.float()
    c = (g * xhat).mean(-1, keepdim=True)
    dx = (g - xhat * c) * rstd.unsqueeze(-1)
    if dresidual is not None:
        dx = dx + dresidual.float()
    return dx.to(x.dtype), dw
