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
Reading a folder without a run (its steps, its model_args, its weights into a model) is
``trainer.checkpoint.folder``.
A seed checkpoint (``step-0``, ``checkpoint.create_seed_checkpoint``) and a weights-only export hold
the model and model_args only.

A run can also start from another checkpoint (``checkpoint.initial_load_path``, used only when
the checkpoint folder has nothing to resume): a DCP checkpoint folder or step folder (the model
only, or with ``initial_load_model_only false`` the whole training state), or a Hugging Face
Llama / Qwen3 folder (``initial_load_in_hf``), read tensor by tensor into the sharded model.

Atomicity. Every rank writes into ``.step-<N>.partial``; DCP's coordinator writes ``.metadata``
after all ranks' data is written (and fsynced), then rank 0 writes ``manifest.json`` (size and
checksum of every file, ``trainer.checkpoint.manifest``), and only then renames the folder to
``step-<N>`` (a rename is atomic on POSIX file systems). A crash at any point leaves at most a
``.partial`` folder, which is ignored and removed by the next save. All ranks must see one shared
file system (one node, or a shared mount). Free space is checked before each write, and a write
that fails is one line with its ``.partial`` removed (``trainer.checkpoint.publish``).

Verification. A resume checks the checkpoint against its manifest first (the ranks share the
files). A damaged, truncated, unreadable or unverifiable newest checkpoint is reported in one
line naming the file, moved to ``damaged/`` and the run falls back to the newest intact one
(``strict_verify``: an error instead). An explicit ``load_step`` never falls back. Damage is decided by
the manifest alone: a verified checkpoint that does not load into this run (another optimizer or state
dtype, ``trainer.checkpoint.compatibility``) is an error that says what differs, and it stays in place.

Lineage and retention (``trainer.checkpoint.lineage``): a run resumed with a ``load_step`` below
the newest step moves the later steps aside into ``abandoned-after-step-<L>-<time>/``; retention
keeps the newest ``keep_latest_k`` of this lineage and never the one just saved.

Async mode writes in a background thread (``dcp.async_save``) from a copy of the state and
publishes the checkpoint when the write has finished; ``close()`` waits for the last one.
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from trainer.run import signals
from trainer.checkpoint.compatibility import optimizer_mismatch, state_dtype_change
from trainer.checkpoint.folder import (
    CheckpointError,
    UnreadableCheckpoint,
    complete_steps,
    model_args_record,
    read_model_args,
    resolve_step_folder,
)
from trainer.checkpoint.lineage import STEP_RE as _STEP_RE
from trainer.checkpoint.lineage import fork, remove_leftovers, retain, set_aside_damaged
from trainer.checkpoint.manifest import ManifestError, read_manifest, verify_files
from trainer.checkpoint.publish import FolderWriter, SaveError, fsync_dir
from trainer.data.reshard import reshard_loader_state

logger = logging.getLogger("trainer")

_EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# DCP warns on every call without a process group (also from its async writer thread) that it
# assumes a single process; that is what a one-process run intends.
warnings.filterwarnings("ignore", message=".*torch.distributed is disabled, unavailable or uninitialized.*")


class _Unreadable(CheckpointError):
    """A file of the checkpoint cannot be read (a reason to fall back, unlike a model that does not match)."""


# Reading a damaged checkpoint fails in many ways (a truncated zip, a garbage pickle, a short read).
_READ_ERRORS = (CheckpointException, OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError, KeyError)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _all_gather(obj: Any) -> list[Any]:
    if _world() == 1:
        return [obj]
    out = [None] * _world()
    dist.all_gather_object(out, obj)
    return out


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
        keep_latest_k: keep only the newest k complete checkpoints of this lineage (0 = all).
        async_mode: "disabled" or "async".
        load_step: -1 = the newest complete checkpoint; else that step.
        model_weights_only / export_dtype: the final save is a weights-only export in this dtype.
    model_args / flavor: what the model was built with, recorded in every checkpoint.
    last_save_in_hf: the final save is a Hugging Face folder ``hf-step-<N>`` (in export_dtype),
        written at the last step even when ``enable`` is off, with the tokenizer files of
        ``tokenizer_path`` ("" = the byte-level tokenizer; None = none) and generation_config.json.
    strict_verify: a checkpoint that fails verification is an error instead of a fall back.
    on_save_error: "stop" (a failed save raises CheckpointError) or "continue" (it is logged and
        the run goes on without it; a save with ``last=True`` always raises).
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
        tokenizer_path: str | None = None,
        strict_verify: bool = False,
        on_save_error: str = "stop",
    ) -> None:
        if async_mode not in ("disabled", "async"):
            raise ValueError(f"checkpoint.async_mode: expected 'disabled' or 'async', got {async_mode!r}")
        if export_dtype not in _EXPORT_DTYPES:
            raise ValueError(f"checkpoint.export_dtype: expected one of {tuple(_EXPORT_DTYPES)}, got {export_dtype!r}")
        if interval < 1:
            raise ValueError(f"checkpoint.interval: expected an integer >= 1, got {interval}")
        if on_save_error not in ("stop", "continue"):
            raise ValueError(f"checkpoint.on_save_error: expected 'stop' or 'continue', got {on_save_error!r}")
        if keep_latest_k < 0:
            raise ValueError(f"checkpoint.keep_latest_k: expected an integer >= 0, got {keep_latest_k}")
        self.folder = Path(folder)
        self.model, self.optimizer, self.lr_scheduler, self.dataloader = model, optimizer, lr_scheduler, dataloader
        self.dp_rank = dp_rank
        self.enable, self.interval, self.keep_latest_k = enable, interval, keep_latest_k
        self.async_mode, self.load_step = async_mode, load_step
        self.model_weights_only, self.export_dtype = model_weights_only, _EXPORT_DTYPES[export_dtype]
        self.model_args, self.flavor, self.last_save_in_hf = model_args, flavor, last_save_in_hf
        self.strict_verify, self.on_save_error = strict_verify, on_save_error
        self.tokenizer_path = tokenizer_path
        self.rank = _rank()
        self.failed_saves = 0
        self._verified = False  # the checkpoint being loaded matched its manifest (messages say "intact")
        self.loaded_from: str | None = None  # what load() / initial_load() read, for the non-finite message
        self._pg = None
        if async_mode == "async" and dist.is_available() and dist.is_initialized():
            # Background writes run collectives; keep them off the training process group.
            self._pg = dist.new_group(backend="gloo")
        self._writer = FolderWriter(self.folder, async_mode, self._pg)

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
        try:
            self.wait()  # one write in flight at a time
            if last and self.last_save_in_hf:
                return self.export_hf(step)
            if last and self.model_weights_only:
                return self.export_weights(step)
            state = self._full_state(step, tokens_seen)
            return self._write(state, f"step-{step}")
        except SaveError as exc:
            return self._save_failed(exc, last)

    def _save_failed(self, exc: SaveError, last: bool) -> None:
        """``on_save_error``: raise (stop), or log and go on without the checkpoint (continue)."""
        self.failed_saves += 1
        if self.on_save_error == "stop" or last:
            hint = "" if last else " (--checkpoint.on_save_error continue trains on without it)"
            raise CheckpointError(f"{exc}{hint}") from None
        logger.warning("%s; training continues without this checkpoint (--checkpoint.on_save_error continue)", exc)
        return None

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
        included); rank 0 then streams it into safetensors shards (``trainer.checkpoint.hf_convert.dcp_to_hf``,
        one shard of memory at a time), publishes the folder by a rename and removes the export.
        Needs ``model_args`` (the Hugging Face config is written from them).
        """
        if self.model_args is None:
            raise CheckpointError("checkpoint.last_save_in_hf: the model arguments are unknown; cannot write config.json")
        from trainer.checkpoint.hf_convert import dcp_to_hf

        tmp = self.export_weights_to(f".hf-step-{step}.dcp")  # a dot name: never taken for a step
        final = self.folder / f"hf-step-{step}"
        if self.rank == 0:
            partial = self.folder / f".hf-step-{step}.partial"
            if partial.exists():
                shutil.rmtree(partial)
            dcp_to_hf(tmp, partial, tokenizer_path=self.tokenizer_path)
            if final.exists():
                shutil.rmtree(final)
            os.rename(partial, final)
            fsync_dir(self.folder)
            shutil.rmtree(tmp, ignore_errors=True)
            logger.info("saved Hugging Face checkpoint %s", final)
        _barrier()
        return final

    def export_weights_to(self, name: str) -> Path:
        """The model weights (and model_args) in ``export_dtype`` as the DCP folder ``name``, synchronously."""
        sd = {k: v.to(self.export_dtype) for k, v in self._model_sd().items()}
        return self._write(self._model_state(sd), name, force_sync=True, purge=False)

    def _write(self, state: dict[str, Any], name: str, force_sync: bool = False, purge: bool = True) -> Path:
        return self._writer.write(state, name, force_sync, after_publish=lambda final: self._published(final, purge))

    def _published(self, final: Path, purge: bool) -> None:
        """Rank 0, after the rename: log, and drop the oldest checkpoints of this lineage beyond keep_latest_k.
        A dot name (the temporary export a Hugging Face save streams from) is removed again: not logged."""
        if not final.name.startswith("."):
            logger.info("saved checkpoint %s", final)
        m = _STEP_RE.match(final.name)
        if m:
            signals.set_last_good(f"the last good checkpoint is {final.name} in {self.folder}")
            if purge:
                retain(self.folder, complete_steps(self.folder), self.keep_latest_k, int(m.group(1)))

    def wait(self) -> None:
        """Wait for an async write in flight, then publish it."""
        try:
            self._writer.wait()
        except SaveError as exc:
            self._save_failed(exc, last=False)

    def poll(self) -> None:
        """Publish an async write if it has finished (cheap; call once per step)."""
        try:
            self._writer.poll()
        except SaveError as exc:
            self._save_failed(exc, last=False)

    def close(self) -> None:
        try:
            self.wait()
        finally:
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
        """Restore the newest intact (or the ``load_step``) checkpoint into the model, optimizer,
        scheduler and loader, after verifying it against its manifest.

        Returns ``(step, tokens_seen)``; ``(0, 0)`` when there is nothing to resume. A seed
        checkpoint (model only) restores the model and returns step 0.

        A checkpoint written under another parallel layout loads too: DCP reshards the model and
        optimizer, and the data loader states are resharded (``reshard_loader_state``). A newest
        checkpoint that is damaged, truncated, unreadable or unverifiable is reported in one line,
        moved to ``damaged/``, and the next older one is tried (the module docstring). A
        ``load_step`` below the newest step forks the lineage (``trainer.checkpoint.lineage.fork``).

        Raises CheckpointError when the checkpoint lacks the optimizer state (not a seed), its
        optimizer state does not fit this run's optimizer (another optimizer or implementation: the
        message says what differs and the ways on; never "damaged", the checkpoint stays in place),
        the data loader states cannot be resharded or belong to another dataset, tokenizer or seq_len,
        the model does not match, or no checkpoint is intact (or, with strict_verify or an explicit
        load_step, the chosen one is not).
        """
        step = self.resolve_load_step()
        if step is None:
            return 0, 0
        if self.rank == 0:
            remove_leftovers(self.folder)
        candidates = [step] if self.load_step >= 0 else complete_steps(self.folder)[::-1]
        # Checkpoints written before manifests existed load unverified (unless strict), when none has one.
        legacy = not self.strict_verify and not any(
            (self.folder / f"step-{s}" / "manifest.json").exists() for s in complete_steps(self.folder))
        if legacy:
            logger.warning("checkpoints in %s have no manifest (written by an older version): loading step-%d "
                           "unverified", self.folder, step)
        damaged: list[int] = []
        skipped: list[int] = []
        for s in candidates:
            path = self.folder / f"step-{s}"
            problem = None if legacy else self._verify(path)
            self._verified = not legacy
            if problem is None:
                try:
                    result = self._load_step(path, s)
                except CheckpointError as exc:
                    if legacy and isinstance(exc, (_Unreadable, UnreadableCheckpoint)):
                        problem = str(exc)
                    else:
                        raise
                except _READ_ERRORS as exc:
                    if not legacy:  # the manifest verified every file: intact, so it does not fit this run
                        raise CheckpointError(
                            f"checkpoint {path} is intact (its manifest verifies) but cannot be loaded into this run "
                            f"({_error_line(exc)}); it is left in place. Resume it with the settings it was saved "
                            f"with, or start from its weights: --checkpoint.initial_load_path {path} "
                            f"--checkpoint.initial_load_model_only with another --checkpoint.folder") from None
                    problem = f"{path}: unreadable ({_error_line(exc)})"
                else:
                    self._after_load(s, damaged)
                    return result
            # Without a manifest a load error proves no damage: such a step is skipped, never set aside.
            what = "cannot be loaded (no manifest tells damage from a mismatch)" if legacy else "is damaged"
            if self.strict_verify or self.load_step >= 0:
                why = "--checkpoint.strict_verify" if self.strict_verify else f"--checkpoint.load_step {s}"
                raise CheckpointError(f"checkpoint step-{s} {what}: {problem} ({why}: not falling back to an "
                                      f"older checkpoint)")
            logger.warning("checkpoint step-%d %s: %s; falling back to the previous checkpoint", s, what, problem)
            (skipped if legacy else damaged).append(s)
        if skipped:
            raise CheckpointError(f"no checkpoint in {self.folder} loads into this run: "
                                  f"{', '.join(f'step-{s}' for s in skipped)} (see above; written before manifests, "
                                  f"so not verifiable); resume with the settings they were saved with, or start "
                                  f"afresh with another --checkpoint.folder")
        raise CheckpointError(f"no intact checkpoint to resume from in {self.folder}: "
                              f"{', '.join(f'step-{s}' for s in damaged)} failed verification (see above); move "
                              f"them away to start afresh")

    def _verify(self, path: Path) -> str | None:
        """None when ``path`` matches its manifest, else one line naming the bad file (all ranks agree).
        The ranks share the files: each checks every world_size-th."""
        try:
            record = read_manifest(path)
        except ManifestError as exc:  # UnverifiedCheckpoint too
            return str(exc)
        problems = [p for p in _all_gather(verify_files(path, record, _rank(), _world())) if p is not None]
        return problems[0] if problems else None

    def _load_step(self, path: Path, step: int) -> tuple[int, int]:
        keys = self._checked_keys(path)
        if not _has(keys, "optimizer"):
            if step != 0:
                raise CheckpointError(
                    f"checkpoint {path} holds model weights only; only step-0 (a seed) may; "
                    f"choose another --checkpoint.load_step or folder"
                )
            self._load_model(path)
            logger.info("loaded seed checkpoint %s (model weights)", path)
            self.loaded_from = f"the seed checkpoint {path}"
            return 0, 0
        result = self._load_all(path, keys)
        logger.info("resumed from checkpoint %s", path)
        self.loaded_from = f"the checkpoint {path}"
        return result

    def _after_load(self, step: int, damaged: list[int]) -> None:
        """Rank 0: damaged newer checkpoints are set aside; a load_step below the newest forks the lineage."""
        if self.rank == 0:
            for s in damaged:
                set_aside_damaged(self.folder, s)
            if self.load_step >= 0:
                fork(self.folder, step, complete_steps(self.folder))
        signals.set_last_good(f"the last good checkpoint is step-{step} in {self.folder}")
        _barrier()

    def _checked_keys(self, path: Path) -> set[str]:
        """The state dict keys of the DCP checkpoint ``path``, after checking its model_args against ours."""
        try:
            keys = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
        except _READ_ERRORS as exc:
            raise _Unreadable(f"{path}/.metadata: unreadable ({_error_line(exc)})") from None
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
            self.loaded_from = f"the Hugging Face checkpoint {path}"
            return 0, 0
        step_dir = resolve_step_folder(path)
        self.loaded_from = f"the checkpoint {step_dir}"
        self._verified = (step_dir / "manifest.json").exists() or self.strict_verify
        if self._verified:
            problem = self._verify(step_dir)
            if problem is not None:
                raise CheckpointError(f"checkpoint.initial_load_path: {problem}")
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

    def _check_optimizer_fits(self, path: Path, optim_state: dict[str, Any]) -> None:
        """Raise CheckpointError, saying what differs and the ways on, when the optimizer state of the
        checkpoint ``path`` does not fit this run's optimizer (``trainer.checkpoint.compatibility``)."""
        try:
            metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        except _READ_ERRORS as exc:
            raise _Unreadable(f"{path}/.metadata: unreadable ({_error_line(exc)})") from None
        found = optimizer_mismatch(metadata, optim_state)
        if found is None:
            change = state_dtype_change(metadata, optim_state)
            if change is not None:
                logger.info("the optimizer states of %s are %s; loaded as %s (--optimizer.state_dtype)", path, *change)
            return
        what, how = found
        state = "is intact but holds an" if self._verified else "(unverified: no manifest) holds an"
        raise CheckpointError(
            f"checkpoint {path} {state} optimizer state that does not fit this run: {what}. Either resume "
            f"it with the optimizer it was saved with ({how}), or start a new optimizer from its weights: "
            f"--checkpoint.initial_load_path {path} --checkpoint.initial_load_model_only with another "
            f"--checkpoint.folder (this one resumes its newest step)")

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
        if self.optimizer is not None:
            self._check_optimizer_fits(path, state["optimizer"])
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


def _error_line(exc: BaseException) -> str:
    """The first line of an exception's message (DCP's CheckpointException holds every rank's traceback)."""
    text = str(exc).strip()
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("Traceback", "File ", "CheckpointException ranks")) and "ranks:" not in line:
            return f"{type(exc).__name__}: {line[:200]}"
    return type(exc).__name__


def _has(keys: set[str], prefix: str) -> bool:
    return any(k == prefix or k.startswith(prefix + ".") for k in keys)
