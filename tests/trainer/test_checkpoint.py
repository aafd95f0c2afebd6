"""Checkpoints: exact resume of the whole run, atomic publish under a kill, async copies, purge, export, errors.

The resume tests run the real trainer in-process on the debug model at a tiny shape (seq 32,
batch 2), so each takes a few seconds.
"""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from trainer import train
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.folder import CheckpointError, complete_steps, load_weights
from trainer.config import Optimizer as OptimizerConfig
from trainer.config import parse_args
from trainer.data.datasets import build_source
from trainer.data.loader import DataLoader
from trainer.data.tokenizer import build_tokenizer
from trainer.registry import build_model
from trainer.optim import LRSchedule, build_lr_scheduler, build_optimizer
from tests.trainer.helpers import tiny_llama

# One intra-op thread (tests/trainer/conftest.py): the CPU is shared.
pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"), pytest.mark.usefixtures("one_thread")]
REPO = Path(__file__).resolve().parents[2]
TINY = tiny_llama(dim=32, vocab_size=258, multiple_of=16, max_seq_len=16)


def _run(folder, *overrides):
    """Run the trainer in-process on a tiny debug-model shape; returns (exit code, {step: record})."""
    argv = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", "20",
            "--lr_scheduler.warmup_steps", "3", "--metrics.log_freq", "1", "--job.dump_folder", str(folder),
            "--metrics.enable_color", "false", *overrides]
    rc = train.main(parse_args(argv))
    return rc, _records(folder)


def _records(folder):
    path = Path(folder) / "metrics.jsonl"
    if not path.exists():
        return {}
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["step"]: r for r in recs}


def _crash_after_saving(monkeypatch, step):
    """Make the run die (like a kill) right after the checkpoint of ``step`` is written."""
    real = Checkpointer.save

    def save(self, s, *a, **kw):
        out = real(self, s, *a, **kw)
        if s == step:
            self.wait()
            raise KeyboardInterrupt(f"simulated kill after step {s}")
        return out

    monkeypatch.setattr(Checkpointer, "save", save)


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_resume_twice_equals_straight_run_bitwise(tmp_path, monkeypatch, async_mode):
    rc, straight = _run(tmp_path / "straight")
    assert rc == 0 and sorted(straight) == list(range(1, 21))
    run = tmp_path / "resumed"
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "7", "--checkpoint.async_mode", async_mode]
    for crash in (7, 14):  # killed after saving step 7, resumed, killed after 14, resumed
        with monkeypatch.context() as m:
            _crash_after_saving(m, crash)
            with pytest.raises(KeyboardInterrupt):
                _run(run, *ckpt)
        assert complete_steps(run / "checkpoint")[-1] == crash
    rc, resumed = _run(run, *ckpt)
    assert rc == 0
    assert sorted(resumed) == list(range(1, 21))
    for step in range(1, 21):
        for key in ("loss", "grad_norm", "lr"):
            assert resumed[step][key] == straight[step][key], (step, key)  # bitwise in fp32 on the CPU
    assert complete_steps(run / "checkpoint") == [14, 20]  # debugmodel.toml keeps the latest 2


def test_ten_plus_ten_equals_twenty(tmp_path):
    rc, straight = _run(tmp_path / "a")
    run = tmp_path / "b"
    rc, first = _run(run, "--checkpoint.enable", "--checkpoint.interval", "10")
    # A fresh process that finds step-10 as the newest complete checkpoint (step-20 removed).
    import shutil

    shutil.rmtree(run / "checkpoint" / "step-20")
    (run / "metrics.jsonl").unlink()
    rc, second = _run(run, "--checkpoint.enable", "--checkpoint.interval", "10")
    assert rc == 0 and sorted(second) == list(range(11, 21))
    assert [second[s]["loss"] for s in range(11, 21)] == [straight[s]["loss"] for s in range(11, 21)]


def test_seed_checkpoint_is_loaded_instead_of_init(tmp_path):
    seed_run = tmp_path / "seeded"
    rc = train.main(parse_args(["--checkpoint.create_seed_checkpoint", "--training.seed", "1",
                                "--job.dump_folder", str(seed_run), "--training.seq_len", "32"]))
    assert rc == 0 and complete_steps(seed_run / "checkpoint") == [0]
    _, ref = _run(tmp_path / "ref", "--training.steps", "3", "--training.seed", "1")
    _, other = _run(tmp_path / "other", "--training.steps", "3", "--training.seed", "2")
    _, seeded = _run(seed_run, "--training.steps", "3", "--training.seed", "2", "--checkpoint.enable")
    assert [seeded[s]["loss"] for s in (1, 2, 3)] == [ref[s]["loss"] for s in (1, 2, 3)]
    assert seeded[1]["loss"] != other[1]["loss"]


# --------------------------------------------------------------------------------------------
# Checkpointer on a small model


def _parts(tmp_path, dp_rank=0, dp_world=1, seed=0):
    model = build_model(TINY, device="cpu")
    model.init_weights(seed)
    opt = build_optimizer(model, OptimizerConfig(lr=1e-2))
    sched = build_lr_scheduler(opt, LRSchedule(steps=10, warmup_steps=2))
    text = tmp_path / "corpus.txt"
    if not text.exists():
        text.write_text("\n\n".join(f"document {i}: " + "words " * (i % 7 + 3) for i in range(50)))
    loader = DataLoader(build_source("", str(text)), build_tokenizer(None), 16, 2, dp_rank, dp_world)
    return model, opt, sched, loader


def _train_steps(model, opt, sched, loader, n):
    it = iter(loader)
    for _ in range(n):
        b = next(it)
        logits = model(b["input_ids"])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), b["labels"].flatten()).backward()
        opt.step()
        opt.zero_grad()
        sched.step()


def test_checkpointer_round_trip_restores_everything(tmp_path):
    model, opt, sched, loader = _parts(tmp_path)
    _train_steps(model, opt, sched, loader, 3)
    ck = Checkpointer(tmp_path / "ck", model, opt, sched, loader)
    assert ck.save(3, tokens_seen=96) == tmp_path / "ck" / "step-3"
    expected_next = next(iter(loader))
    model2, opt2, sched2, loader2 = _parts(tmp_path, seed=7)
    step, tokens = Checkpointer(tmp_path / "ck", model2, opt2, sched2, loader2).load()
    assert (step, tokens) == (3, 96)
    for (n, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert torch.equal(a, b), n
    s1, s2 = opt.state_dict(), opt2.state_dict()
    for k in s1["state"]:
        for field in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s1["state"][k][field], s2["state"][k][field])
    assert sched2.state_dict() == sched.state_dict()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    got_next = next(iter(loader2))
    assert all(torch.equal(got_next[k], expected_next[k]) for k in expected_next)


def test_keep_latest_k(tmp_path):
    model, opt, sched, loader = _parts(tmp_path)
    ck = Checkpointer(tmp_path / "ck", model, opt, sched, loader, keep_latest_k=2)
    for step in (1, 2, 3, 4):
        ck.save(step)
    assert complete_steps(tmp_path / "ck") == [3, 4]
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-3", "step-4"]


def test_async_save_copies_the_state_before_training_continues(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter

    real = FileSystemWriter.write_data

    def slow_write(self, *a, **kw):
        time.sleep(0.5)  # the training step below runs while this write is pending
        return real(self, *a, **kw)

    monkeypatch.setattr(FileSystemWriter, "write_data", slow_write)
    model, opt, sched, loader = _parts(tmp_path)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ck = Checkpointer(tmp_path / "ck", model, opt, sched, loader, async_mode="async")
    ck.save(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1000.0)
    assert complete_steps(tmp_path / "ck") == []  # not published before the write completes
    ck.close()
    assert complete_steps(tmp_path / "ck") == [1]
    fresh = build_model(TINY, device="cpu")
    load_weights(fresh, tmp_path / "ck" / "step-1")
    for k, v in before.items():
        assert torch.equal(fresh.state_dict()[k], v), k


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weights_only_export(tmp_path, dtype):
    model, opt, sched, loader = _parts(tmp_path)
    ck = Checkpointer(tmp_path / "ck", model, opt, sched, loader, model_weights_only=True, export_dtype=dtype)
    path = ck.save(5, last=True)
    assert path.name == "weights-step-5" and complete_steps(tmp_path / "ck") == []
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    assert all(k.startswith("model.") for k in meta)
    assert {m.properties.dtype for m in meta.values()} == {getattr(torch, dtype)}
    fresh = build_model(TINY, device="cpu")
    load_weights(fresh, path)
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v.to(getattr(torch, dtype)).float()), k


def test_load_errors(tmp_path):
    model, opt, sched, loader = _parts(tmp_path)
    Checkpointer(tmp_path / "ck", model, opt, sched, loader).save(2)
    with pytest.raises(CheckpointError, match=r"load_step.*step 5.*\[2\]"):
        Checkpointer(tmp_path / "ck", model, opt, sched, loader, load_step=5).load()
    # Another data-parallel layout loads, its loader state resharded (tests/distributed/test_parallel_resume.py);
    # another seq_len would change the samples: refused.
    m1, o1, s1, l1 = _parts(tmp_path, dp_rank=1, dp_world=2)
    assert Checkpointer(tmp_path / "ck", m1, o1, s1, l1, dp_rank=1).load() == (2, 0)
    assert (l1.dp_rank, l1.dp_world_size) == (1, 2)
    l8 = DataLoader(build_source("", str(tmp_path / "corpus.txt")), build_tokenizer(None), 8, 2)
    with pytest.raises(CheckpointError, match="seq_len"):
        Checkpointer(tmp_path / "ck", model, opt, sched, l8).load()
    assert Checkpointer(tmp_path / "empty", model, opt, sched, loader).load() == (0, 0)
    with pytest.raises(ValueError, match="checkpoint.async_mode"):
        Checkpointer(tmp_path / "x", model, async_mode="threads")


_KILL_SCRIPT = textwrap.dedent("""
    import sys, time
    import torch
    from torch.distributed.checkpoint import FileSystemWriter
    sys.path.insert(0, {repo!r}); sys.path.insert(0, {tests!r})
    from test_checkpoint import _parts
    from trainer.checkpoint.checkpointer import Checkpointer
    import pathlib
    tmp = pathlib.Path({tmp!r})
    model, opt, sched, loader = _parts(tmp)
    ck = Checkpointer(tmp / "ck", model, opt, sched, loader)
    ck.save(1)
    real_finish = FileSystemWriter.finish
    def finish(self, *a, **kw):  # all data files are written; the metadata is not yet
        print("WRITING", flush=True)
        time.sleep(120)
        return real_finish(self, *a, **kw)
    FileSystemWriter.finish = finish
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ck.save(2)
""")


def test_atomic_save_survives_a_kill_mid_write(tmp_path):
    script = _KILL_SCRIPT.format(repo=str(REPO), tests=str(Path(__file__).parent), tmp=str(tmp_path))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "WRITING", proc.stderr.read()
        partial = tmp_path / "ck" / ".step-2.partial"
        assert any(partial.glob("*.distcp"))  # data was being written
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert complete_steps(tmp_path / "ck") == [1]
    assert not (tmp_path / "ck" / "step-2").exists()
    # The run resumes from step 1 with step 1's weights ...
    model, opt, sched, loader = _parts(tmp_path, seed=3)
    ck = Checkpointer(tmp_path / "ck", model, opt, sched, loader)
    assert ck.load() == (1, 0)
    ref, _, _, _ = _parts(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))
    # ... and the next save of step 2 replaces the leftover partial folder.
    ck.save(2)
    assert complete_steps(tmp_path / "ck") == [1, 2] and not (tmp_path / "ck" / ".step-2.partial").exists()
