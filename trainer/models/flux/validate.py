"""Flux validation: the flow loss at fixed timesteps, and sample images at each evaluation.

Loss. Every validation sample is noised at each of ``TIMESTEPS`` (no sampling of t, no shift), with
noise from a generator seeded by (seed, sample) (the same noise at every evaluation), and
``val_loss`` is the mean squared error over all of them on all ranks, so successive values compare
(torchtitan evaluates Flux at fixed timesteps likewise). ``val_tokens`` counts the image tokens.

Samples. Then ``flux.sample_count`` images of the first validation captions, from a fixed seed, with
``flux.sample_steps`` Euler steps and ``flux.sample_cfg_scale`` classifier-free guidance
(``trainer.models.flux.pipeline.generate``), every rank running the
forwards (FSDP2 gathers weights collectively) and rank 0 writing ``<dump>/samples/step-<N>.png`` (a
row of images, captions in ``step-<N>.txt``) and TensorBoard images ``validation/samples``.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.models.flux.flow import noisy, pack
from trainer.models.flux.loader import _seed
from trainer.models.flux.parallelize import without_context_parallel
from trainer.models.flux.pipeline import generate, initial_noise, latent_shape
from trainer.models.flux.sources import pil

TIMESTEPS = (0.1, 0.3, 0.5, 0.7, 0.9)
SAMPLE_SEED = 1234


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """(n, 3, H, W) in [-1, 1] -> (n, H, W, 3) uint8."""
    return ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu()


def save_row(images: torch.Tensor, path: Path) -> None:
    """Images (n, 3, H, W) in [-1, 1] side by side as one PNG."""
    Image = pil().Image
    row = torch.cat(list(to_uint8(images)), dim=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(row.numpy()).save(path)


class FluxValidator:
    """``evaluate() -> {"val_loss", "val_tokens", "val_batches", "val_time_s"}`` (module docstring)."""

    def __init__(self, task, trainer, samples_folder: Path) -> None:
        self.task, self.trainer, self.folder = task, trainer, samples_folder
        v = trainer.config.validation
        self.loader, self.steps = trainer.val_loader, v.steps if v.steps != -1 else None
        self.prompts = self.loader.captions(trainer.config.flux.sample_count)

    def _loss(self) -> tuple[float, int, int]:
        tr, task = self.trainer, self.task
        config, device = tr.config, tr.device
        self.loader.rewind()
        total = torch.zeros(2, device=device)  # summed squared error, values
        tokens = batches = 0
        n_items = len(self.loader.source)
        per_batch = self.loader.local_batch_size * self.loader.dp_world_size
        limit = -(-n_items // per_batch) if self.steps is None else min(self.steps, -(-n_items // per_batch))
        for _ in range(limit):
            b = next(self.loader)
            x0, txt, vec = task.encode(b, "validation")
            noise = torch.stack([torch.randn(tuple(x0.shape[1:]), generator=torch.Generator().manual_seed(
                _seed(config.training.seed, 15485863, g))) for g in b["sample"].tolist()]).to(device)
            for t_value in TIMESTEPS:
                t = torch.full((x0.shape[0],), t_value, device=device)
                x_t, target = noisy(x0.float(), noise, t)
                inputs = task.model_inputs(tr.args, config, x_t, txt, vec, t)
                inputs, target = task.local(tr.pm.cp, inputs, pack(target))
                total[0] += (tr.model(**inputs).float() - target).pow(2).sum()
                total[1] += target.numel()
            tokens += pack(x0).shape[0] * pack(x0).shape[1]
            batches += 1
        if tr._dp_group is not False and tr._distributed:
            dist.all_reduce(total, group=tr._dp_group)
        loss, n = total.tolist()
        return loss / n, tokens * tr.dims.dp_size, batches

    def _samples(self) -> None:
        tr, task = self.trainer, self.task
        f = tr.config.flux
        if not self.prompts:
            return
        shape = latent_shape(tr.args, task.encoders.vae_scale, len(self.prompts), f.img_size, f.img_size)
        with without_context_parallel(tr.model):  # each cp rank runs the whole (short) sampling
            images = generate(tr.model, task.encoders, self.prompts, initial_noise(shape, SAMPLE_SEED),
                              steps=f.sample_steps, guidance=f.guidance, dynamic_shift=f.time_shift,
                              true_cfg_scale=f.sample_cfg_scale)
        if tr.rank == 0:
            save_row(images, self.folder / f"step-{tr.step}.png")
            (self.folder / f"step-{tr.step}.txt").write_text("\n".join(self.prompts) + "\n", encoding="utf-8")
            tr.metrics.log_images(tr.step, "validation/samples", (images.float().cpu() + 1) / 2)

    @torch.no_grad()
    def evaluate(self) -> dict:
        t0 = time.perf_counter()
        was_training = self.trainer.model.training
        self.trainer.model.eval()
        try:
            loss, tokens, batches = self._loss()
            self._samples()
        finally:
            self.trainer.model.train(was_training)
        return {"val_loss": loss, "val_tokens": tokens, "val_batches": batches, "val_time_s": time.perf_counter() - t0}
