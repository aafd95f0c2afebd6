"""What a DCP checkpoint folder holds, read without a run: its complete steps, the step folder a path
names, the model arguments it records, its weights into a model; and :class:`CheckpointError`.

The layer below the checkpointer (``trainer.checkpoint.checkpointer``) and the Hugging Face converter
(``trainer.checkpoint.hf_convert``), which both read folders this way.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from trainer.checkpoint.lineage import STEP_RE
from trainer.registry import args_from_record, family_of
from trainer.errors import CheckpointError  # noqa: F401  (defined on the ground floor)


class UnreadableCheckpoint(CheckpointError):
    """A file of a DCP checkpoint cannot be read (damaged), unlike one that records no model args."""


def complete_steps(folder: str | os.PathLike) -> list[int]:
    """Steps with a complete checkpoint (``step-<N>`` holding DCP's ``.metadata``), ascending."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    steps = []
    for p in folder.iterdir():
        m = STEP_RE.match(p.name)
        if m and p.is_dir() and (p / ".metadata").is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def model_args_record(args: Any, flavor: str = "") -> str:
    """The ``model_args`` entry of a checkpoint: JSON of the flavor name and the ModelArgs fields."""
    # "model": the family (its registered name), so that read_model_args rebuilds the right args class.
    return json.dumps({"flavor": flavor, "model": family_of(args), "model_args": args.record()})


def read_model_args(path: str | os.PathLike) -> tuple[Any, str]:
    """``(ModelArgs, flavor)`` recorded in the DCP checkpoint folder ``path``.

    Raises CheckpointError when the checkpoint does not record them (written before they were).
    """
    path = Path(path)
    try:
        keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as exc:  # a truncated or foreign .metadata: pickle raises anything
        raise UnreadableCheckpoint(f"checkpoint {path}: its .metadata cannot be read ({type(exc).__name__}); the "
                                   f"checkpoint is damaged or not a DCP checkpoint") from None
    if "model_args" not in keys:
        raise CheckpointError(f"checkpoint {path} does not record its model arguments (written by an older "
                              f"version); pass --flavor to say which flavor it is")
    state = {"model_args": ""}
    try:
        dcp.load(state, checkpoint_id=str(path), no_dist=True)  # a local read: may run on one rank only
    except (Exception, CheckpointException) as exc:
        raise UnreadableCheckpoint(f"checkpoint {path}: its model args cannot be read ({type(exc).__name__}); the "
                                   f"checkpoint is damaged or not a DCP checkpoint") from None
    rec = json.loads(state["model_args"])
    return args_from_record(rec["model_args"], rec.get("model", "llama3")), rec.get("flavor", "")


def resolve_step_folder(path: str | os.PathLike, what: str = "checkpoint.initial_load_path") -> Path:
    """A DCP checkpoint folder: ``path`` itself if it holds ``.metadata``, else its newest ``step-<N>``.

    Raises CheckpointError if it is neither.
    """
    path = Path(path)
    if (path / ".metadata").is_file():
        return path
    if not path.is_dir():
        raise CheckpointError(f"{what}: no such folder: {path}")
    steps = complete_steps(path)
    if not steps:
        hint = " (it has a config.json: a Hugging Face folder? add --checkpoint.initial_load_in_hf)" if (
            path / "config.json").is_file() else ""
        raise CheckpointError(f"{what}: {path} is not a DCP checkpoint (no .metadata) and "
                              f"holds no complete step-<N> folder{hint}")
    return path / f"step-{steps[-1]}"


def load_weights(model: nn.Module, path: str | os.PathLike) -> None:
    """Load the ``model`` entries of a DCP checkpoint or export at ``path`` into ``model`` (cast to its dtypes)."""
    state = {"model": get_model_state_dict(model)}
    try:
        dcp.load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as exc:  # a BaseException holding every rank's traceback: its last
        # line says why
        why = [line.strip() for line in str(exc).splitlines() if line.strip()][-1:] or [type(exc).__name__]
        raise UnreadableCheckpoint(f"checkpoint {path}: its weights cannot be read ({why[0].split('. ')[0][:200]}); the "
                                   f"checkpoint is damaged or not a DCP checkpoint") from None
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))
