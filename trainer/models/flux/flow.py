"""Rectified flow for Flux: latents packed into 2x2 patches and back, their position ids, the
training timesteps (logit-normal, shifted by the image token count), the noisy input and its
velocity target, and the sampler's sigma schedule and Euler step.

Sources: Esser et al. 2024 (SD3, "Scaling Rectified Flow Transformers"): ``x_t = (1 - t) x_0 + t eps``,
velocity ``eps - x_0``, logit-normal t; FLUX.1's ``time_shift(mu, 1, t) = e^mu / (e^mu + 1/t - 1)``
with ``mu`` linear in the image tokens from 0.5 at 256 tokens to 1.15 at 4096 (BFL's
``get_schedule``, diffusers' ``calculate_shift``); diffusers' ``FluxPipeline`` sampler: sigmas
``linspace(1, 1/N, N)`` shifted, a final 0, ``x <- x + (sigma_next - sigma) v``.
"""
from __future__ import annotations

import math

import torch

BASE_SEQ, MAX_SEQ, BASE_SHIFT, MAX_SHIFT = 256, 4096, 0.5, 1.15


def pack(x: torch.Tensor) -> torch.Tensor:
    """(b, c, H, W) latents -> (b, H/2 * W/2, 4c) patches, channel order (c, ph, pw), rows first.
    Raises ValueError for odd H or W."""
    b, c, h, w = x.shape
    if h % 2 or w % 2:
        raise ValueError(f"latents: height and width must be even for 2x2 patches, got {h}x{w}")
    return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), 4 * c)


def unpack(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Inverse of ``pack``: (b, height/2 * width/2, 4c) -> (b, c, height, width) (latent pixels)."""
    b, n, c4 = x.shape
    h, w = height // 2, width // 2
    if n != h * w or c4 % 4:
        raise ValueError(f"packed latents: expected (batch, {h * w}, 4c), got {tuple(x.shape)}")
    return x.view(b, h, w, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c4 // 4, height, width)


def image_ids(h: int, w: int, device=None) -> torch.Tensor:
    """(h * w, 3) float32 positions (0, row, col) of an h x w grid of patches."""
    ids = torch.zeros(h, w, 3, device=device)
    ids[..., 1] = torch.arange(h, device=device)[:, None]
    ids[..., 2] = torch.arange(w, device=device)[None, :]
    return ids.view(h * w, 3)


def text_ids(n: int, device=None) -> torch.Tensor:
    """(n, 3) zeros: the text tokens all sit at position 0 of every axis."""
    return torch.zeros(n, 3, device=device)


def shift_mu(image_tokens: int) -> float:
    """FLUX.1's resolution-dependent shift: linear from 0.5 at 256 image tokens to 1.15 at 4096."""
    m = (MAX_SHIFT - BASE_SHIFT) / (MAX_SEQ - BASE_SEQ)
    return image_tokens * m + (BASE_SHIFT - m * BASE_SEQ)


def time_shift(mu: float, t: torch.Tensor) -> torch.Tensor:
    """``e^mu / (e^mu + 1/t - 1)``: moves t towards 1 (noise) for mu > 0; keeps 0 and 1."""
    return math.exp(mu) / (math.exp(mu) + (1 / t - 1))


def sample_timesteps(u: torch.Tensor, kind: str, image_tokens: int, shift: bool, mean: float = 0.0,
                     std: float = 1.0) -> torch.Tensor:
    """Training timesteps t in (0, 1) from standard normal draws ``u`` (b,) float32: ``sigmoid(mean +
    std u)`` (logit-normal) or ``Phi(u)`` (uniform), then ``time_shift(shift_mu(image_tokens), t)``
    when ``shift``. Raises ValueError for an unknown kind."""
    if kind == "logit_normal":
        t = torch.sigmoid(mean + std * u)
    elif kind == "uniform":
        t = 0.5 * (1 + torch.erf(u / math.sqrt(2)))
    else:
        raise ValueError(f"flux.timestep_sampling: expected logit_normal or uniform, got {kind!r}")
    t = t.clamp(1e-5, 1 - 1e-5)
    return time_shift(shift_mu(image_tokens), t) if shift else t


def noisy(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_t, target)``: ``(1 - t) x0 + t noise`` and the velocity ``noise - x0``; t (b,) broadcasts."""
    tt = t.view(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
    return (1 - tt) * x0 + tt * noise, noise - x0


def sampling_sigmas(steps: int, image_tokens: int, dynamic_shift: bool, shift: float = 1.0) -> torch.Tensor:
    """The sampler's ``steps + 1`` sigmas, float32, from 1 down to a final 0: ``linspace(1, 1/steps, steps)``
    shifted dynamically by ``shift_mu(image_tokens)`` (flux-dev) or statically ``s t / (1 + (s - 1) t)``
    (flux-schnell: s = 1, none), as diffusers' FlowMatchEulerDiscreteScheduler under FluxPipeline."""
    if steps < 1:
        raise ValueError(f"num_inference_steps: expected an integer >= 1, got {steps}")
    import numpy as np

    s = torch.from_numpy(np.linspace(1.0, 1 / steps, steps).astype(np.float32))
    s = time_shift(shift_mu(image_tokens), s) if dynamic_shift else shift * s / (1 + (shift - 1) * s)
    return torch.cat([s.float(), torch.zeros(1)])


@torch.no_grad()
def euler_sample(velocity, x: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """Integrate the flow from noise ``x`` (packed, float32) along ``sigmas``: ``x <- x + (s_next - s)
    v(x, s)``, each step computed in float32 (``velocity(x, t) -> v`` with t (b,) float32 = sigma, as
    the pipeline hands the transformer ``(sigma * 1000) / 1000``)."""
    for s, s_next in zip(sigmas[:-1].tolist(), sigmas[1:].tolist()):
        t = torch.full((x.shape[0],), s, dtype=torch.float32, device=x.device) * 1000 / 1000
        v = velocity(x, t)
        x = (x.float() + (s_next - s) * v.float()).to(x.dtype)
    return x
