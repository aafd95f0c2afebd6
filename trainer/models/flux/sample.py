"""Sampling from a Flux model on the command line: ``python -m trainer.models.flux.sample`` (and,
routed there, ``python -m trainer.generate --model.name flux``), :func:`generate_main`.

    python -m trainer.models.flux.sample --flux.pipeline_path FLUX.1-dev --prompt "a red circle" \\
        --num_inference_steps 28 --guidance 3.5 --height 1024 --width 1024 --seed 0 --output out.png

The transformer comes from ``--checkpoint.initial_load_path`` (a DCP checkpoint of ours, or with
``--checkpoint.initial_load_in_hf`` a diffusers ``transformer/`` folder), else from
``--flux.pipeline_path``'s ``transformer/``; the encoders from the ``[flux]`` keys as in training
(the debug flavor's tiny ones without folders). The schedule's shift is the pipeline's scheduler
config (dynamic for FLUX.1-dev, none for schnell), else ``--flux.time_shift``.
``--latents_path``: a safetensors file whose ``latents`` (batch, latent_channels, H/8, W/8) are the
initial noise (else drawn from ``--seed``). ``--output``: ``.png`` (the images side by side) or
``.safetensors`` (``images`` (batch, 3, H, W) float32 in [-1, 1]). Bad input: one line, exit code 1.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from trainer.models.flux.flow import BASE_SEQ, BASE_SHIFT, MAX_SEQ, MAX_SHIFT


def build_parser() -> argparse.ArgumentParser:
    """The sampling flags (the trainer's ``--section.key`` flags come on top)."""
    p = argparse.ArgumentParser(
        prog="python -m trainer.models.flux.sample",
        description="Flux text-to-image sampling (the trainer's --section.key flags also apply)")
    p.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    p.add_argument("--negative_prompt", default=None, help="with --true_cfg_scale > 1: the negative prompt")
    p.add_argument("--true_cfg_scale", type=float, default=1.0, help="classifier-free guidance scale (1 = off)")
    p.add_argument("--num_inference_steps", type=int, default=28)
    p.add_argument("--guidance", type=float, default=None, help="distilled guidance (default --flux.guidance)")
    p.add_argument("--height", type=int, default=None, help="pixels (default --flux.img_size)")
    p.add_argument("--width", type=int, default=None, help="pixels (default --flux.img_size)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max_sequence_length", type=int, default=None, help="T5 tokens (default the flavor's)")
    p.add_argument("--latents_path", default=None, help="safetensors with 'latents' (batch, C, H/8, W/8)")
    p.add_argument("--output", required=True, help="out.png or out.safetensors")
    return p


def _scheduler_shift(pipeline: Path, dynamic_default: bool) -> tuple[bool, float]:
    """(dynamic, static shift) of a pipeline's scheduler config; raises ValueError for settings we
    do not reproduce."""
    cfg_path = pipeline / "scheduler" / "scheduler_config.json"
    if not cfg_path.is_file():
        return dynamic_default, 1.0
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    for key, want in (("base_image_seq_len", BASE_SEQ), ("max_image_seq_len", MAX_SEQ), ("base_shift", BASE_SHIFT),
                      ("max_shift", MAX_SHIFT)):
        if key in cfg and cfg[key] != want:
            raise ValueError(f"{cfg_path}: {key} {cfg[key]!r} is not supported (expected {want})")
    for key in ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "invert_sigmas"):
        if cfg.get(key):
            raise ValueError(f"{cfg_path}: {key} is not supported")
    if cfg.get("shift_terminal"):
        raise ValueError(f"{cfg_path}: shift_terminal is not supported")
    return bool(cfg.get("use_dynamic_shifting", False)), float(cfg.get("shift", 1.0))


def load_model(config, device: torch.device):
    """(model in eval mode, args, flavor) from ``--checkpoint.initial_load_path`` (DCP or, with
    ``initial_load_in_hf``, a diffusers transformer folder) or ``--flux.pipeline_path``/transformer."""
    from trainer.checkpoint.checkpointer import Checkpointer
    from trainer.checkpoint.folder import read_model_args, resolve_step_folder
    from trainer.hf import HFCheckpoint, load_into_model
    from trainer.registry import build_model, family_of

    c, f = config.checkpoint, config.flux
    if c.initial_load_path and not c.initial_load_in_hf:
        path = resolve_step_folder(c.initial_load_path)
        args, flavor = read_model_args(path)
        if family_of(args) != "flux":
            raise ValueError(f"--checkpoint.initial_load_path: {path} holds a {family_of(args)} model, not Flux")
        model = build_model(args, device)
        Checkpointer(Path(config.job.dump_folder) / "sample-load", model, model_args=args).initial_load(path, True)
        return model.eval(), args, flavor
    hf = Path(c.initial_load_path) if c.initial_load_path else (
        Path(f.pipeline_path) / "transformer" if f.pipeline_path else None)
    if hf is None:
        raise ValueError("--checkpoint.initial_load_path: give a checkpoint (or --flux.pipeline_path) to sample from")
    ckpt = HFCheckpoint(hf)
    if ckpt.family != "flux":
        raise ValueError(f"--checkpoint.initial_load_path: {hf} holds a {ckpt.family} model, not Flux")
    model = build_model(ckpt.args, device)
    load_into_model(model, ckpt)
    return model.eval(), ckpt.args, ckpt.flavor


def write_output(images: torch.Tensor, out: str) -> Path:
    """``.safetensors``: ``images`` float32 (b, 3, H, W) in [-1, 1]; ``.png``: side by side."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file({"images": images.float().cpu().contiguous()}, str(path))
    else:
        from trainer.models.flux.validate import save_row

        save_row(images, path)
    return path


def run(opts, config) -> Path:
    """Sample per ``opts`` (the sampling flags) and ``config`` (a JobConfig); returns the output path."""
    from trainer.models.flux.encoders import FluxEncoders
    from trainer.models.flux.pipeline import generate, initial_noise, latent_shape

    if not opts.output.endswith((".png", ".safetensors")):
        raise ValueError(f"--output: expected a .png or .safetensors path, got {opts.output!r}")
    for key in ("true_cfg_scale", "guidance"):  # NaN / inf: an image of NaN, written as if fine
        value = getattr(opts, key)
        if value is not None and not math.isfinite(value):
            raise ValueError(f"--{key}: expected a finite number, got {value!r}")
    if opts.negative_prompt is not None and not opts.true_cfg_scale > 1:  # used only by true CFG: not ignored
        raise ValueError(f"--negative_prompt: used only with --true_cfg_scale > 1, got {opts.true_cfg_scale}")
    for text in [*opts.prompt, opts.negative_prompt or ""]:  # argv bytes that are not UTF-8 come as surrogates
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"--prompt: expected UTF-8 text, got {text!r}") from None
    if opts.max_sequence_length is not None and opts.max_sequence_length < 1:
        raise ValueError(f"--max_sequence_length: expected an integer >= 1, got {opts.max_sequence_length}")
    try:  # before sampling, not after it
        Path(opts.output).parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--output: cannot create the folder of {opts.output!r} ({exc.strerror})") from None
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    f = config.flux
    model, args, _ = load_model(config, device)
    if opts.max_sequence_length is not None:
        args = args.replace(max_txt_len=opts.max_sequence_length)
    encoders = FluxEncoders(args, f, device, torch.float32)
    dynamic, shift = (_scheduler_shift(Path(f.pipeline_path), f.time_shift) if f.pipeline_path
                      else (f.time_shift, 1.0))
    b = len(opts.prompt)
    h, w = opts.height or f.img_size, opts.width or f.img_size
    shape = latent_shape(args, encoders.vae_scale, b, h, w)
    if opts.latents_path:
        from safetensors.torch import load_file

        try:
            latents = load_file(opts.latents_path)["latents"].float()
        except (OSError, KeyError, RuntimeError) as exc:
            raise ValueError(f"--latents_path: {opts.latents_path}: expected a safetensors file with 'latents' "
                             f"({type(exc).__name__})") from None
        if tuple(latents.shape) != shape:
            raise ValueError(f"--latents_path: latents of shape {tuple(latents.shape)}, expected {shape} for "
                             f"{b} prompt(s) at {h}x{w}")
    else:
        latents = initial_noise(shape, opts.seed)
    images = generate(model, encoders, opts.prompt, latents, steps=opts.num_inference_steps,
                      guidance=f.guidance if opts.guidance is None else opts.guidance, dynamic_shift=dynamic,
                      shift=shift, true_cfg_scale=opts.true_cfg_scale,
                      negative_prompt="" if opts.negative_prompt is None else opts.negative_prompt)
    return write_output(images, opts.output)


def generate_main(argv: list[str] | None = None) -> int:
    """The command line (module docstring): the sampling flags, then the trainer's ``--section.key``
    flags (``--model.name flux`` implied). Returns the exit code (1 with one line for bad input)."""
    from trainer.errors import CheckpointError
    from trainer.config import ConfigError, parse_args

    argv = list(sys.argv[1:] if argv is None else argv)
    opts, rest = build_parser().parse_known_args(argv)
    if "--model.name" not in rest:
        rest = ["--model.name", "flux", *rest]
    try:
        config = parse_args(rest)
        path = run(opts, config)
    except (ConfigError, CheckpointError, ValueError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(generate_main())
