"""Flux's parts: the timestep sinusoid, the conditioning MLPs, the three-axis rotary table, AdaLN
modulation, the QK-normed projections of one stream and the joint attention.

Sources: Black Forest Labs' ``flux/modules/layers.py`` (``timestep_embedding``, ``EmbedND``,
``MLPEmbedder``, ``Modulation``) and diffusers' ``FluxTransformer2DModel``, whose numbers the unit
tests compare against.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import titan_kernels
from titan_kernels.nn import RMSNorm

TIME_FACTOR = 1000.0  # t in [0, 1] (and the guidance) are scaled by 1000 before the sinusoid
TIME_CHANNELS = 256


def timestep_embedding(t: torch.Tensor, dim: int = TIME_CHANNELS, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoid of ``t`` (batch,) (already scaled by ``TIME_FACTOR``): (batch, dim) float32, cosines
    first, frequencies ``max_period ** (-i / (dim / 2))`` (DDPM's embedding as FLUX.1 lays it out).
    The phases are formed in float32 whatever t's dtype, as the references do."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class MLPEmbedder(nn.Module):
    """``out_layer(silu(in_layer(x)))``: the timestep, guidance and pooled-text embedders (biases on both)."""

    def __init__(self, in_dim: int, dim: int) -> None:
        super().__init__()
        self.in_layer = nn.Linear(in_dim, dim)
        self.out_layer = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_layer(F.silu(self.in_layer(x)))


def rope_tables(ids: torch.Tensor, axes_dim: tuple[int, ...], theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (tokens, head_dim // 2) float32 of the three-axis rotary of positions ``ids``
    (tokens, 3) (any real dtype): pair i of axis a turns by ``ids[:, a] * theta ** (-2i / axes_dim[a])``,
    the axes' pairs one after another (FLUX.1's ``EmbedND``). Computed in float64 (as diffusers does
    off Apple GPUs), then rounded once. Each token's row is then picked by ``position_ids`` in
    ``titan_kernels.apply_rotary_emb`` (the interleaved-pair layout)."""
    if ids.dim() != 2 or ids.shape[1] != len(axes_dim):
        raise ValueError(f"ids: expected shape (tokens, {len(axes_dim)}), got {tuple(ids.shape)}")
    angles = []
    for a, d in enumerate(axes_dim):
        freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64, device=ids.device) / d)
        angles.append(ids[:, a].to(torch.float64)[:, None] * freqs[None])
    ang = torch.cat(angles, dim=-1)
    return torch.cos(ang).float(), torch.sin(ang).float()


class Modulation(nn.Module):
    """AdaLN: ``lin(silu(vec))`` split into ``n`` (batch, 1, dim) chunks (shift, scale, gate, ...)."""

    def __init__(self, dim: int, n: int) -> None:
        super().__init__()
        self.n = n
        self.lin = nn.Linear(dim, n * dim)

    def forward(self, vec: torch.Tensor) -> list[torch.Tensor]:
        return list(self.lin(F.silu(vec))[:, None, :].chunk(self.n, dim=-1))


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``LayerNorm(x) * (1 + scale) + shift`` with a weightless LayerNorm over the last dim."""
    return F.layer_norm(x, x.shape[-1:], eps=eps) * (1 + scale) + shift


class QKV(nn.Module):
    """One stream's q, k, v projections (biases on) and its QK RMSNorm over head_dim (our
    ``rms_norm``): x (batch, seq, dim) -> q, k, v (batch, seq, heads, head_dim); under tensor
    parallel a rank's projections give its heads only (-1 heads)."""

    def __init__(self, dim: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, dim)
        self.wk = nn.Linear(dim, dim)
        self.wv = nn.Linear(dim, dim)
        self.q_norm = RMSNorm(head_dim, eps=eps)
        self.k_norm = RMSNorm(head_dim, eps=eps)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        return self.q_norm(q), self.k_norm(k), v


class Rope(nn.Module):
    """The joint sequence's rotary tables for one forward (``set``), shared by every block as a module
    (so FSDP2's mixed precision never casts them): cos/sin (tokens, head_dim // 2) float32."""

    def __init__(self) -> None:
        super().__init__()
        self.cos = self.sin = None
        self.position_ids: torch.Tensor | None = None

    def set(self, cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor | None = None) -> None:
        """``position_ids``: the rows of this rank's tokens (context parallel), None for 0..tokens-1."""
        self.cos, self.sin, self.position_ids = cos, sin, position_ids

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return titan_kernels.apply_rotary_emb(q, k, self.cos, self.sin, interleaved=True,
                                              position_ids=self.position_ids)


def joint_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope,
                    context_parallel=None) -> torch.Tensor:
    """Non-causal attention over the joint sequence (batch, seq, heads, head_dim), rotary applied
    first: ``titan_kernels.flash_attn(causal=False)``, or the ring over the context-parallel ranks.
    Returns (batch, seq, heads * head_dim)."""
    q, k = rope(q, k)
    if context_parallel is not None:
        out = context_parallel(q, k, v, causal=False)
    else:
        out = titan_kernels.flash_attn(q, k, v, causal=False)
    return out.flatten(2)
