"""SwiGLU in plain PyTorch, float32 math (float64 for float64 inputs), plain and clamped (GPT-OSS).

Plain SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer", eq. 5; silu = x * sigmoid(x),
Elfwing et al. 2017), elementwise over gate g and up u of the same shape, with s = sigmoid(g):
    y = silu(g) * u = g * s * u
Backward, with silu'(g) = s * (1 + g * (1 - s)):
    dg = dy * u * silu'(g),   du = dy * silu(g)
Second derivatives (used by double backward), with silu''(g) = s * (1 - s) * (2 + g * (1 - 2 s)):
    d(dg)/dg = dy * u * silu''(g),  d(dg)/du = d(du)/dg = dy * silu'(g),  d(du)/du = 0,
    d(dg)/d(dy) = u * silu'(g),     d(du)/d(dy) = silu(g)

Clamped variant (OpenAI gpt-oss reference and Hugging Face ``GptOssExperts._apply_gate``; GPT-OSS
uses alpha 1.702, limit 7, up_offset 1), with sw(x) = x * sigmoid(alpha x):
    g_c = min(g, limit),  u_c = clamp(u, -limit, limit),  y = (u_c + up_offset) * sw(g_c)
The clamps follow torch.clamp's gradient convention: the gradient passes where g <= limit and
where -limit <= u <= limit (bounds included), and is 0 elsewhere, NaN inputs included. With
m_g, m_u those masks, s = sigmoid(alpha g_c) and v = u_c + up_offset:
    sw'(x)  = s * (1 + alpha x (1 - s)),   sw''(x) = alpha s (1 - s) (2 + alpha x (1 - 2 s))
    dg = dy * v * sw'(g_c) * m_g,          du = dy * sw(g_c) * m_u
The masks are piecewise constant, so the second derivatives are the plain ones with sw in place of
silu, v in place of u, and the masks applied to their variables. With alpha 1, no limit and
up_offset 0 the variant is the plain SwiGLU, which keeps its own code path (bit for bit as before).
"""
from __future__ import annotations

import torch


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    # float32 math for float32/bf16/fp16; float64 inputs (tests, gradcheck) stay float64.
    return torch.promote_types(x.dtype, torch.float32)


def is_plain(alpha: float, limit: float | None, up_offset: float) -> bool:
    """True for the plain SwiGLU (alpha 1, no limit, up_offset 0), which every backend runs on its own
    unchanged path."""
    return alpha == 1.0 and limit is None and up_offset == 0.0


def _clamped(g: torch.Tensor, u: torch.Tensor, limit: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    # torch.clamp keeps NaN (and differentiates with inclusive bounds, as the masks below do).
    if limit is None:
        return g, u
    return g.clamp(max=limit), u.clamp(-limit, limit)


def _masks(g: torch.Tensor, u: torch.Tensor, limit: float | None):
    """(m_g, m_u), boolean: where the gradient passes the clamps (False at NaN, as in torch.clamp's
    backward); (None, None) without a limit. Applied with torch.where, so a NaN elsewhere in the
    product gives 0 where the mask is False, exactly as torch.clamp's backward."""
    if limit is None:
        return None, None
    return g <= limit, (u >= -limit) & (u <= limit)


def swiglu_fwd(
    gate: torch.Tensor, up: torch.Tensor, alpha: float = 1.0, limit: float | None = None, up_offset: float = 0.0
) -> torch.Tensor:
    """y = (clamp(up) + up_offset) * min(gate, limit) * sigmoid(alpha * min(gate, limit)); plain
    silu(gate) * up by default. gate, up: (..., H) of one dtype; returns a contiguous (..., H) tensor in
    that dtype, computed in float32 and rounded once."""
    acc = _acc_dtype(gate)
    if is_plain(alpha, limit, up_offset):
        y = torch.nn.functional.silu(gate.to(acc)).mul_(up.to(acc))
        return y.to(gate.dtype).contiguous()
    g, u = _clamped(gate.to(acc), up.to(acc), limit)
    y = torch.sigmoid(alpha * g).mul_(g).mul_(u + up_offset)
    return y.to(gate.dtype).contiguous()


def swiglu_bwd(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, alpha: float = 1.0, limit: float | None = None,
    up_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) of ``swiglu_fwd`` with the same scalars, sigmoid recomputed from gate (nothing else
    is saved). All (..., H) in gate.dtype, contiguous, computed in float32."""
    acc = _acc_dtype(gate)
    g, u, d = gate.to(acc), up.to(acc), dy.to(acc)
    if is_plain(alpha, limit, up_offset):
        s = torch.sigmoid(g)
        silu = g * s
        dup = d * silu
        # silu'(g) = s + g s (1 - s) = s (1 + g (1 - s)); computed in place to keep one temporary.
        dgate = (1 - s).mul_(g).add_(1).mul_(s).mul_(u).mul_(d)
        return dgate.to(gate.dtype).contiguous(), dup.to(gate.dtype).contiguous()
    m_g, m_u = _masks(g, u, limit)
    g, u = _clamped(g, u, limit)
    s = torch.sigmoid(alpha * g)
    dup = d * (g * s)
    dgate = (1 - s).mul_(g).mul_(alpha).add_(1).mul_(s).mul_(u + up_offset).mul_(d)
    if limit is not None:
        dup = torch.where(m_u, dup, 0.0)
        dgate = torch.where(m_g, dgate, 0.0)
    return dgate.to(gate.dtype).contiguous(), dup.to(gate.dtype).contiguous()


def swiglu_bwd_bwd(
    ddgate: torch.Tensor | None,
    ddup: torch.Tensor | None,
    dy: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    alpha: float = 1.0,
    limit: float | None = None,
    up_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``swiglu_bwd`` with respect to (dy, gate, up), given the gradients ddgate, ddup
    flowing into its two outputs (None = zero). Plain differentiable aten ops (the clamps through
    torch.clamp, the masks constant), so higher orders work through autograd. Returns (d_dy, d_gate,
    d_up) in the dtypes of dy, gate, up."""
    acc = _acc_dtype(gate)
    g, u, d = gate.to(acc), up.to(acc), dy.to(acc)
    m_g, m_u = _masks(g, u, limit)
    g, u = _clamped(g, u, limit)
    v = u + up_offset if up_offset != 0.0 else u
    ag = alpha * g if alpha != 1.0 else g
    s = torch.sigmoid(ag)
    sw = g * s
    dsw = s * (1 + ag * (1 - s))
    d2sw = s * (1 - s) * (2 + ag * (1 - 2 * s))
    if alpha != 1.0:
        d2sw = alpha * d2sw
    zero = torch.zeros((), dtype=acc, device=g.device)
    a = ddgate.to(acc) if ddgate is not None else zero
    b = ddup.to(acc) if ddup is not None else zero
    if m_g is not None:  # ddgate reaches only where gate passed its clamp, ddup where up did
        a = torch.where(m_g, a, 0.0)
        b = torch.where(m_u, b, 0.0)
    d_dy = a * v * dsw + b * sw
    d_gate = a * d * v * d2sw + b * d * dsw
    d_up = a * d * dsw
    if m_g is not None:
        d_gate = torch.where(m_g, d_gate, 0.0)
        d_up = torch.where(m_u, d_up, 0.0)
    shape = gate.shape
    return (d_dy.expand(shape).to(dy.dtype), d_gate.expand(shape).to(gate.dtype), d_up.expand(shape).to(up.dtype))
