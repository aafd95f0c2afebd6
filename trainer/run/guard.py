"""What keeps a run safe around its loop, in one place the Trainer calls: the dump folder's checks
and lock (``trainer.run.folder``), preemption signals and Ctrl-C (``trainer.run.signals``), the hang
watchdog (``trainer.run.watchdog``), the test-only fault hooks (``trainer.run.fault_injection``) and the
warning for too little data.

Order in ``Trainer.setup``: :meth:`RunGuard.before_process_group` (flight-recorder variables),
the process group (with ``--comm.init_timeout_seconds``), :meth:`claim_folder` (before any data is
read or model built), ..., :meth:`start` (after the resume). In the loop: :meth:`step_done` after
every step, :meth:`long_phase` before a validation or a save, :meth:`should_stop` at each step
boundary (the ranks' agreement on a preemption stop). :meth:`close` at the end, on any exit.

Exit codes of ``python -m trainer``: 0 done; 1 the run cannot proceed (model too large for the
machine, non-finite loss, unusable checkpoint, a failed save, data errors, a dump folder that is
read-only, a file or in use by another run: one line, no traceback), or a hang (the watchdog wrote
every rank's stacks to ``<dump_folder>/stacks/``); 2 a configuration error; 75 stopped by a
preemption signal after saving a checkpoint (run the same command to resume); 124 the preemption
grace period ran out before that checkpoint was saved; 130 Ctrl-C.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch.distributed as dist

from trainer.run.fault_injection import FaultInjector
from trainer.run.folder import RunFolderError, RunLock, check_dump_folder
from trainer.run.signals import EXIT_PREEMPTED, PreemptionHandler
from trainer.errors import TrainingError
from trainer.run.watchdog import StepWatchdog, flight_recorder_env

logger = logging.getLogger("trainer")


class Preempted(Exception):
    """The run stopped after a preemption signal (with a checkpoint when ``resumable``); ``main`` exits
    with status 75."""

    exit_code = EXIT_PREEMPTED

    def __init__(self, message: str, resumable: bool = True) -> None:
        super().__init__(message)
        self.resumable = resumable


class RunGuard:
    """The run's protections (module docstring) for ``config`` on global ``rank`` of ``world_size``."""

    def __init__(self, config, rank: int, world_size: int) -> None:
        self.config, self.rank, self.world_size = config, rank, world_size
        self.dump_folder = Path(config.job.dump_folder)
        self.lock: RunLock | None = None
        self.preemption: PreemptionHandler | None = None
        self.watchdog: StepWatchdog | None = None
        self.faults = FaultInjector(rank)
        self._group = None

    def before_process_group(self, device_type: str) -> None:
        """NCCL's flight recorder dumps the last collectives on a timeout (its variables must be set first)."""
        if device_type == "cuda":
            flight_recorder_env(self.dump_folder)

    def claim_folder(self) -> None:
        """Rank 0 checks the dump folder and takes the run's lock; every rank gets the verdict.

        Raises TrainingError (one line): a file in the way, a read-only folder, another run holds it."""
        problem = None
        if self.rank == 0:
            try:
                check_dump_folder(self.dump_folder)
                self.lock = RunLock(self.dump_folder)
            except RunFolderError as exc:
                problem = str(exc)
        if self.world_size > 1 and dist.is_initialized():
            box = [problem]
            dist.broadcast_object_list(box, src=0)
            problem = box[0]
        if problem is not None:
            raise TrainingError(problem)

    def warn_repeats(self, loader, global_batch: int, seq_len: int, steps: int) -> None:
        """Warn once (rank 0) when the run reads its data more than once."""
        if self.rank != 0:
            return
        message = loader.repeat_warning(global_batch * (seq_len + 1), steps)
        if message is not None:
            logger.warning("%s", message)

    def start(self) -> None:
        """Signals and the watchdog, once the run is set up (every rank: it creates a process group)."""
        c = self.config
        if self.world_size > 1 and dist.is_initialized():
            # The agreement's all-reduce runs beside training: a gloo group of its own.
            self._group = dist.new_group(backend="gloo")
        self.preemption = PreemptionHandler(c.checkpoint.preempt_signals, c.checkpoint.preempt_grace_seconds,
                                            self._group, checkpoint=c.checkpoint.enable)
        self.watchdog = StepWatchdog(self.dump_folder, self.rank, c.comm.train_timeout_seconds,
                                     c.comm.init_timeout_seconds)

    def step_done(self) -> None:
        if self.watchdog is not None:
            self.watchdog.step_done()

    def long_phase(self) -> None:
        if self.watchdog is not None:
            self.watchdog.long_phase()

    def should_stop(self) -> bool:
        return self.preemption is not None and self.preemption.should_stop()

    def stopped(self, step: int) -> Preempted:
        """The run stops after ``step`` on a preemption signal (its checkpoint saved when checkpoints are on):
        the exception that ends the run."""
        self.preemption.saved(step)
        by = self.preemption.received or "a signal"
        if not self.preemption.checkpoint:
            return Preempted(f"stopped after step {step} by {by}, with no checkpoint (--checkpoint.enable is off: "
                             "a rerun starts at step 1)", resumable=False)
        return Preempted(f"stopped after step {step} by {by}")

    def failed(self, exc: BaseException) -> None:
        """An unexpected error ends the loop: write the stacks too (e.g. a collective that timed out)."""
        if self.watchdog is not None and not isinstance(exc, (TrainingError, KeyboardInterrupt, Preempted)):
            self.watchdog.dump(exc)

    def close(self) -> None:
        """Undo everything, safe after a partial setup and twice: watchdog, handlers, group, lock."""
        if self.watchdog is not None:
            self.watchdog.close()
            self.watchdog = None
        if self.preemption is not None:
            self.preemption.close()
            self.preemption = None
        if self._group is not None and dist.is_initialized():
            dist.destroy_process_group(self._group)
        self._group = None
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def report_exit(exc: BaseException, rank: int, world_size: int, same_on_all_ranks: bool = False) -> int:
    """Print the one line that ends a run (``python -m trainer: ...``) and return its exit code: 75 for
    a preemption stop (rank 0 prints), else 1 (every rank prints, prefixed by its rank, unless the
    error is ``same_on_all_ranks``: then rank 0 only)."""
    if isinstance(exc, Preempted):
        if rank == 0:
            hint = "; run the same command to resume" if exc.resumable else ""
            print(f"python -m trainer: {exc}{hint}", file=sys.stderr, flush=True)
        return exc.exit_code
    if same_on_all_ranks and rank != 0:
        return 1
    where = f"[rank {rank}] " if world_size > 1 and not same_on_all_ranks else ""
    print(f"python -m trainer: error: {where}{exc}", file=sys.stderr, flush=True)
    return 1
