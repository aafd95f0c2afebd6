"""SwiGLU in plain PyTorch, float32 math (float64 for float64 inputs).

Math (Shazeer 2020, "GLU Variants Improve Transformer", eq. 5; silu = x * sigmoid(x), Elfwing et al.
2017), elementwise over gate g and up u of the same shape, with s = sigmoid(g):
    y = silu(g) * u = g * s * u
Backward, with silu'(g) = s * (1 + g * (1 - s)):
    dg = dy * u * silu'(g),   du = dy * silu(g)
Second derivatives (used by double backward), with silu''(g) = s * (1 - s) * (2 + g * (1 - 2 s)):
    d(dg)/dg = dy * u * silu''(g),  d(dg)/du = d(du)/dg = dy * silu'(g),  d(du)/du = 0,
    d(dg)/d(dy) = u * silu'(g),     d(du)/d(dy) = silu(g)
"""
from __future__ import annotations

import torch


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    # float32 math for float32/bf16/fp16; float64 inputs (tests, gradcheck) stay float64.
    return torch.promote_types(x.dtype, torch.float32)


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """y = silu(gate) * up. gate, up: (..., H) of one dtype; returns a contiguous (..., H) tensor in
    that dtype, computed in float32 and rounded once."""
    acc = _acc_dtype(gate)
    y = torch.nn.functional.silu(gate.to(acc)).mul_(up.to(acc))
    return y.to(gate.dtype).contiguous()


def swiglu_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) of y = silu(gate) * up, sigmoid recomputed from gate (nothing else is saved).
    All (..., H) in gate.dtype, contiguous, computed in float32."""
    acc = _acc_dtype(gate)
    g, u, d = gate.to(acc), up.to(acc), dy.to(acc)
    s = torch.sigmoid(g)
    silu = g * s
    dup = d * silu
    # silu'(g) = s + g s (1 - s) = s (1 + g (1 - s)); computed in place to keep one temporary.
    dgate = (1 - s).mul_(g).add_(1).mul_(s).mul_(u).mul_(d)
    return dgate.to(gate.dtype).contiguous(), dup.to(gate.dtype).contiguous()


def swiglu_bwd_bwd(
    ddgate: torch.Tensor | None,
    ddup: torch.Tensor | None,
    dy: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``swiglu_bwd`` with respect to (dy, gate, up), given the gradients ddgate, ddup
    flowing into its two outputs (None = zero). Plain differentiable aten ops, so higher orders work
    through autograd. Returns (d_dy, d_gate, d_up) in the dtypes of dy, gate, up."""
    acc = _acc_dtype(gate)
    g, u, d = gate.to(acc), up.to(acc), dy.to(acc)
    s = torch.sigmoid(g)
    silu = g * s
    dsilu = s * (1 + g * (1 - s))
    d2silu = s * (1 - s) * (2 + g * (1 - 2 * s))
    zero = torch.zeros((), dtype=acc, device=g.device)
    a = ddgate.to(acc) if ddgate is not None else zero
    b = ddup.to(acc) if ddup is not None else zero
    d_dy = a * u * dsilu + b * silu
    d_gate = a * d * u * d2silu + b * d * dsilu
    d_up = a * d * dsilu
    shape = gate.shape
    return (d_dy.expand(shape).to(dy.dtype), d_gate.expand(shape).to(gate.dtype), d_up.expand(shape).to(up.dtype))
