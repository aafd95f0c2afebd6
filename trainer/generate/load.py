"""A trained model for generation and evaluation, from the trainer's own configuration: where its
weights are, its args, its tokenizer; built on this process's device in the run's compute dtype.

Where the weights come from (``checkpoint.initial_load_path``, else the run's checkpoint folder
``<job.dump_folder>/<checkpoint.folder>``, so that a training command becomes a generation command
by changing the module name):
  * a Hugging Face folder (it holds config.json, or ``--checkpoint.initial_load_in_hf``): its
    config.json gives the model, and its tokenizer files the tokenizer unless
    ``--model.tokenizer_path`` names one;
  * a DCP step folder (it holds ``.metadata``): the model args it records;
  * a folder of steps (a run's checkpoint folder): its newest step whose files match their manifest
    (``trainer.checkpoint.manifest``; a damaged one is skipped with a warning), DCP ``step-<N>`` or
    Hugging Face ``hf-step-<N>`` (``checkpoint.last_save_in_hf``), whichever is newer.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint.folder import (CheckpointError, UnreadableCheckpoint, complete_steps, load_weights,
                                      read_model_args)
from trainer.data import build_tokenizer
from trainer.registry import build_model, model_args, spec_of

logger = logging.getLogger("trainer")
HF_STEP_RE = re.compile(r"^hf-step-(\d+)$")


@dataclass
class Source:
    """Where the weights are: ``kind`` "hf" or "dcp", the folder, and a phrase for the log."""

    kind: str
    path: Path
    what: str


def _verified(step_folder: Path) -> bool:
    from trainer.checkpoint.manifest import ManifestError, UnverifiedCheckpoint, verify_folder

    try:
        verify_folder(step_folder)
    except UnverifiedCheckpoint:
        logger.warning("%s has no manifest (written before manifests existed); loading it unverified", step_folder)
    except ManifestError as exc:
        logger.warning("skipping %s: %s", step_folder, exc)
        return False
    return True


def resolve_source(config) -> Source:
    """The weights ``config`` names (module docstring). Raises CheckpointError (one line) when there
    are none."""
    c = config.checkpoint
    explicit = bool(c.initial_load_path)
    path = Path(c.initial_load_path) if explicit else Path(config.job.dump_folder) / c.folder
    key = "checkpoint.initial_load_path" if explicit else "job.dump_folder"
    if c.initial_load_in_hf or (path / "config.json").is_file():
        if not (path / "config.json").is_file():
            raise CheckpointError(f"--checkpoint.initial_load_path: {path} is not a Hugging Face folder (no config.json)")
        return Source("hf", path, f"the Hugging Face folder {path}")
    if (path / ".metadata").is_file():
        return Source("dcp", path, f"the DCP checkpoint {path}")
    if not path.is_dir():
        raise CheckpointError(f"--{key}: no checkpoint at {path} (pass --checkpoint.initial_load_path: a DCP step "
                              f"folder, a checkpoint folder or a Hugging Face folder)")
    hf_steps = sorted(int(m.group(1)) for p in path.iterdir() if (m := HF_STEP_RE.match(p.name))
                      and (p / "config.json").is_file())
    candidates = [(s, "dcp", path / f"step-{s}") for s in complete_steps(path)]
    candidates += [(s, "hf", path / f"hf-step-{s}") for s in hf_steps]
    for step, kind, folder in sorted(candidates, key=lambda t: (t[0], t[1] == "dcp"), reverse=True):
        if kind == "hf" or _verified(folder):
            return Source(kind, folder, f"step {step} of {path}")
    raise CheckpointError(f"--{key}: {path} holds no complete, verified step-<N> or hf-step-<N> folder")


def load_tokenizer(config, source: Source):
    """The run's tokenizer (``--model.tokenizer_path``), else a Hugging Face folder's own, else the
    built-in byte-level one. Raises ValueError for an unusable one."""
    path = config.model.tokenizer_path
    if not path and source.kind == "hf" and (source.path / "tokenizer.json").is_file():
        path = str(source.path)
    return build_tokenizer(path or None)


def source_args(config, source: Source, vocab_size: int, max_seq_len: int) -> Any:
    """The model args of ``source`` for sequences up to ``max_seq_len`` (only the rotary table and the
    length check read it)."""
    if source.kind == "hf":
        from trainer.hf import HFCheckpoint

        args = HFCheckpoint(source.path).args
    else:
        try:
            args, _ = read_model_args(source.path)
        except UnreadableCheckpoint:
            raise
        except CheckpointError:  # an old checkpoint: the configured flavor says what it is
            args = model_args(config.model.name, config.model.flavor, vocab_size, max_seq_len)
    spec = spec_of(args)
    if spec.generate is not None:  # Flux: its own sampler; the text decoder's build fails deep inside
        raise ValueError(f"--checkpoint.initial_load_path: {source.path} holds a {spec.name} model, not a text "
                         f"decoder; sample it with python -m trainer.generate --model.name {spec.name}")
    if vocab_size > args.vocab_size:
        raise ValueError(f"--model.tokenizer_path: the tokenizer has {vocab_size} tokens but the model's embedding "
                         f"has {args.vocab_size}; use the model's own tokenizer")
    return args.replace(max_seq_len=max(max_seq_len, 1))


def materialize(args, device: torch.device, dtype: torch.dtype, source: Source, tp_mesh=None) -> torch.nn.Module:
    """The model of ``args`` on ``device`` in ``dtype`` with the weights of ``source`` (split over
    ``tp_mesh``'s ranks for tensor parallel generation when given), in eval mode."""
    model = build_model(args, device="meta")
    if tp_mesh is not None:
        from trainer.generate.tensor_parallel import apply_generation_tp

        apply_generation_tp(model, tp_mesh)
    model.to_empty(device=device)
    with torch.no_grad():
        model.rope.reset_parameters()  # not in any checkpoint: computed
        for module in model.modules():
            if hasattr(module, "reset_buffers"):
                module.reset_buffers()
    if source.kind == "hf":
        from trainer.hf import HFCheckpoint, load_into_model

        load_into_model(model, HFCheckpoint(source.path))
    else:
        load_weights(model, source.path)
    if dtype != torch.float32:
        model.to(dtype)
    return model.eval()
