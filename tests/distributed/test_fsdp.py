"""FSDP2 / HSDP on gloo ranks equals one process: ``torchrun -m trainer`` against an in-process run.

Each case launches 2 CPU processes with torchrun (OMP_NUM_THREADS=1) on the debug model at a tiny
shape and compares the per-step loss and gradient norm with a single process seeing the same
global batch: equal to 1e-5 (fp32). The 4-rank HSDP (2 x 2) case is marked slow:
``pytest -m slow tests/distributed/test_fsdp.py``.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer import train
from trainer.config import parse_args

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
REPO = Path(__file__).resolve().parents[2]
STEPS = 10
COMMON = ["--training.seq_len", "32", "--training.steps", str(STEPS), "--lr_scheduler.warmup_steps", "2",
          "--optimizer.lr", "3e-3", "--metrics.log_freq", "1", "--metrics.enable_color", "false"]


def _records(folder):
    lines = (Path(folder) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def _torchrun(nproc, folder, *overrides, expect_rc=0):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "trainer", *COMMON, "--job.dump_folder", str(folder), *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == expect_rc, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """One process, global batch 4 (the reference for every layout below)."""
    folder = tmp_path_factory.mktemp("single")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rc = train.main(parse_args([*COMMON, "--training.local_batch_size", "4", "--job.dump_folder", str(folder)]))
    finally:
        torch.set_num_threads(n)
    assert rc == 0
    return _records(folder)


def _assert_same(got, ref, steps=range(1, STEPS + 1)):
    assert sorted(got) == list(steps)
    for s in steps:
        for key in ("loss", "grad_norm"):
            assert abs(got[s][key] - ref[s][key]) <= 1e-5 * abs(ref[s][key]), (s, key, got[s][key], ref[s][key])
        assert got[s]["lr"] == ref[s]["lr"]


def test_fsdp_two_ranks_equals_one_process(tmp_path, single_process):
    proc = _torchrun(2, tmp_path, "--training.local_batch_size", "2")
    assert "dp_replicate=1 x dp_shard=2 (world 2)" in proc.stdout
    _assert_same(_records(tmp_path), single_process)
    assert single_process[STEPS]["loss"] < single_process[1]["loss"] - 1.0  # it is learning, too


def test_hsdp_replicate_with_accumulation_equals_one_process(tmp_path, single_process):
    proc = _torchrun(2, tmp_path, "--training.local_batch_size", "1", "--training.global_batch_size", "4",
                     "--parallelism.data_parallel_replicate_degree", "2")
    assert "dp_replicate=2 x dp_shard=1" in proc.stdout and "2 micro-batch(es)" in proc.stdout
    _assert_same(_records(tmp_path), single_process)


@pytest.mark.slow  # 30 s; resumes across layouts are in the default run by test_parallel_resume.py
def test_fsdp_checkpoint_resume_and_layout_change(tmp_path):
    ckpt = ["--training.local_batch_size", "2", "--checkpoint.enable", "--checkpoint.interval", "5",
            "--checkpoint.keep_latest_k", "0"]
    _torchrun(2, tmp_path, *ckpt)
    straight = _records(tmp_path)
    shutil.rmtree(tmp_path / "checkpoint" / "step-10")
    (tmp_path / "metrics.jsonl").unlink()
    proc = _torchrun(2, tmp_path, *ckpt)  # resumes from the sharded step-5 checkpoint
    assert "summary: 5 steps (6..10, resumed)" in proc.stdout  # the steps this run did, not the last step
    resumed = _records(tmp_path)
    assert sorted(resumed) == list(range(6, STEPS + 1))
    for s in resumed:
        assert resumed[s]["loss"] == straight[s]["loss"], s  # bitwise
    # One process continues the 2-rank run: model and optimizer resharded by DCP, the data loader
    # state resharded (trainer.checkpoint.checkpointer.reshard_loader_state), so the same samples come next.
    (tmp_path / "metrics.jsonl").unlink()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "trainer", *COMMON, "--job.dump_folder", str(tmp_path),
                           "--training.local_batch_size", "4", "--checkpoint.enable", "--checkpoint.load_step", "5"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = _records(tmp_path)
    assert sorted(one) == list(range(6, STEPS + 1))
    for s in one:
        assert abs(one[s]["loss"] - straight[s]["loss"]) <= 1e-5 * straight[s]["loss"], s


@pytest.mark.slow
def test_hsdp_two_by_two_equals_one_process(tmp_path, single_process):
    _torchrun(4, tmp_path, "--training.local_batch_size", "1", "--parallelism.data_parallel_replicate_degree", "2",
              "--parallelism.data_parallel_shard_degree", "2")
    _assert_same(_records(tmp_path), single_process)


def test_warnings_print_once_under_torchrun(tmp_path):
    """Every rank meets the same warning; only rank 0 prints it (errors still come from any rank)."""
    proc = _torchrun(2, tmp_path, "--training.local_batch_size", "2", "--training.steps", "2",
                     "--lr_scheduler.warmup_steps", "5", "--metrics.save_plot", "false")
    out = proc.stdout + proc.stderr
    assert out.count("warming up over all 2 steps") == 1, out[-3000:]
