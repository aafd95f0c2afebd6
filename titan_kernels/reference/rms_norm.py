"""RMSNorm in plain PyTorch, float32 math (float64 for float64 inputs).

Math (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization", eq. 4), per row x of width N:
    rstd = 1 / sqrt(mean(x^2) + eps),   y = x * rstd * w
Backward, with xhat = x * rstd and g = dy * w:
    dx = rstd * (g - xhat * mean(g * xhat)),   dw = sum over rows of dy * xhat
"""
from __future__ import annotations

import torch


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    # float32 math for float32/bf16/fp16; float64 inputs (tests, gradcheck) stay float64.
    return torch.promote_types(x.dtype, torch.float32)


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
        h = (x + residual).contiguous()  # rounded to x.dtype, as the unfused `rms_norm(x + residual)` does
        x = h
    xf = x.to(_acc_dtype(x))
    # keepdim + in-place steps: fewer temporaries, since this is also the CPU eager fallback.
    rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True).add_(eps))
    y = xf * rstd
    if weight is not None:
        y.mul_(weight.to(xf.dtype))
    # Outputs are contiguous whatever the input strides, as every backend and the fake impl say.
    return y.to(x.dtype).contiguous(), h, rstd.squeeze(-1)


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
    acc = _acc_dtype(x)
    xhat = x.to(acc) * rstd.unsqueeze(-1)
    g = dy.to(acc)
    dw = None
    if compute_dweight and weight is not None:
        dw = (g * xhat).reshape(-1, n).sum(0).to(weight.dtype)
    if weight is not None:
        g = g * weight.to(acc)
    c = (g * xhat).mean(-1, keepdim=True)
    dx = (g - xhat * c) * rstd.unsqueeze(-1)
    if dresidual is not None:
        dx = dx + dresidual.to(acc)
    return dx.to(x.dtype).contiguous(), dw


def rms_norm_bwd_differentiable(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    dresidual: torch.Tensor | None,
    compute_dweight: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``rms_norm_bwd`` as differentiable aten ops, for double backward (create_graph=True).

    rstd is recomputed from x (not taken from the forward), so autograd sees its dependence on x
    and every derivative of (dx, dweight) with respect to (dy, x, weight, dresidual) is exact, to any
    order. Same shapes, dtypes and float32 math (float64 for float64 inputs) as ``rms_norm_bwd``.
    """
    xf = x.to(_acc_dtype(x))
    rstd = torch.rsqrt(xf.square().mean(-1) + eps)
    return rms_norm_bwd(dy, x, weight, rstd, dresidual, compute_dweight)
