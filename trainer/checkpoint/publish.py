"""Writing one checkpoint folder safely: free space first, DCP into ``.<name>.partial``, a manifest
of every file, then an atomic rename to ``<name>``; a failed write is one line and leaves nothing.

Free space. Before a write, rank 0 compares the file system's free bytes with the size of the
newest checkpoint in the folder (its manifest's total; for the first one, the tensors' bytes of
the state), and every rank gets its verdict (one broadcast per save). Too little space, or a write
that fails anyway (a full disk shows in DCP as ``No space left on device`` or PyTorch's zip writer's
``unexpected pos``), is a :class:`SaveError` naming the folder and the bytes needed, after the
``.partial`` folder is removed. Whether the run stops or continues without that checkpoint is the
caller's choice (``--checkpoint.on_save_error``).

Manifest (``trainer.checkpoint.manifest``). Synchronous writes: every rank hashes every
world_size-th data file (each its own, in practice, still in the page cache), rank 0 gathers the
entries, adds ``.metadata`` and writes ``manifest.json``, then renames. Asynchronous writes: rank 0
hashes all files in a background thread once the write has finished, and publishes at the next
:meth:`FolderWriter.poll` or :meth:`FolderWriter.wait` after that.
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from trainer.run import signals
from trainer.checkpoint.lineage import STEP_RE, remove_folder
from trainer.checkpoint.manifest import data_files, digest_files, manifest_bytes, write_manifest
from trainer.errors import SaveError  # noqa: F401  (defined on the ground floor)

logger = logging.getLogger("trainer")


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _dist():
        dist.barrier()


def fsync_dir(path: Path) -> None:
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


def state_bytes(obj: Any) -> int:
    """Bytes of the tensors in ``obj`` held by this rank (DTensors: the local shard)."""
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        return local.numel() * local.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    if isinstance(obj, (str, bytes)):
        return len(obj)
    return 0


def _clone_cpu_tensors(obj: Any) -> Any:
    """A copy of ``obj`` in which every CPU tensor is cloned (so training may change the originals)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone() if obj.device.type == "cpu" else obj
    if isinstance(obj, dict):
        return {k: _clone_cpu_tensors(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone_cpu_tensors(v) for v in obj]
    return obj


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    for line in text.splitlines():  # DCP's CheckpointException lists each rank's traceback
        if "Error" in line or "enforce fail" in line or "No space" in line:
            return line.strip()[:300]
    return text.splitlines()[0][:300]


def _disk_full(exc: BaseException) -> bool:
    text = str(exc)
    return "No space left" in text or "unexpected pos" in text or "ENOSPC" in text or (
        isinstance(exc, OSError) and exc.errno == 28)


class FolderWriter:
    """Writes DCP checkpoint folders into ``folder`` (rank 0 publishes; every rank writes its shards).

    Args:
        folder: the checkpoint folder.
        async_mode: "async" writes in the background (``dcp.async_save``), else synchronously.
        pg: the process group of asynchronous writes (None: the default one).
    """

    def __init__(self, folder: Path, async_mode: str = "disabled", pg=None) -> None:
        self.folder = folder
        self.async_mode = async_mode
        self.pg = pg
        self.rank = dist.get_rank() if _dist() else 0
        self.world_size = dist.get_world_size() if _dist() else 1
        self._pending: tuple[Future, Path, Path, Callable | None, int] | None = None
        self._last_bytes: int | None = None

    # -- space ----------------------------------------------------------------------------------------

    def _needed(self, state: dict[str, Any]) -> tuple[int, str]:
        """Bytes the next write needs, and where the figure comes from."""
        if self._last_bytes is None and self.folder.is_dir():
            steps = sorted((int(m.group(1)), p) for p in self.folder.iterdir() if (m := STEP_RE.match(p.name)))
            for _, path in reversed(steps):
                self._last_bytes = manifest_bytes(path)
                if self._last_bytes is not None:
                    break
        if self._last_bytes is not None:
            return self._last_bytes, "the size of the last checkpoint"
        return state_bytes(state) * self.world_size, "the size of the state"

    def _agree(self, value):
        """Rank 0's ``value`` on every rank."""
        if not _dist() or self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _check_space(self, name: str, needed: int, source: str) -> None:
        problem = None
        if self.rank == 0:
            free = shutil.disk_usage(self.folder).free
            if free < needed:
                problem = (f"not enough space for checkpoint {name} in {self.folder}: it needs about {needed:,} bytes "
                           f"({source}), {free:,} are free")
        problem = self._agree(problem)
        if problem is not None:
            raise SaveError(problem)

    def _failed(self, exc: BaseException, name: str, partial: Path, needed: int, collective: bool) -> SaveError:
        """Remove the partial folder (rank 0, once every rank has stopped writing) and describe the failure."""
        if collective:
            _barrier()
        message = None
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            free = shutil.disk_usage(self.folder).free if self.folder.is_dir() else 0
            if _disk_full(exc):
                message = (f"writing checkpoint {name} into {self.folder} failed: the disk is full; it needs about "
                           f"{needed:,} bytes, {free:,} are free (the .partial folder was removed)")
            else:
                message = (f"writing checkpoint {name} into {self.folder} failed: {_first_line(exc)} "
                           f"(the .partial folder was removed)")
        if collective:
            message = self._agree(message)
        return SaveError(message or f"writing checkpoint {name} into {self.folder} failed on another rank")

    # -- writing --------------------------------------------------------------------------------------

    def write(self, state: dict[str, Any], name: str, force_sync: bool = False,
              after_publish: Callable[[Path], None] | None = None) -> Path:
        """Write ``state`` as the folder ``name`` (asynchronously in async mode unless ``force_sync``);
        rank 0 calls ``after_publish(final)`` once it is published. Returns the final path.

        Raises SaveError (one line) when there is not enough space or the write fails."""
        final, partial = self.folder / name, self.folder / f".{name}.partial"
        if self.rank == 0:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise SaveError(f"cannot create the checkpoint folder {self.folder}: {exc.strerror or exc}") from None
            if partial.exists():  # left by a crash
                shutil.rmtree(partial)
        needed, source = self._needed(state)
        self._check_space(name, needed, source)
        _barrier()
        if self.async_mode == "async" and not force_sync:
            future = dcp.async_save(_clone_cpu_tensors(state), checkpoint_id=str(partial), process_group=self.pg)
            if self.rank == 0:  # hash in the background too, once every rank's files are written
                future = _then(future, lambda: digest_files(partial, data_files(partial)))
            self._pending = (future, partial, final, after_publish, needed)
            return final
        with signals.saving(f"{name} in {self.folder}"):
            try:
                dcp.save(state, checkpoint_id=str(partial))
            except (CheckpointException, OSError, RuntimeError) as exc:
                raise self._failed(exc, name, partial, needed, collective=True) from None
            entries = self._digest_shared(partial)
            if self.rank == 0:
                self._publish(partial, final, entries, after_publish)
            _barrier()
        return final

    def _digest_shared(self, partial: Path) -> dict[str, dict] | None:
        """The manifest entries, hashed by all ranks (each every world_size-th data file); rank 0 gets them all."""
        shards = sorted(n for n in data_files(partial) if n.endswith(".distcp"))[self.rank::self.world_size]
        mine = digest_files(partial, shards)
        if _dist() and self.world_size > 1:
            gathered = [None] * self.world_size if self.rank == 0 else None
            dist.gather_object(mine, gathered, dst=0)
            if self.rank != 0:
                return None
            for part in gathered:
                mine.update(part)
        if self.rank == 0:  # .metadata and anything else that is not a rank's data file
            rest = [n for n in data_files(partial) if n not in mine]
            mine.update(digest_files(partial, rest))
        return mine

    def _publish(self, partial: Path, final: Path, entries: dict[str, dict], after_publish) -> None:
        """Rank 0: the manifest, then the rename that makes ``final`` a checkpoint."""
        self._last_bytes = write_manifest(partial, entries)
        fsync_dir(partial)
        if final.exists():  # re-saving a step (e.g. after a resume): replace it
            remove_folder(final)
        os.rename(partial, final)
        fsync_dir(self.folder)
        if after_publish is not None:
            after_publish(final)

    def wait(self) -> None:
        """Wait for an asynchronous write in flight, then publish it (rank 0).

        Raises SaveError when it failed (its .partial removed)."""
        if self._pending is None:
            return
        future, partial, final, after_publish, needed = self._pending
        self._pending = None
        try:
            entries = future.result()
        except (CheckpointException, OSError, RuntimeError) as exc:
            raise self._failed(exc, final.name, partial, needed, collective=False) from None
        if self.rank == 0:
            self._publish(partial, final, entries, after_publish)

    def poll(self) -> None:
        """Publish an asynchronous write if it has finished (cheap; once per step)."""
        if self._pending is not None and self._pending[0].done():
            self.wait()

    @property
    def pending(self) -> bool:
        return self._pending is not None


def _then(future: Future, fn: Callable[[], Any]) -> Future:
    """A future of ``fn()`` run in a thread after ``future`` succeeded (its exception otherwise)."""
    out: Future = Future()

    def run() -> None:
        try:
            future.result()
            out.set_result(fn())
        except BaseException as exc:  # noqa: BLE001  (handed to the waiter)
            out.set_exception(exc)

    threading.Thread(target=run, name="checkpoint-manifest", daemon=True).start()
    return out
