"""The hang watchdog (``trainer.run.watchdog.StepWatchdog``) in processes of its own: when a step, the
start-up or a checkpoint/validation phase makes no progress within its limit, the process writes
every thread's Python stacks to ``stacks/rank<r>.txt``, prints one line on its console (stderr)
naming the rank, the step, the limit's option and the stacks file, and exits with status 1. A step
that keeps re-arming it never fires. A C call that holds the GIL silences the Python timer:
faulthandler's own timer fires BACKSTOP_S later, stacks only (the documented limit).

The processes run side by side, without torch (the process group's timeout is not set here): about
7 s in all (1 s limits, the backstop's 1 + 5 s).
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import re, sys, time
import trainer.run.watchdog as wd
from trainer.run.watchdog import StepWatchdog
wd.set_group_timeout = lambda seconds: None  # no process group here (and no torch: a fast start)
folder, rank, train, init, scenario = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]

def stuck_in_step():
    time.sleep(120)

def stuck_holding_the_gil():
    re.match(r"(a+)+$", "a" * 40 + "b")  # catastrophic backtracking: C code that keeps the GIL

w = StepWatchdog(folder, rank, train, init)
if scenario == "step":
    w.step_done(7)
    stuck_in_step()
elif scenario == "startup":
    stuck_in_step()
elif scenario == "phase":
    w.step_done(4)
    w.long_phase()
    stuck_in_step()
elif scenario == "progress":
    for step in range(1, 9):
        time.sleep(0.25)
        w.step_done(step)
    w.close()
elif scenario == "gil":
    w.step_done(1)
    stuck_holding_the_gil()
"""


def _start(tmp_path: Path, name: str, rank: int, train: int, init: int) -> tuple[subprocess.Popen, Path]:
    folder = tmp_path / name
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(SCRIPT), str(folder), str(rank), str(train),
                             str(init), name], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    return proc, folder / "stacks" / f"rank{rank}.txt"


def test_the_watchdog_prints_one_line_on_the_console_when_it_fires(tmp_path):
    cases = {  # name: (rank, train limit, init limit, the line's middle)
        "step": (3, 1, 60, "step 8 made no progress for 1 s (--comm.train_timeout_seconds)"),
        "startup": (0, 60, 1, "start-up (before the first step) made no progress for 1 s "
                              "(--comm.init_timeout_seconds)"),
        "phase": (5, 60, 1, "the validation or checkpoint save after step 4 made no progress for 1 s "
                            "(--comm.init_timeout_seconds)"),
        "progress": (1, 3, 60, None),  # 0.25 s steps under a 3 s limit (loaded cores may stretch a sleep)
        "gil": (2, 1, 60, None),
    }
    t0 = time.monotonic()
    procs = {name: _start(tmp_path, name, *case[:3]) for name, case in cases.items()}
    for name, (proc, stacks) in procs.items():
        _, err = proc.communicate(timeout=120)
        rank, _, _, middle = cases[name]
        lines = [line for line in err.splitlines() if line.strip()]
        if name == "progress":  # re-armed at every step: never fires, leaves no file
            assert proc.returncode == 0 and lines == [] and not stacks.exists(), err
            continue
        assert proc.returncode == 1, (name, err)
        text = stacks.read_text()
        if name == "gil":  # the backstop: faulthandler's C timer, 1 + BACKSTOP_S seconds, no console line
            assert "Timeout (0:00:06)!" in text and "in stuck_holding_the_gil" in text, text
            assert lines == [], err
            continue
        assert lines == [f"rank {rank}: hang watchdog: {middle}; the Python stacks of every thread are in {stacks}; "
                         "exiting with status 1"], err
        assert "made no progress" in text and "in stuck_in_step" in text, text
    assert time.monotonic() - t0 < 60
