"""Test-only fault hooks: ``TRAINER_FAULT="<kind>:rank=<r>:step=<s>[:restart=<n>]"`` (several joined by ``;``).

At the given point of step ``s`` on global rank ``r`` (and only in torchrun restart ``n``, default
0, so a restarted group runs clean): ``kill`` sends the process SIGKILL after the step's forward
and backward (a crash mid-step), ``hang`` sleeps forever there (a stuck rank), ``sigterm`` sends
the process SIGTERM (a preemption notice). Used by the fault-injection tests
(``tests/trainer/test_resilience_*.py``, ``tests/distributed/test_fault_*.py``); without the
variable nothing happens and nothing is checked per step beyond one attribute test.
"""
from __future__ import annotations

import os
import signal
import time

ENV = "TRAINER_FAULT"
KINDS = ("kill", "hang", "sigterm")


def _parse(spec: str) -> list[dict]:
    faults = []
    for item in filter(None, (p.strip() for p in spec.split(";"))):
        kind, *fields = item.split(":")
        if kind not in KINDS:
            raise ValueError(f"{ENV}: unknown fault {kind!r} in {spec!r}; expected one of {KINDS}")
        f = {"kind": kind, "rank": 0, "step": 1, "restart": 0}
        for field in fields:
            key, _, value = field.partition("=")
            if key not in f or not value.isdigit():
                raise ValueError(f"{ENV}: bad field {field!r} in {spec!r}; expected rank=, step= or restart= integers")
            f[key] = int(value)
        faults.append(f)
    return faults


class FaultInjector:
    """The faults of ``TRAINER_FAULT`` that concern ``rank`` in this torchrun restart."""

    def __init__(self, rank: int) -> None:
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        self.faults = [f for f in _parse(os.environ.get(ENV, "")) if f["rank"] == rank and f["restart"] == restart]

    def mid_step(self, step: int) -> None:
        """Called after the forward and backward of ``step``, before the optimizer update."""
        for f in self.faults:
            if f["step"] != step:
                continue
            if f["kind"] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif f["kind"] == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
            elif f["kind"] == "hang":
                while True:
                    time.sleep(3600)
