"""``python -m trainer`` as a user runs it: short runs where the loss falls, and the 70B message.

The full default run (debugmodel, embedded corpus, 2 CPU cores, a few minutes) is marked slow:
``pytest -m slow tests/e2e/test_main.py``.
"""
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _trainer(*args, timeout=600, threads=None):
    env = {**os.environ, "PYTHONPATH": str(REPO), "NO_COLOR": "1"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "trainer", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    return proc, time.perf_counter() - t0


def _losses(folder):
    return [json.loads(line)["loss"] for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()]


def test_short_run_on_the_embedded_corpus_learns(tmp_path):
    proc, _ = _trainer("--training.steps", "40", "--training.seq_len", "64", "--training.local_batch_size", "4",
                       "--lr_scheduler.warmup_steps", "5", "--optimizer.lr", "3e-3", "--metrics.log_freq", "1",
                       "--job.dump_folder", str(tmp_path), threads=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = _losses(tmp_path)
    assert len(losses) == 40
    assert abs(losses[0] - math.log(258)) < 0.3  # starts at ln(vocab)
    assert sum(losses[-5:]) / 5 < losses[0] - 2.0
    assert "summary: 40 steps" in proc.stdout and "Traceback" not in proc.stderr
    assert f"metrics {tmp_path / 'metrics.jsonl'}" in proc.stdout  # where the outputs go, said at the start
    assert " elapsed " in proc.stdout and " eta " in proc.stdout
    png = (tmp_path / "metrics.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


@pytest.mark.parametrize("content, message", [
    (b"\n \n\n", "has no text to train on"),
    (b"GIF89a\x01\x00\x01\x00\x80\x00\x00", "is not a text file: a NUL byte at byte offset 7"),
])  # (non-UTF-8 text and more: tests/trainer/test_data.py)
def test_a_bad_dataset_is_a_one_line_error_before_the_model_is_built(tmp_path, content, message):
    data = tmp_path / "data.txt"
    data.write_bytes(content)
    proc, _ = _trainer("--training.dataset_path", str(data), "--job.dump_folder", str(tmp_path / "out"), timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0, proc.stderr  # one line
    assert proc.stderr.startswith("python -m trainer: error: --training.dataset_path: ") and message in proc.stderr
    assert "Traceback" not in proc.stderr and "model llama3" not in proc.stdout


def test_a_file_that_is_no_tokenizer_is_a_one_line_error_naming_the_key_once(tmp_path):
    bad = tmp_path / "tokenizer.model"
    bad.write_text("not a tokenizer\n")
    proc, _ = _trainer("--model.tokenizer_path", str(bad), "--job.dump_folder", str(tmp_path / "out"), timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert proc.stderr.startswith("python -m trainer: error: --model.tokenizer_path: ") and str(bad) in proc.stderr
    assert proc.stderr.count("tokenizer_path") == 1 and "Traceback" not in proc.stderr


def test_a_bad_backend_in_the_environment_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TITAN_KERNELS_BACKEND", "bogus")
    proc, _ = _trainer("--training.steps", "2", "--job.dump_folder", str(tmp_path), timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert proc.stderr.startswith("python -m trainer: error: TITAN_KERNELS_BACKEND: expected one of")
    assert "'bogus'" in proc.stderr and "step 1" not in proc.stdout


def test_tinyshakespeare_with_a_tokenizer_json(tmp_path, shared_data):
    proc, _ = _trainer("--training.dataset_path", str(shared_data / "tinyshakespeare.txt"),
                       "--model.tokenizer_path", str(shared_data / "tokenizer" / "tokenizer.json"),
                       "--training.steps", "20", "--training.seq_len", "64", "--training.local_batch_size", "4",
                       "--lr_scheduler.warmup_steps", "3", "--optimizer.lr", "3e-3", "--metrics.log_freq", "1",
                       "--job.dump_folder", str(tmp_path), threads=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "vocab 2020" in proc.stdout and "tinyshakespeare" in proc.stdout
    losses = _losses(tmp_path)
    assert abs(losses[0] - math.log(2020)) < 0.3
    assert sum(losses[-3:]) / 3 < losses[0] - 1.5


def test_70b_on_this_machine_explains_and_exits(tmp_path):
    proc, seconds = _trainer("--flavor", "70B", "--job.dump_folder", str(tmp_path), timeout=120)
    assert proc.returncode != 0
    assert seconds < 60
    err = proc.stderr
    assert "Traceback" not in err and "Traceback" not in proc.stdout
    assert "70.55e9 parameters" in err
    for part in ("estimated memory per device", "parameters", "gradients", "optimizer state", "activations",
                 "devices found", "would fit", "data_parallel_shard_degree"):
        assert part in err, part
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.slow
def test_default_run_finishes_in_ten_minutes_and_learns(tmp_path):
    proc, seconds = _trainer("--job.dump_folder", str(tmp_path), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert seconds < 600, seconds
    losses = _losses(tmp_path)
    assert abs(losses[0] - math.log(258)) < 0.3  # step 1
    assert losses[-1] < losses[0] - 2.5  # mean loss of the last 10 steps
    print(proc.stdout)
