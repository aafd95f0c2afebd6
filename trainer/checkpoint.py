"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): save, atomic publish, resume, export.

Layout under the checkpoint folder (``<dump_folder>/<checkpoint.folder>``):
  step-<N>/            a complete checkpoint (DCP files + ``.metadata``), resumable
  .step-<N>.partial/   a checkpoint being written; renamed to step-<N> only once complete
  weights-step-<N>/    a model-weights-only export (``checkpoint.model_weights_only``), not resumed from
  hf-step-<N>/         a Hugging Face Llama / Qwen3 folder (``checkpoint.last_save_in_hf``; ``trainer.hf``)

What a full checkpoint holds (keys of the DCP state dict):
  model         sharded parameters (DTensors under FSDP2), via ``get_model_state_dict``
  optimizer     AdamW state, keyed by parameter names, via ``get_optimizer_state_dict``
  lr_scheduler  the scheduler's position (JSON)
  dataloader    ``dp_rank_<r>``: each data-parallel rank's loader state (JSON); resharded on load
                when the data-parallel degree changes
  train_state   step and tokens seen (JSON)
  model_args    the flavor and ModelArgs the model was built with (JSON), so that a checkpoint
                converts (``python -m trainer.convert``) or is checked against a run without a flavor
A seed checkpoint (``step-0``, ``checkpoint.create_seed_checkpoint``) and a weights-only export hold
the model and model_args only.

A run can also start from another checkpoint (``checkpoint.initial_load_path``, used only when
the checkpoint folder has nothing to resume): a DCP checkpoint folder or step folder (the model
only, or with ``initial_load_model_only false`` the whole training state), or a Hugging Face
Llama / Qwen3 folder (``initial_load_in_hf``), read tensor by tensor into the sharded model.

Atomicity. Every rank writes into ``.step-<N>.partial``; DCP's coordinator writes ``.metadata``
after all ranks' data is written (and fsynced), and only then does rank 0 rename the folder to
``step-<N>`` (a rename is atomic on POSIX file systems). A crash at any point leaves at most a
``.partial`` folder, which is ignored and removed by the next save. All ranks must see one shared
file system (one node, or a shared mount).

Async mode writes in a background thread (``dcp.async_save``) after copying the state (CPU tensors
are cloned here; GPU tensors are staged to CPU by DCP), and publishes the checkpoint when the write
has finished; ``close()`` waits for the last one.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

logger = logging.getLogger("trainer")

_STEP_RE = re.compile(r"^step-(\d+)$")
_EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# DCP warns on every call without a process group (also from its async writer thread) that it
# assumes a single process; that is what a one-process run intends.
warnings.filterwarnings("ignore", message=".*torch.distributed is disabled, unavailable or uninitialized.*")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be loaded as asked (missing step, incompatible layout, weights-only export)."""


def complete_steps(folder: str | os.PathLike) -> list[int]:
    """Steps with a complete checkpoint (``step-<N>`` holding DCP's ``.metadata``), ascending."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    steps = []
    for p in folder.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir() and (p / ".metadata").is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _clone_cpu_tensors(obj: Any) -> Any:
    """A copy of ``obj`` in which every CPU tensor is cloned (so training may change the originals)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone() if obj.device.type == "cpu" else obj
    if isinstance(obj, dict):
        return {k: _clone_cpu_tensors(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone_cpu_tensors(v) for v in obj]
    return obj


class Checkpointer:
    """Saves and restores a training run (see the module docstring for the format).

    Args:
        folder: the checkpoint folder.
        model, optimizer, lr_scheduler: what to save/restore (optimizer and scheduler may be None
            for a model-only use, e.g. the seed checkpoint).
        dataloader: object with ``state_dict()``/``load_state_dict()`` (plain dicts), or None.
        dp_rank: this process's data-parallel rank (the dataloader key).
        enable: save at all (loading a seed or an existing run also needs it).
        interval: save every ``interval`` steps, and at the last step.
        keep_latest_k: keep only the newest k complete checkpoints (0 = all).
        async_mode: "disabled" or "async".
        load_step: -1 = the newest complete checkpoint; else that step.
        model_weights_only / export_dtype: the final save is a weights-only export in this dtype.
    model_args / flavor: what the model was built with, recorded in every checkpoint.
    last_save_in_hf: the final save is a Hugging Face folder ``hf-step-<N>`` (in export_dtype),
        written at the last step even when ``enable`` is off.
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any = None,
        dataloader: Any = None,
        dp_rank: int = 0,
        *,
        enable: bool = True,
        interval: int = 500,
        keep_latest_k: int = 0,
        async_mode: str = "disabled",
        load_step: int = -1,
        model_weights_only: bool = False,
        export_dtype: str = "float32",
        model_args: Any = None,
        flavor: str = "",
        last_save_in_hf: bool = False,
    ) -> None:
        if async_mode not in ("disabled", "async"):
            raise ValueError(f"checkpoint.async_mode: expected 'disabled' or 'async', got {async_mode!r}")
        if export_dtype not in _EXPORT_DTYPES:
            raise ValueError(f"checkpoint.export_dtype: expected one of {tuple(_EXPORT_DTYPES)}, got {export_dtype!r}")
        if interval < 1:
            raise ValueError(f"checkpoint.interval: expected an integer >= 1, got {interval}")
        if keep_latest_k < 0:
            raise ValueError(f"checkpoint.keep_latest_k: expected an integer >= 0, got {keep_latest_k}")
        self.folder = Path(folder)
        self.model, self.optimizer, self.lr_scheduler, self.dataloader = model, optimizer, lr_scheduler, dataloader
        self.dp_rank = dp_rank
        self.enable, self.interval, self.keep_latest_k = enable, interval, keep_latest_k
        self.async_mode, self.load_step = async_mode, load_step
        self.model_weights_only, self.export_dtype = model_weights_only, _EXPORT_DTYPES[export_dtype]
        self.model_args, self.flavor, self.last_save_in_hf = model_args, flavor, last_save_in_hf
        self.rank = _rank()
        self._pending: tuple[Future, Path, Path, bool] | None = None
        self._pg = None
        if async_mode == "async" and dist.is_available() and dist.is_initialized():
            # Background writes run collectives; keep them off the training process group.
            self._pg = dist.new_group(backend="gloo")

    # -- state ---------------------------------------------------------------------------------

    def _model_sd(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def _model_state(self, sd: dict[str, Any] | None = None) -> dict[str, Any]:
        """``{"model": ..., "model_args": ...}``: the weights and, when known, what built them."""
        state: dict[str, Any] = {"model": self._model_sd() if sd is None else sd}
        if self.model_args is not None:
            state["model_args"] = model_args_record(self.model_args, self.flavor)
        return state

    def _full_state(self, step: int, tokens_seen: int) -> dict[str, Any]:
        state = self._model_state()
        if self.optimizer is not None:
            state["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer)
        if self.lr_scheduler is not None:
            state["lr_scheduler"] = json.dumps(self.lr_scheduler.state_dict())
        if self.dataloader is not None:
            state["dataloader"] = {f"dp_rank_{self.dp_rank}": json.dumps(self.dataloader.state_dict())}
        state["train_state"] = json.dumps({"step": step, "tokens_seen": tokens_seen})
        return state

    # -- saving --------------------------------------------------------------------------------

    def should_save(self, step: int, last_step: int) -> bool:
        if self.last_save_in_hf and step == last_step:
            return True
        return self.enable and (step % self.interval == 0 or step == last_step)

    def save(self, step: int, tokens_seen: int = 0, last: bool = False) -> Path | None:
        """Save a checkpoint of ``step`` (if ``last``: a Hugging Face folder with last_save_in_hf, a
        weights-only export with model_weights_only).

        Returns the final path (in async mode it appears once the background write completes).
        """
        self.wait()  # one write in flight at a time
        if last and self.last_save_in_hf:
            return self.export_hf(step)
        if last and self.model_weights_only:
            return self.export_weights(step)
        state = self._full_state(step, tokens_seen)
        return self._write(state, f"step-{step}")

    def save_seed(self) -> Path:
        """Write the model (initial weights) as the step-0 seed checkpoint, synchronously."""
        path = self._write(self._model_state(), "step-0", force_sync=True)
        return path

    def export_weights(self, step: int) -> Path:
        """Write the model weights only, in ``export_dtype``, as ``weights-step-<step>`` (synchronously)."""
        return self.export_weights_to(f"weights-step-{step}")

    def export_hf(self, step: int) -> Path:
        """Write the model as a Hugging Face (Llama / Qwen3) folder ``hf-step-<step>`` in ``export_dtype`` (synchronously).

        Every rank writes its shards into a temporary DCP export (any layout, pipeline stages
        included); rank 0 then streams it into safetensors shards (``trainer.convert.dcp_to_hf``,
        one shard of memory at a time), publishes the folder by a rename and removes the export.
        Needs ``model_args`` (the Hugging Face config is written from them).
        """
        if self.model_args is None:
            raise CheckpointError("checkpoint.last_save_in_hf: the model arguments are unknown; cannot write config.json")
        from trainer.convert import dcp_to_hf

        tmp = self.export_weights_to(f".hf-step-{step}.dcp")  # a dot name: never taken for a step
        final = self.folder / f"hf-step-{step}"
        if self.rank == 0:
            partial = self.folder / f".hf-step-{step}.partial"
            if partial.exists():
                shutil.rmtree(partial)
            dcp_to_hf(tmp, partial)
            if final.exists():
                shutil.rmtree(final)
            os.rename(partial, final)
            _fsync_dir(self.folder)
            shutil.rmtree(tmp, ignore_errors=True)
            logger.info("saved Hugging Face checkpoint %s", final)
        _barrier()
        return final

    def export_weights_to(self, name: str) -> Path:
        """The model weights (and model_args) in ``export_dtype`` as the DCP folder ``name``, synchronously."""
        sd = {k: v.to(self.export_dtype) for k, v in self._model_sd().items()}
        return self._write(self._model_state(sd), name, force_sync=True, purge=False)

    def _write(self, state: dict[str, Any], name: str, force_sync: bool = False, purge: bool = True) -> Path:
        final = self.folder / name
        partial = self.folder / f".{name}.partial"
        if self.rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            if partial.exists():  # left by a crash
                shutil.rmtree(partial)
        _barrier()
        if self.async_mode == "async" and not force_sync:
            future = dcp.async_save(_clone_cpu_tensors(state), checkpoint_id=str(partial), process_group=self._pg)
            self._pending = (future, partial, final, purge)
            return final
        dcp.save(state, checkpoint_id=str(partial))
        self._publish(partial, final, purge)
        _barrier()
        return final

    def _publish(self, partial: Path, final: Path, purge: bool) -> None:
        """Rank 0: rename the finished ``partial`` folder to ``final``, then drop old checkpoints."""
        if self.rank != 0:
            return
        if final.exists():  # re-saving a step (e.g. after a resume): replace it
            shutil.rmtree(final)
        os.rename(partial, final)
        _fsync_dir(self.folder)
        logger.info("saved checkpoint %s", final)
        if purge and self.keep_latest_k > 0:
            for step in complete_steps(self.folder)[: -self.keep_latest_k]:
                shutil.rmtree(self.folder / f"step-{step}", ignore_errors=True)

    def wait(self) -> None:
        """Wait for an async write in flight, then publish it."""
        if self._pending is None:
            return
        future, partial, final, purge = self._pending
        self._pending = None
        future.result()
        self._publish(partial, final, purge)

    def poll(self) -> None:
        """Publish an async write if it has finished (cheap; call once per step)."""
        if self._pending is not None and self._pending[0].done():
            self.wait()

    def close(self) -> None:
        self.wait()
        if self._pg is not None:
            dist.destroy_process_group(self._pg)
            self._pg = None

    # -- loading -------------------------------------------------------------------------------

    def resolve_load_step(self) -> int | None:
        """The step to resume from: ``load_step`` if given (it must exist), else the newest; None if none."""
        steps = complete_steps(self.folder)
        if self.load_step >= 0:
            if self.load_step not in steps:
                raise CheckpointError(
                    f"checkpoint.load_step: no complete checkpoint for step {self.load_step} in {self.folder} "
                    f"(found: {steps or 'none'})"
                )
            return self.load_step
        return steps[-1] if steps else None

    def load(self) -> tuple[int, int]:
        """Restore the newest (or ``load_step``) checkpoint into the model, optimizer, scheduler and loader.

        Returns ``(step, tokens_seen)``; ``(0, 0)`` when there is nothing to resume. A seed
        checkpoint (model only) restores the model and returns step 0.

        A checkpoint written under another parallel layout loads too: DCP reshards the model and
        optimizer, and the data loader states are resharded (``reshard_loader_state``).

        Raises CheckpointError when the checkpoint lacks the optimizer state (not a seed), or the data
        loader states cannot be resharded or belong to another dataset, tokenizer or seq_len.
        """
        step = self.resolve_load_step()
        if step is None:
            return 0, 0
        path = self.folder / f"step-{step}"
        keys = self._checked_keys(path)
        if not _has(keys, "optimizer"):
            if step != 0:
                raise CheckpointError(
                    f"checkpoint {path} holds model weights only; only step-0 (a seed) may; "
                    f"choose another --checkpoint.load_step or folder"
                )
            self._load_model(path)
            logger.info("loaded seed checkpoint %s (model weights)", path)
            return 0, 0
        step, tokens = self._load_all(path, keys)
        logger.info("resumed from checkpoint %s", path)
        return step, tokens

    def _checked_keys(self, path: Path) -> set[str]:
        """The state dict keys of the DCP checkpoint ``path``, after checking its model_args against ours."""
        keys = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
        if self.model_args is not None and "model_args" in keys:
            from trainer.hf import HFCheckpointError, check_compatible

            saved, flavor = read_model_args(path)
            try:
                check_compatible(saved, self.model_args, f"checkpoint {path} (flavor {flavor!r})",
                                 f"this run's flavor {self.flavor!r}" if self.flavor else "this run's model")
            except HFCheckpointError as exc:
                raise CheckpointError(str(exc)) from None
        return keys

    def _load_model(self, path: Path) -> None:
        state = {"model": self._model_sd()}
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(self.model, state["model"])

    def initial_load(self, path: str | os.PathLike, model_only: bool = True, in_hf: bool = False) -> tuple[int, int]:
        """Start from another checkpoint (``checkpoint.initial_load_path``); returns ``(step, tokens_seen)``.

        ``path``: a Hugging Face Llama / Qwen3 folder (``in_hf``; weights only), a DCP step folder (holding
        ``.metadata``) or a checkpoint folder (its newest complete step). ``model_only``: load the
        weights only and start at step 0; else also the optimizer, scheduler, data loader and step
        (as a resume from that folder). Raises CheckpointError (one line) for a folder that is not
        such a checkpoint or whose shapes do not match the model.
        """
        path = Path(path)
        if in_hf:
            from trainer.hf import HFCheckpoint, HFCheckpointError, check_compatible, load_into_model

            if not model_only:
                raise CheckpointError("checkpoint.initial_load_in_hf: a Hugging Face checkpoint holds weights only; "
                                      "set --checkpoint.initial_load_model_only true")
            try:
                ckpt = HFCheckpoint(path)
                if self.model_args is not None:
                    check_compatible(ckpt.args, self.model_args, f"{path} (Hugging Face {ckpt.family})",
                                     f"flavor {self.flavor!r}" if self.flavor else "the model")
                n = load_into_model(self.model, ckpt)
            except HFCheckpointError as exc:
                raise CheckpointError(f"checkpoint.initial_load_path: {exc}") from None
            logger.info("loaded Hugging Face checkpoint %s (%d tensors)", path, n)
            return 0, 0
        step_dir = resolve_step_folder(path)
        keys = self._checked_keys(step_dir)
        if not _has(keys, "model"):
            raise CheckpointError(f"checkpoint.initial_load_path: {step_dir} holds no model weights")
        if model_only:
            self._load_model(step_dir)
            logger.info("loaded model weights from %s", step_dir)
            return 0, 0
        if not _has(keys, "optimizer"):
            raise CheckpointError(f"checkpoint.initial_load_path: {step_dir} holds model weights only; set "
                                  f"--checkpoint.initial_load_model_only true to start from them")
        step, tokens = self._load_all(step_dir, keys)
        logger.info("started from checkpoint %s (step %d)", step_dir, step)
        return step, tokens

    def _load_all(self, path: Path, keys: set[str]) -> tuple[int, int]:
        """Model, optimizer, scheduler, loader and train state from the full checkpoint ``path``."""
        state = self._full_state(0, 0)
        state.pop("model_args", None)
        if self.optimizer is None:
            state.pop("optimizer", None)
        if self.dataloader is not None:
            # Every saved rank's loader state: with another data-parallel layout they are resharded.
            saved = sorted((k.split(".", 1)[1] for k in keys if k.startswith("dataloader.")),
                           key=lambda k: int(k.rsplit("_", 1)[1]))
            state["dataloader"] = dict.fromkeys(saved, "")
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(self.model, state["model"])
        if self.optimizer is not None:
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(json.loads(state["lr_scheduler"]))
        if self.dataloader is not None:
            states = [json.loads(v) for v in state["dataloader"].values()]
            try:
                self.dataloader.load_state_dict(reshard_loader_state(states, self.dp_rank, self.dataloader.dp_world_size))
            except ValueError as exc:
                raise CheckpointError(f"checkpoint {path}: {exc}") from None
        train_state = json.loads(state["train_state"])
        return int(train_state["step"]), int(train_state["tokens_seen"])


def _has(keys: set[str], prefix: str) -> bool:
    return any(k == prefix or k.startswith(prefix + ".") for k in keys)


def model_args_record(args: Any, flavor: str = "") -> str:
    """The ``model_args`` entry of a checkpoint: JSON of the flavor name and the ModelArgs fields."""
    # "model": the family (its registered name), so that read_model_args rebuilds the right args class.
    from trainer.models.registry import family_of

    return json.dumps({"flavor": flavor, "model": family_of(args), "model_args": args.record()})


def read_model_args(path: str | os.PathLike) -> tuple[Any, str]:
    """``(ModelArgs, flavor)`` recorded in the DCP checkpoint folder ``path``.

    Raises CheckpointError when the checkpoint does not record them (written before they were).
    """
    from trainer.models.registry import args_from_record

    path = Path(path)
    keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    if "model_args" not in keys:
        raise CheckpointError(f"checkpoint {path} does not record its model arguments (written by an older "
                              f"version); pass --flavor to say which flavor it is")
    state = {"model_args": ""}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)  # a local read: may run on one rank only
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


def reshard_loader_state(states: list[dict[str, Any]], dp_rank: int, dp_world_size: int) -> dict[str, Any]:
    """The loader state for data-parallel rank ``dp_rank`` of ``dp_world_size`` from the states of all
    ranks of a checkpoint (``trainer.data.loader.DataLoader.state_dict``), whatever their layout.

    The same layout gets its own state back. Otherwise: the loader deals the windows of one stream
    round-robin over the ranks, and at a step boundary rank r of D has consumed exactly the windows
    below ``W - (D - 1 - r)``, W being the largest ``window_index``; so the windows below W were all
    trained on and the stream position after window W - 1 (the state of the last rank) is where
    every rank of the new layout continues, dealing from window W on. Resumed so, the union of the
    next step's batches over the new ranks is exactly what the old layout would have read next.

    Raises ValueError when the states are not from one step of one layout (then no position is
    exact, and nothing is silently reset). Whether dataset, tokenizer and seq_len match is the
    loader's own check (``load_state_dict``).
    """
    if not states:
        raise ValueError("the checkpoint holds no data loader state")
    old_world = states[0].get("dp_world_size")
    by_rank = {s.get("dp_rank"): s for s in states}
    if old_world == dp_world_size and dp_rank in by_rank:
        return by_rank[dp_rank]
    if sorted(by_rank) != list(range(len(states))) or len(states) != old_world or any(
            s.get("dp_world_size") != old_world for s in states):
        raise ValueError(
            f"data loader states of ranks {sorted(by_rank)} do not form one layout of dp_world_size={old_world}; "
            f"cannot reshard them to {dp_world_size} ranks"
        )
    last = by_rank[old_world - 1]
    end = last["window_index"]
    behind = [r for r, s in by_rank.items() if s["window_index"] != end - (old_world - 1 - r)]
    if behind:
        raise ValueError(
            f"data loader states of ranks {behind} are not at the same step as rank {old_world - 1}; cannot reshard "
            f"dp_world_size={old_world} -> {dp_world_size} without skipping or repeating samples"
        )
    return {**last, "dp_rank": dp_rank, "dp_world_size": dp_world_size}


def load_weights(model: nn.Module, path: str | os.PathLike) -> None:
    """Load the ``model`` entries of a DCP checkpoint or export at ``path`` into ``model`` (cast to its dtypes)."""
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))
