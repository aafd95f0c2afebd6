"""Profiler traces and CUDA memory snapshots, as torchtitan takes them (``[profiling]`` keys).

Traces (``--profiling.enable_profiling``): ``torch.profiler`` runs on a cycle of ``profile_freq``
steps: it waits, warms up for ``profiler_warmup`` steps, then records the last ``profiler_active``
steps of the cycle. At the end of each cycle every rank writes a Chrome trace (open it in
chrome://tracing or Perfetto) to
``<dump_folder>/<save_traces_folder>/iteration_<step>/rank<r>_trace.json``, ``<step>`` being the
last recorded step (a multiple of ``profile_freq``). CPU activity always; CUDA kernels on GPUs.

Memory snapshots (``--profiling.enable_memory_snapshot``, CUDA only): allocations are recorded from
the start (``torch.cuda.memory._record_memory_history``), and every ``profile_freq`` steps each rank
writes ``<dump_folder>/<save_memory_snapshot_folder>/iteration_<step>/rank<r>_memory_snapshot.pickle``
(drag it onto pytorch.org/memory_viz); when the run ends in a CUDA out-of-memory error, the snapshot
of that moment goes to ``iteration_<step>_exit/``. On a CPU the trainer says once that snapshots are
CUDA-only and writes none.

Validation (``Profiler.validation``, around each evaluation): marked ``validation`` in the trace and,
unless ``--profiling.include_validation``, left out of it: the step's profiler range ends before the
evaluation (so a cycle whose last step validates writes its trace first) and collection is paused
while it runs (an evaluation after an earlier step of the cycle is an empty gap at the start of the
next step's range). A trace of a step that validates then shows the training step, not mostly the
forward passes of the validation batches.
"""
from __future__ import annotations

import contextlib
import logging
import pickle
import warnings
from pathlib import Path

import torch

logger = logging.getLogger("trainer")

# Allocation events kept by the CUDA caching allocator's history (torchtitan's default).
MEMORY_HISTORY_ENTRIES = 100_000


class Profiler:
    """Steps ``torch.profiler`` and the memory history alongside the training loop.

    Args:
        cfg: the ``profiling`` config section.
        dump_folder: the run's ``job.dump_folder``.
        rank: this process's global rank (names the files).
        device: the training device (CUDA activity and snapshots only on CUDA).
        start_step: the last step already done (after a resume), so the cycles stay aligned to steps.

    Use as a context manager around the loop and call ``step(step)`` after each training step.
    """

    def __init__(self, cfg, dump_folder: str, rank: int, device: torch.device, start_step: int = 0) -> None:
        self.cfg, self.rank, self.device = cfg, rank, device
        self.freq = cfg.profile_freq
        self.trace_folder = Path(dump_folder) / cfg.save_traces_folder
        self.snapshot_folder = Path(dump_folder) / cfg.save_memory_snapshot_folder
        self._start_step = start_step
        self._step = start_step
        self._stepped = start_step  # the last training step the profiler was told of (prof.step())
        self._prof: torch.profiler.profile | None = None
        self._snapshots = cfg.enable_memory_snapshot and device.type == "cuda"
        if cfg.enable_memory_snapshot and device.type != "cuda":
            logger.warning("--profiling.enable_memory_snapshot: memory snapshots are CUDA-only (the CUDA caching "
                           "allocator's history); this run is on %s, so none are written", device.type)
        self.traces_written: list[Path] = []
        self.snapshots_written: list[Path] = []

    # -- traces ------------------------------------------------------------------------------------

    def _trace_ready(self, prof: torch.profiler.profile) -> None:
        folder = self.trace_folder / f"iteration_{prof.step_num}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{self.rank}_trace.json"
        prof.export_chrome_trace(str(path))
        self.traces_written.append(path)
        logger.info("profiler trace of step(s) %d..%d written to %s", prof.step_num - self.cfg.profiler_active + 1,
                    prof.step_num, path)

    def __enter__(self) -> "Profiler":
        if self.cfg.enable_profiling:
            active, warmup = self.cfg.profiler_active, self.cfg.profiler_warmup
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._activities = activities
            self._prof = torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(wait=self.freq - warmup - active, warmup=warmup, active=active),
                on_trace_ready=self._trace_ready,
                record_shapes=True,
            )
            # The profiler counts the steps it has seen; after a resume it starts at the resumed step,
            # so step s is always profiler step s - 1 and the traces stay at multiples of profile_freq.
            self._prof.step_num = self._start_step
            self._prof.__enter__()
            logger.info("profiling: a trace every %d steps (step(s) %d..%d of each cycle) under %s/iteration_<step>/",
                        self.freq, self.freq - active + 1, self.freq, self.trace_folder)
        if self._snapshots:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
            logger.info("memory snapshots every %d steps under %s/iteration_<step>/", self.freq, self.snapshot_folder)
        return self

    def step(self, step: int) -> None:
        """Training step ``step`` is done."""
        self._step = step
        self._advance(step)
        if self._snapshots and step % self.freq == 0:
            self._dump_snapshot(f"iteration_{step}")

    def _advance(self, step: int) -> None:
        """``prof.step()`` once per training step: the profiler's step ``step`` ends now."""
        if self._prof is not None and self._stepped < step:
            self._stepped = step
            with warnings.catch_warnings():
                # torch warns at each cycle that events of past cycles are dropped: that is the intent.
                warnings.filterwarnings("ignore", message=".*Profiler clears events")
                self._prof.step()

    @contextlib.contextmanager
    def validation(self):
        """Around the validation pass after a training step: a ``validation`` range in the trace.
        Unless ``cfg.include_validation``, the step's profiler range ends before it (its trace is
        written then, at the end of a cycle) and collection pauses while it runs."""
        if not self.cfg.include_validation:
            self._advance(self._step + 1)
        prof = self._prof
        paused = (prof is not None and not self.cfg.include_validation
                  and prof.current_action != torch.profiler.ProfilerAction.NONE)
        if paused:
            prof.toggle_collection_dynamic(False, self._activities)
        try:
            with torch.profiler.record_function("validation"):
                yield
        finally:
            if paused:
                prof.toggle_collection_dynamic(True, self._activities)

    def _dump_snapshot(self, name: str) -> None:
        folder = self.snapshot_folder / name
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{self.rank}_memory_snapshot.pickle"
        with open(path, "wb") as fh:
            pickle.dump(torch.cuda.memory._snapshot(), fh)
        self.snapshots_written.append(path)
        logger.info("memory snapshot written to %s", path)

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._prof is not None:
            # A cycle cut short by the end of the run is not saved (as torch.profiler does).
            self._prof.on_trace_ready = None
            self._prof.__exit__(None, None, None)
            self._prof = None
        if self._snapshots:
            if exc_type is not None and issubclass(exc_type, torch.OutOfMemoryError):
                self._dump_snapshot(f"iteration_{self._step}_exit")
            torch.cuda.memory._record_memory_history(enabled=None)
            self._snapshots = False
