"""The hang watchdog: a step that makes no progress ends the process with every thread's Python stack.

``--comm.train_timeout_seconds T`` (torchtitan's key): every rank re-arms its watchdog at each step
boundary. If T seconds pass without the next boundary, it writes the Python stacks of all threads
to ``<dump_folder>/stacks/rank<r>.txt``, prints one line on the rank's console (stderr: which rank,
which step made no progress, for how long, where the stacks are) and exits the process with
status 1, so the launcher (torchrun ``--max-restarts``, Slurm) restarts the group, which resumes
from the last good checkpoint. A stuck rank stalls the others in their next collective, so every
rank's watchdog fires and every rank leaves its stacks and its line. Until the first step is done
(start-up, compilation, loading) and during checkpoint saves and validation the limit is
``--comm.init_timeout_seconds``.

Two timers: a Python thread (waiting on an event, woken by each re-arm) fires at T, writes the
stacks (``faulthandler.dump_traceback``), the console line (one ``os.write`` to stderr: no Python
lock a stuck thread could hold) and exits. It needs the GIL, which collectives, sleeps and I/O
release; a C call that holds it forever would silence it, so ``faulthandler``'s own timer (a C
thread that needs no GIL) is armed ``BACKSTOP_S`` seconds later and still writes the stacks and
exits, without the console line (its stacks file starts with faulthandler's "Timeout" header).

The process group's timeout follows the same two values (:func:`set_group_timeout`, as torchtitan
does): a collective that times out raises an error, and :meth:`StepWatchdog.dump` writes the stacks
on that path too. On NCCL, :func:`flight_recorder_env` turns on PyTorch's flight recorder, which
dumps the last collectives of every rank to ``<dump_folder>/comm_traces/`` on a timeout.
"""
from __future__ import annotations

import faulthandler
import logging
import os
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

logger = logging.getLogger("trainer")
BACKSTOP_S = 5  # faulthandler's timer fires this long after the Python thread's (module docstring)


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
        if train_timeout < 0 or (train_timeout > 0 and init_timeout < 1):
            raise ValueError(f"StepWatchdog: expected train_timeout >= 0 (0 = off) and init_timeout >= 1, got "
                             f"{train_timeout} and {init_timeout}")
        self.enabled = train_timeout > 0
        self.rank = rank
        self.train_timeout, self.init_timeout = train_timeout, init_timeout
        self.path = Path(dump_folder) / "stacks" / f"rank{rank}.txt"
        self._file = None
        self._trained = False
        self._step = 0  # the last finished step
        self._what = "start-up (before the first step)"  # what must make progress: the console line names it
        self._deadline = self._limit = 0.0
        self._option = "init_timeout_seconds"
        self._wake = threading.Event()
        self._thread = None
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "w")  # faulthandler writes to a file descriptor: open it now
        self._file.write(f"# rank {rank}, pid {os.getpid()}: Python stacks when a step made no progress for "
                         f"--comm.train_timeout_seconds {train_timeout}\n")
        self._file.flush()
        self.arm(init_timeout)
        self._thread = threading.Thread(target=self._watch, name="titan-hang-watchdog", daemon=True)
        self._thread.start()

    def arm(self, seconds: int, option: str = "init_timeout_seconds") -> None:
        """Fire (stacks, console line, exit 1) unless re-armed or stopped within ``seconds`` (the value
        of ``--comm.<option>``, which the console line names)."""
        if self._file is None:
            return
        self._limit, self._option = seconds, option
        self._deadline = time.monotonic() + seconds
        self._wake.set()  # the thread re-reads the deadline (it may be earlier than the one it waits for)
        faulthandler.dump_traceback_later(seconds + BACKSTOP_S, repeat=False, file=self._file, exit=True)

    def step_done(self, step: int | None = None) -> None:
        """A step boundary (``step``: the step just finished; None: the one after the last): the next
        step has ``train_timeout`` seconds."""
        self._step = self._step + 1 if step is None else step
        self._what = f"step {self._step + 1}"
        self.arm(self.train_timeout, "train_timeout_seconds")  # first: the group's timeout below takes a while once
        if self._file is not None and not self._trained:
            self._trained = True
            set_group_timeout(self.train_timeout)

    def long_phase(self) -> None:
        """A checkpoint save or a validation follows: allow ``init_timeout`` seconds for it."""
        self._what = f"the validation or checkpoint save after step {self._step}"
        self.arm(self.init_timeout)

    def _watch(self) -> None:
        # Sleeps until the deadline; a re-arm wakes it to read the new one.
        while self._file is not None:
            self._wake.clear()
            left = self._deadline - time.monotonic()
            if left <= 0:
                self._fire()
                return
            self._wake.wait(left)

    def _fire(self) -> None:
        """Stacks to the file, one line to the console, exit 1 (module docstring)."""
        f = self._file
        if f is None:  # closed meanwhile
            return
        what, limit = self._what, self._limit
        try:
            f.write(f"\n# {time.strftime('%H:%M:%S')} {what} made no progress for {limit} s "
                    f"(--comm.{self._option}):\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
            f.flush()
        finally:
            line = (f"rank {self.rank}: hang watchdog: {what} made no progress for {limit} s "
                    f"(--comm.{self._option}); the Python stacks of every thread are in {self.path}; "
                    "exiting with status 1\n")
            try:
                os.write(2, line.encode())
            except OSError:  # no console (stderr closed): the stacks file is written, exit anyway
                pass
            os._exit(1)

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
        file, self._file = self._file, None  # the thread sees None and stops
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._file = file
        dumped = self._file.tell() > 0 and self.path.read_text().count("\n") > 1
        self._file.close()
        self._file = None
        if not dumped:
            self.path.unlink(missing_ok=True)
            try:
                self.path.parent.rmdir()
            except OSError:
                pass
