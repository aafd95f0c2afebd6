"""Flux's training task (``trainer.task``): captioned images in, the rectified-flow loss out.

A batch of the loader (``trainer.models.flux.loader``: pixels and caption ids) is encoded by the
frozen encoders under no_grad (or read from the encode cache), then each sample g gets its own noise
and timestep from a generator seeded by (training.seed, g), so a sample's noise is the same in every
parallel layout: ``x_t = (1 - t) x_0 + t eps``, target ``eps - x_0``, t logit-normal and shifted by
the image token count (``trainer.models.flux.flow``). The loss is the mean squared error over every
latent value of the step's samples on all ranks: each micro-batch's summed squared error is scaled
by ``dp / (values of the step)`` and FSDP2 averages the gradients over the dp ranks (as
``trainer.step`` scales token losses). Under context parallel each rank takes its part of the
tokens (``local``) and the values add up over the dp x cp ranks.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.models.flux.encoders import EncodeCache, FluxEncoders
from trainer.models.flux.flow import image_ids, noisy, pack, sample_timesteps, text_ids
from trainer.models.flux.loader import FluxLoader, _seed
from trainer.models.flux.shapes import ShapesSource
from trainer.models.flux.sources import open_source

EMBEDDED = "shapes"


def mse_sum(pred: torch.Tensor, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Summed squared error in float32 (the loss function a run hands its layout)."""
    return (pred.float() - target.float()).pow(2).sum()


class FluxTask:
    """The trainer's task for Flux (``trainer.task`` module docstring). ``encoders`` and ``cache``
    exist after the first ``build_loader`` (the loader needs the tokenizers)."""

    def __init__(self) -> None:
        self.encoders: FluxEncoders | None = None
        self.cache: EncodeCache | None = None
        self.sources: dict[str, object] = {}

    # -- data --

    def _encoders(self, trainer) -> FluxEncoders:
        if self.encoders is None:
            f = trainer.config.flux
            self.encoders = FluxEncoders(trainer.args, f, trainer.device, trainer.compute_dtype)
            self.cache = EncodeCache(f.encode_cache) if f.encode_cache else None
        return self.encoders

    def _source(self, config, split: str):
        t, v = config.training, config.validation
        name, path, key = (t.dataset, t.dataset_path, "training") if split == "training" or not (
            v.dataset or v.dataset_path) else (v.dataset, v.dataset_path, "validation")
        if path:
            return open_source(path)
        if name != EMBEDDED:
            raise ValueError(f"{key}.dataset: Flux trains on captioned images: {EMBEDDED!r} (embedded) or a "
                             f"--{key}.dataset_path (images + .txt, .jsonl, .parquet, .tar shards), got {name!r}")
        # validation: every combination of the embedded set once
        return ShapesSource() if split == "training" else ShapesSource(n=60)

    def build_loader(self, trainer, split: str) -> FluxLoader:
        config = trainer.config
        enc = self._encoders(trainer)
        source = self.sources[split] = self._source(config, split)
        batch = config.training.local_batch_size
        if split != "training" and config.validation.local_batch_size != -1:
            batch = config.validation.local_batch_size
        return FluxLoader(source, enc.tokenize, config.flux.img_size, batch, trainer.dp_rank, trainer.dims.dp_size,
                          seed=config.training.seed, caption_dropout=config.flux.caption_dropout,
                          one_epoch=split != "training", units_per_sample=config.training.seq_len + 1)

    def tokens_per_sample(self, config, args) -> int:
        """T5 tokens + image tokens of one sample (the joint sequence every block attends over), at the
        autoencoder's scale once the encoders are built (a Hugging Face folder's args do not say it)."""
        if self.encoders is not None:
            args = args.replace(vae_scale=self.encoders.vae_scale)
        return args.max_txt_len + args.image_tokens(config.flux.img_size, config.flux.img_size)

    # -- encoding --

    def encode(self, batch: dict[str, torch.Tensor], split: str = "training"):
        """(x_0 latents (b, C, h, w), txt (b, L, context_dim), vec (b, vec_dim)) of a loader batch,
        through the encode cache where one is set."""
        enc, cache = self.encoders, self.cache
        if cache is None:
            return (enc.encode_images(batch["images"]), *enc.encode_text(batch["t5_ids"], batch["clip_ids"]))
        source = self.sources[split]
        lat, txt, vec = [], [], []
        for i in range(batch["images"].shape[0]):
            ids = torch.cat([batch["t5_ids"][i], batch["clip_ids"][i]]).numpy().tobytes()
            tkey = hashlib.sha1(ids).hexdigest()
            hit = cache.get("text", enc.text_identity, tkey)
            if hit is None:
                t, v = enc.encode_text(batch["t5_ids"][i:i + 1], batch["clip_ids"][i:i + 1])
                hit = {"txt": t[0], "vec": v[0]}
                cache.put("text", enc.text_identity, tkey, hit)
            txt.append(hit["txt"])
            vec.append(hit["vec"])
            if enc.vae is None:  # pixel space: nothing worth caching
                lat.append(enc.encode_images(batch["images"][i:i + 1])[0])
                continue
            ikey = f"{source.name}|{source.key(int(batch['item'][i]))}|{batch['images'].shape[-1]}"
            hit = cache.get("latents", enc.image_identity, ikey)
            if hit is None:
                hit = {"latents": enc.encode_images(batch["images"][i:i + 1])[0]}
                cache.put("latents", enc.image_identity, ikey, hit)
            lat.append(hit["latents"])
        dev = enc.device
        return torch.stack(lat).to(dev), torch.stack(txt).to(dev), torch.stack(vec).to(dev)

    def noise_and_timesteps(self, config, args, samples: torch.Tensor, shape: tuple[int, ...]):
        """Per sample g: noise (C, h, w) and a standard normal draw u from a CPU generator seeded by
        (seed, g); the timesteps t from u (``sample_timesteps``). Returns (noise (b, C, h, w), t (b,))."""
        f = config.flux
        noise, u = [], []
        for g in samples.tolist():
            gen = torch.Generator().manual_seed(_seed(config.training.seed, 104729, g))
            noise.append(torch.randn(shape, generator=gen))
            u.append(torch.randn((), generator=gen))
        tokens = (shape[1] // 2) * (shape[2] // 2)
        t = sample_timesteps(torch.stack(u), f.timestep_sampling, tokens, f.time_shift, f.logit_mean, f.logit_std)
        return torch.stack(noise), t

    def model_inputs(self, args, config, x_t: torch.Tensor, txt, vec, t):
        """The transformer's keyword inputs for noisy latents ``x_t`` (b, C, h, w)."""
        b, _, h, w = x_t.shape
        dev = x_t.device
        g = torch.full((b,), float(config.flux.guidance), device=dev) if args.guidance_embed else None
        return dict(img=pack(x_t), txt=txt, vec=vec, timesteps=t.to(dev), img_ids=image_ids(h // 2, w // 2, dev),
                    txt_ids=text_ids(txt.shape[1], dev), guidance=g)

    # -- training --

    @staticmethod
    def local(cp, inputs: dict, target: torch.Tensor) -> tuple[dict, torch.Tensor]:
        """Under context parallel (``cp`` a ContextParallel, else None): this rank's part of the text
        and image tokens, their ids and the target, each stream split on its own."""
        if cp is None:
            return inputs, target
        inputs = {**inputs, "img": cp.shard(inputs["img"], 1), "txt": cp.shard(inputs["txt"], 1),
                  "img_ids": cp.shard(inputs["img_ids"], 0), "txt_ids": cp.shard(inputs["txt_ids"], 0)}
        return inputs, cp.shard(target, 1)

    def build_loss_fn(self, model, config, dims):
        return True, mse_sum

    def setup(self, trainer) -> None:
        return None

    def forward_backward(self, trainer, batches):
        config, args, device = trainer.config, trainer.args, trainer.device
        prepared, n_local = [], 0
        for b in batches:
            x0, txt, vec = self.encode(b)
            noise, t = self.noise_and_timesteps(config, args, b["sample"], tuple(x0.shape[1:]))
            x_t, target = noisy(x0.float(), noise.to(device), t.to(device))
            inputs, target = self.local(trainer.pm.cp, self.model_inputs(args, config, x_t, txt, vec, t), pack(target))
            prepared.append((inputs, target))
            n_local += target.numel()
        n_total = torch.tensor(float(n_local), device=device)
        if trainer._dp_group is not False:
            dist.all_reduce(n_total, group=trainer._dp_group)
        scale = trainer.pm.grad_scale / n_total
        loss_sum = torch.zeros((), device=device)
        for inputs, target in prepared:
            err = mse_sum(trainer.model(**inputs), target)
            (err * scale).backward()
            loss_sum += err.detach()
        if trainer._dp_group is not False:
            dist.all_reduce(loss_sum, group=trainer._dp_group)
        return loss_sum / n_total

    def build_validator(self, trainer):
        if trainer.val_loader is None:
            return None
        from trainer.models.flux.validate import FluxValidator

        return FluxValidator(self, trainer, Path(trainer.config.job.dump_folder) / "samples")
