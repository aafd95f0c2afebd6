"""Text to image with a Flux transformer: prompts encoded by the frozen encoders, initial noise (from
a seed or given), the Euler sampler of the flow with FLUX.1's shift, the latents decoded.

The same steps, in the same order and precision, as diffusers' ``FluxPipeline.__call__`` (guidance
fed to guidance-distilled transformers, optional true classifier-free guidance against a negative
prompt, ``(z / scaling_factor) + shift_factor`` into the autoencoder); tests/trainer/test_flux_sample.py
compares the images at 1e-4.
"""
from __future__ import annotations

import torch

from trainer.models.flux.flow import euler_sample, image_ids, pack, sampling_sigmas, text_ids, unpack


def latent_shape(args, vae_scale: int, batch: int, height: int, width: int) -> tuple[int, int, int, int]:
    """(batch, latent_channels, H / vae_scale, W / vae_scale) of the initial noise; raises ValueError
    (naming --height / --width) unless both are multiples of 2 * vae_scale."""
    unit = 2 * vae_scale
    for key, v in (("height", height), ("width", width)):
        if v < unit or v % unit:
            raise ValueError(f"--{key}: expected a multiple of {unit} (2x2 patches of {vae_scale}x latents), got {v}")
    return batch, args.latent_channels, height // vae_scale, width // vae_scale


def initial_noise(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Standard normal float32 noise from a CPU generator seeded with ``seed`` (what FluxPipeline draws
    with ``generator=torch.Generator().manual_seed(seed)``)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


@torch.no_grad()
def generate(model, encoders, prompts: list[str], latents: torch.Tensor, *, steps: int, guidance: float = 3.5,
             dynamic_shift: bool = True, shift: float = 1.0, true_cfg_scale: float = 1.0,
             negative_prompt: str = "") -> torch.Tensor:
    """Images (b, 3, H, W) float32, clamped to [-1, 1], for ``prompts`` (b strings) from the initial
    noise ``latents`` (b, latent_channels, h, w), h and w even.

    ``steps``: Euler steps; ``guidance``: the distilled guidance scale (used when the model embeds
    it); ``dynamic_shift``: FLUX.1-dev's resolution-dependent shift, else the static ``shift``
    (schnell: 1); ``true_cfg_scale`` > 1: classifier-free guidance against ``negative_prompt``.
    """
    args, device = model.args, encoders.device
    b, _, h, w = latents.shape
    if len(prompts) != b:
        raise ValueError(f"prompts: {len(prompts)} for a batch of {b} latents")
    dtype = next(model.parameters()).dtype
    txt, vec = encoders.encode_text(*encoders.tokenize(prompts))
    neg = encoders.encode_text(*encoders.tokenize([negative_prompt] * b)) if true_cfg_scale > 1 else None
    img_ids, txt_ids = image_ids(h // 2, w // 2, device), text_ids(txt.shape[1], device)
    g = torch.full((b,), float(guidance), device=device) if args.guidance_embed else None

    def velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        t = t.to(device)
        v = model(x.to(dtype), txt.to(dtype), vec.to(dtype), t, img_ids, txt_ids, g)
        if neg is not None:
            v_neg = model(x.to(dtype), neg[0].to(dtype), neg[1].to(dtype), t, img_ids, txt_ids, g)
            v = v_neg + true_cfg_scale * (v - v_neg)
        return v

    x = pack(latents.to(device, torch.float32))
    sigmas = sampling_sigmas(steps, x.shape[1], dynamic_shift, shift)
    x = euler_sample(velocity, x, sigmas)
    return encoders.decode(unpack(x, h, w)).float().clamp(-1, 1)
