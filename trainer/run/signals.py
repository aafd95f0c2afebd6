"""Signals: a preemption notice stops the run at a step all ranks agree on, with a checkpoint.

Preemption (``--checkpoint.preempt_signals``, SIGTERM and SIGUSR1 by default; Slurm sends SIGUSR1
ahead of the time limit with ``#SBATCH --signal=USR1@90``, and SIGTERM before it kills a job). The
handler only records the signal. At each step boundary every rank puts its flag into a small
all-reduce (MAX) on a gloo group of its own, started without waiting (``async_op``) and read at the
next boundary, when it has long finished: no step waits for it, and every rank reads the same
result after the same step. So the run stops at the end of the step after the one in flight when
the signal came, saves a checkpoint there and exits with status 75 (EX_TEMPFAIL: run the same
command again to resume). One process needs no agreement and stops after the current step.
Repeats of a preemption signal are ignored (Slurm signals every process of the job and torchrun
forwards the signal again). If the checkpoint is not saved within ``--checkpoint.preempt_grace_seconds``
of the first signal, the process exits at once with status 124; the last published checkpoint is
intact (publishing is an atomic rename).

Ctrl-C (SIGINT): the first one interrupts the run as usual (KeyboardInterrupt: ``python -m trainer``
exits 130 with one line). During a synchronous checkpoint write, or after a preemption signal, or a
second time, it exits at once with status 130 and one line; the write's ``.partial`` folder is left
(the next save removes it) and the last good checkpoint is intact.

Handlers can only be installed from the main thread; elsewhere (a trainer driven from a thread)
the signals keep their previous handlers. :meth:`PreemptionHandler.close` restores them.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger("trainer")

EXIT_PREEMPTED = 75  # stopped by a preemption signal after saving a checkpoint (sysexits EX_TEMPFAIL)
EXIT_GRACE_EXPIRED = 124  # the checkpoint could not be saved within the grace period
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)

# What the main thread is saving right now (a SIGINT then exits at once), and the last good checkpoint.
_saving: str | None = None
_last_good: str = "no checkpoint was written"


@contextmanager
def saving(what: str):
    """Mark a synchronous checkpoint write of ``what`` (e.g. ``step-40 in outputs/checkpoint``)."""
    global _saving
    previous, _saving = _saving, what
    try:
        yield
    finally:
        _saving = previous


def set_last_good(description: str) -> None:
    """The words naming the last published checkpoint, for the messages of an abort."""
    global _last_good
    _last_good = description


def _abort(message: str, code: int) -> None:
    """One line on stderr, then exit at once (no cleanup that could block: the lock is the kernel's)."""
    try:
        sys.stderr.write(f"python -m trainer: {message}\n")
        sys.stderr.flush()
    finally:
        os._exit(code)


class PreemptionHandler:
    """Records preemption signals and SIGINT; :meth:`should_stop` is the ranks' agreement.

    Args:
        signal_names: the preemption signals (``checkpoint.preempt_signals``), e.g. ``["SIGTERM"]``.
        grace_seconds: exit at once this long after the first preemption signal.
        group: a gloo process group for the agreement, or None for one process.
    """

    def __init__(self, signal_names: list[str], grace_seconds: float, group=None, checkpoint: bool = True) -> None:
        self.grace_seconds = grace_seconds
        self.checkpoint = checkpoint  # False: --checkpoint.enable is off, the stop saves nothing
        self.group = group
        self.received: str | None = None  # name of the first preemption signal
        self.received_at = 0.0
        self._sigints = 0
        self._flag = torch.zeros(1, dtype=torch.int32)
        self._pending = None  # (work, tensor) of the all-reduce started at the last boundary
        self._timer: threading.Timer | None = None
        self._previous: dict[int, object] = {}
        if threading.current_thread() is not threading.main_thread():
            logger.info("not in the main thread: preemption signals and Ctrl-C keep their handlers")
            return
        for name in signal_names:
            self._install(getattr(signal, name), self._on_preempt)
        self._install(signal.SIGINT, self._on_sigint)

    def _install(self, sig: int, handler) -> None:
        self._previous[sig] = signal.signal(sig, handler)

    # -- handlers (main thread, between bytecodes) ---------------------------------------------------

    def _on_preempt(self, signum, frame) -> None:
        if self.received is not None:
            return  # a repeat (Slurm signals every process of the step; torchrun forwards it again)
        self.received = signal.Signals(signum).name
        self.received_at = time.monotonic()
        self._flag.fill_(1)
        logger.warning("%s received: stopping at the next step the ranks agree on, %s (within %.0fs)", self.received,
                       "with a checkpoint" if self.checkpoint else "without a checkpoint (--checkpoint.enable is off)",
                       self.grace_seconds)
        self._timer = threading.Timer(self.grace_seconds, self._grace_expired)
        self._timer.daemon = True
        self._timer.start()

    def _grace_expired(self) -> None:
        _abort(f"error: {self.received} received {self.grace_seconds:.0f}s ago (--checkpoint.preempt_grace_seconds) "
               f"and the checkpoint is not saved yet; exiting now; {_last_good}", EXIT_GRACE_EXPIRED)

    def _on_sigint(self, signum, frame) -> None:
        self._sigints += 1
        if _saving is not None:
            _abort(f"interrupted while saving checkpoint {_saving} (its .partial folder is removed by the next "
                   f"save); {_last_good}", EXIT_INTERRUPTED)
        if self._sigints > 1 or self.received is not None:
            _abort(f"interrupted again; exiting at once; {_last_good}", EXIT_INTERRUPTED)
        raise KeyboardInterrupt

    # -- agreement -------------------------------------------------------------------------------------

    def should_stop(self) -> bool:
        """Whether to stop after the step that just finished (call at every step boundary, on every rank).

        One process: this rank's flag. Several: the all-reduce started at the previous boundary
        (whose result is the same on every rank), and a new one is started with the current flag."""
        if self.group is None:
            return self.received is not None
        stop = False
        if self._pending is not None:
            work, value = self._pending
            work.wait()
            stop = bool(value.item())
        value = self._flag.clone()
        self._pending = (dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group, async_op=True), value)
        return stop

    def saved(self, step: int) -> None:
        """The stop step is done (its checkpoint published, when checkpoints are on): no more grace timer."""
        if self._timer is not None:
            self._timer.cancel()
        if not self.checkpoint:
            logger.warning("%s: stopped after step %d, %.1fs after the signal, with no checkpoint "
                           "(--checkpoint.enable is off: a rerun starts at step 1); exiting with status %d",
                           self.received or "stop", step, time.monotonic() - self.received_at, EXIT_PREEMPTED)
            return
        logger.warning("%s: saved the checkpoint of step %d %.1fs after the signal; exiting with status %d "
                       "(run the same command to resume)", self.received or "stop", step,
                       time.monotonic() - self.received_at, EXIT_PREEMPTED)

    def close(self) -> None:
        """Restore the previous handlers and wait for an all-reduce in flight (every rank started it)."""
        if self._timer is not None:
            self._timer.cancel()
        if self._pending is not None:
            try:  # every rank started it; after an error a peer may be gone: do not wait long
                self._pending[0].wait(timedelta(seconds=2))
            except Exception:  # noqa: BLE001  (a broken group: nothing left to agree on)
                pass
            self._pending = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
