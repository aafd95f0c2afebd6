"""Crashed and hung ranks under torchrun (issue 20), on CPU gloo ranks.

1. kill -9 of rank 1 of a 2-rank FSDP run in the middle of step 4, under ``torchrun --max-restarts
   1``: torchrun restarts the group, which resumes from the last good checkpoint (step 2), and the
   last record of every step equals the single-process run (losses within 1e-4): nothing lost.
2. A hung rank (the test-only fault hook sleeps in step 3): with ``--comm.train_timeout_seconds 4``
   every rank exits non-zero within the timeout (plus start-up) and leaves its Python stacks in
   ``<dump_folder>/stacks/rank<r>.txt``; the hung rank's stack shows where it hangs.
About 20 s each on 2 cores.
"""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed.layouts import COMMON, assert_same, records
from tests.distributed.launcher import free_port
from trainer.checkpoint.folder import complete_steps

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
REPO = Path(__file__).resolve().parents[2]


def torchrun(folder: Path, *argv: str, restarts: int = 0, fault: str = "", timeout: float = 240):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--rdzv_backend", "c10d",
           "--rdzv_endpoint", f"127.0.0.1:{free_port()}", "--max-restarts", str(restarts), "-m", "trainer",
           *COMMON, "--training.local_batch_size", "2", "--job.dump_folder", str(folder), *argv]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TRAINER_FAULT": fault,
           "TRITON_INTERPRET": "1"}
    t0 = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)
    return out, time.monotonic() - t0


def test_kill_9_of_one_rank_mid_step_restarts_and_resumes_exactly(tmp_path, single):
    folder = tmp_path / "run"
    out, _ = torchrun(folder, "--checkpoint.enable", "--checkpoint.interval", "2", restarts=1,
                      fault="kill:rank=1:step=4:restart=0")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "SIGKILL" in out.stderr or "Signal 9" in out.stderr or "exitcode: -9" in out.stderr, out.stderr[-3000:]
    assert complete_steps(folder / "checkpoint") == [4, 5]  # (keep_latest_k 2) resumed from step-2, trained 3..5
    assert_same(records(folder), single)


@pytest.mark.slow  # ~14 s (2 ranks under torchrun); by default the watchdog firing, its stacks and its console
# line in one process: tests/trainer/test_watchdog.py
def test_a_hung_rank_makes_every_rank_exit_with_its_stacks(tmp_path):
    folder = tmp_path / "run"
    out, took = torchrun(folder, "--comm.train_timeout_seconds", "4", "--training.steps", "20",
                         fault="hang:rank=1:step=3")
    assert out.returncode != 0
    stacks = {r: (folder / "stacks" / f"rank{r}.txt").read_text() for r in (0, 1)}
    for r, text in stacks.items():
        assert "(most recent call first):" in text and 'trainer/train.py", line' in text, (r, text[:2000])
    # The hung rank's watchdog shows where it hangs; the other rank's shows where it waited for it
    # (its own watchdog, or the failed collective's traceback when the hung rank's exit broke it).
    assert "step 3 made no progress for 4 s" in stacks[1] and "in mid_step" in stacks[1]
    assert "made no progress for 4 s" in stacks[0] or "the run failed:" in stacks[0]
    # Each rank whose watchdog fired said so on its console, in one line (issue 30).
    assert (f"rank 1: hang watchdog: step 3 made no progress for 4 s (--comm.train_timeout_seconds); the Python "
            f"stacks of every thread are in {folder / 'stacks' / 'rank1.txt'}; exiting with status 1") in out.stderr
    if "made no progress for 4 s" in stacks[0]:
        assert "rank 0: hang watchdog: step 3 made no progress for 4 s" in out.stderr
    assert took < 60, took  # start-up (~10-20 s on 2 loaded cores) + 2 steps + the 4 s timeout
