"""The hang watchdog: a step that makes no progress ends the process with every thread's Python stack.

``--comm.train_timeout_seconds T`` (torchtitan's key): every rank re-arms ``faulthandler``'s timer
at each step boundary (a C call; its thread needs no GIL, so it fires even when the interpreter
is stuck in a collective or in C code). If T seconds pass without the next boundary, it writes the
Python stacks of all threads to ``<dump_folder>/stacks/rank<r>.txt`` and exits the process with
status 1, so the launcher (torchrun ``--max-restarts``, Slurm) restarts the group, which resumes
from the last good checkpoint. A stuck rank stalls the others in their next collective, so every
rank's watchdog fires and every rank leaves its stacks. Until the first step is done (start-up,
compilation, loading) and during checkpoint saves and validation the limit is
``--comm.init_timeout_seconds``.

The process group's timeout follows the same two values (:func:`set_group_timeout`, as torchtitan
does): a collective that times out raises an error, and :meth:`StepWatchdog.dump` writes the stacks
on that path too. On NCCL, :func:`flight_recorder_env` turns on PyTorch's flight recorder, which
dumps the last collectives of every rank to ``<dump_folder>/comm_traces/`` on a timeout.
"""
from __future__ import annotations

import faulthandler
import logging
import os
import time
import traceback
from datetime import timedelta
from pathlib import Path

logger = logging.getLogger("trainer")


def flight_recorder_env(dump_folder: str | os.PathLike) -> None:
    """Set the PyTorch NCCL flight recorder's variables (before the process group starts; a value the
    user set wins): record the last 2000 collectives and dump them on a timeout into
    ``<dump_folder>/comm_traces/rank_<r>``."""
    folder = Path(dump_folder) / "comm_traces"
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(folder / "rank_"))
    folder.mkdir(parents=True, exist_ok=True)


def set_group_timeout(seconds: int) -> None:
    """Set the default process group's (and its subgroups') collective timeout to ``seconds``."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return
    timeout = timedelta(seconds=seconds)
    for group in list(c10d._world.pg_map):  # the default group and every subgroup
        try:
            c10d._set_pg_timeout(timeout, group)
        except (RuntimeError, ValueError, AttributeError):  # e.g. a group of a backend without timeouts
            pass


class StepWatchdog:
    """Per-rank hang watchdog (module docstring). ``train_timeout`` 0 disables it.

    Args:
        dump_folder: the stacks go to ``dump_folder/stacks/rank<rank>.txt``.
        rank: this process's global rank.
        train_timeout: seconds a step may take once the first step is done.
        init_timeout: seconds allowed before that, and for a checkpoint save or a validation.
    """

    def __init__(self, dump_folder: str | os.PathLike, rank: int, train_timeout: int, init_timeout: int) -> None:
        self.enabled = train_timeout > 0
        self.train_timeout, self.init_timeout = train_timeout, init_timeout
        self.path = Path(dump_folder) / "stacks" / f"rank{rank}.txt"
        self._file = None
        self._trained = False
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "w")  # faulthandler writes to a file descriptor: open it now
        self._file.write(f"# rank {rank}, pid {os.getpid()}: Python stacks when a step made no progress for "
                         f"--comm.train_timeout_seconds {train_timeout}\n")
        self._file.flush()
        self.arm(init_timeout)

    def arm(self, seconds: int) -> None:
        """Fire (stacks + exit 1) unless re-armed or stopped within ``seconds``."""
        if self._file is not None:
            faulthandler.dump_traceback_later(seconds, repeat=False, file=self._file, exit=True)

    def step_done(self) -> None:
        """A step boundary: the next step has ``train_timeout`` seconds."""
        if self._file is not None and not self._trained:
            self._trained = True
            set_group_timeout(self.train_timeout)
        self.arm(self.train_timeout if self._trained else self.init_timeout)

    def long_phase(self) -> None:
        """A checkpoint save or a validation follows: allow ``init_timeout`` seconds for it."""
        self.arm(self.init_timeout)

    def dump(self, exc: BaseException) -> None:
        """Write the traceback of ``exc`` (e.g. a collective that timed out, or whose peer died) and
        every thread's stack now."""
        if self._file is not None:
            self._file.write(f"\n# {time.strftime('%H:%M:%S')} the run failed:\n")
            self._file.write("".join(traceback.format_exception(exc)))
            self._file.flush()
            faulthandler.dump_traceback(file=self._file, all_threads=True)
            self._file.flush()

    def close(self) -> None:
        """Disarm; the stacks file is removed when nothing was written to it beyond its header."""
        if self._file is None:
            return
        faulthandler.cancel_dump_traceback_later()
        dumped = self._file.tell() > 0 and self.path.read_text().count("\n") > 1
        self._file.close()
        self._file = None
        if not dumped:
            self.path.unlink(missing_ok=True)
            try:
                self.path.parent.rmdir()
            except OSError:
                pass
