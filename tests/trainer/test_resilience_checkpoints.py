"""Verified checkpoints, lineage and retention, one run per dump folder, torn metrics lines, bad dump
folders, a full disk, the non-finite message after a load, too little data (issue 20).

Each case runs the real trainer in-process on the debug model at a tiny shape (seq 32, batch 2), a
few seconds each, and checks that the per-step losses after the fault equal an uninterrupted run's
(bitwise: one process on the CPU is deterministic) and that nothing was lost.
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
from trainer.checkpoint.folder import complete_steps
from trainer.checkpoint.manifest import ManifestError, data_files, digest_files, verify_folder, write_manifest
from trainer.config import parse_args

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"), pytest.mark.usefixtures("one_thread")]
REPO = Path(__file__).resolve().parents[2]
BASE = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--lr_scheduler.warmup_steps", "2",
        "--lr_scheduler.decay_ratio", "0",  # no decay: the LR of a step does not depend on training.steps
        "--metrics.log_freq", "1", "--metrics.enable_color", "false", "--metrics.save_plot", "false"]
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0"]


def run(folder, steps, *extra):
    rc = train.main(parse_args([*BASE, "--training.steps", str(steps), "--job.dump_folder", str(folder), *extra]))
    return rc, records(folder)


def records(folder):
    path = Path(folder) / "metrics.jsonl"
    if not path.exists():
        return {}
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted 8-step run."""
    rc, recs = run(tmp_path_factory.mktemp("straight"), 8)
    assert rc == 0 and sorted(recs) == list(range(1, 9))
    return recs


def same_losses(got, ref, steps):
    for s in steps:
        assert got[s]["loss"] == ref[s]["loss"], (s, got[s]["loss"], ref[s]["loss"])


def damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "zeroed":  # 256 KiB of zeros inside the file (the probe that used to load silently)
        path.write_bytes(data[:4096] + bytes(262144) + data[4096 + 262144:])
    elif how == "random":
        rnd = torch.randint(0, 256, (262144,), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
        path.write_bytes(data[:4096] + rnd.numpy().tobytes() + data[4096 + 262144:])


# ------------------------------------------------------------------------------------------ verification


@pytest.mark.parametrize("how", ["truncated", "zeroed", "random"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, straight, how, capsys):
    folder = tmp_path / "run"
    assert run(folder, 6, *CKPT)[0] == 0
    bad = folder / "checkpoint" / "step-6" / "__0_0.distcp"
    damage(bad, how)
    capsys.readouterr()
    rc, recs = run(folder, 8, *CKPT)
    out = capsys.readouterr().out
    assert rc == 0
    # One line names the file; the run resumed from step-4 and trained 5..8 exactly as the straight run.
    line = [x for x in out.splitlines() if "is damaged" in x]
    assert len(line) == 1 and str(bad) in line[0] and "falling back" in line[0], out
    assert "resumed from checkpoint" in out and "step-4" in out
    same_losses(recs, straight, range(5, 9))
    assert complete_steps(folder / "checkpoint") == [2, 4, 6, 8]
    # The damaged folder is kept aside for inspection, not deleted.
    assert [p.name for p in (folder / "checkpoint" / "damaged").iterdir()][0].startswith("step-6-")


def test_garbage_metadata_and_lost_manifest_fall_back_and_strict_verify_refuses(tmp_path, straight, capsys):
    folder = tmp_path / "run"
    assert run(folder, 6, *CKPT)[0] == 0
    (folder / "checkpoint" / "step-6" / ".metadata").write_bytes(b"garbage")
    (folder / "checkpoint" / "step-4" / "manifest.json").unlink()  # unverifiable
    rc, _ = run(folder, 8, *CKPT, "--checkpoint.strict_verify")
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "step-6" in err and ".metadata" in err and "strict_verify" in err
    assert complete_steps(folder / "checkpoint") == [2, 4, 6]  # nothing moved by a refused run
    rc, recs = run(folder, 8, *CKPT)
    out = capsys.readouterr().out
    assert rc == 0 and "no manifest.json" in out and "resumed from checkpoint" in out
    same_losses(recs, straight, range(3, 9))


def test_explicit_load_step_never_falls_back(tmp_path, capsys):
    folder = tmp_path / "run"
    assert run(folder, 4, *CKPT)[0] == 0
    damage(folder / "checkpoint" / "step-4" / "__0_0.distcp", "zeroed")
    rc, _ = run(folder, 6, *CKPT, "--checkpoint.load_step", "4")
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "__0_0.distcp" in err and "load_step 4" in err


def test_manifest_covers_every_file_and_convert_verifies(tmp_path):
    folder = tmp_path / "run"
    assert run(folder, 2, *CKPT)[0] == 0
    step = folder / "checkpoint" / "step-2"
    record = json.loads((step / "manifest.json").read_text())
    assert set(record["files"]) == {".metadata", "__0_0.distcp"}
    assert record["total_bytes"] == sum((step / n).stat().st_size for n in record["files"])
    verify_folder(step)
    damage(step / "__0_0.distcp", "random")
    with pytest.raises(ManifestError, match="checksum"):
        verify_folder(step)
    with pytest.raises(ValueError, match="do not match"):
        write_manifest(step, {})
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "trainer.convert", "dcp-to-hf", str(step), str(tmp_path / "hf")],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 1 and out.stderr.count("\n") == 1 and "__0_0.distcp" in out.stderr, out.stderr
    assert not (tmp_path / "hf").exists()


# ------------------------------------------------------------------------------------------ lineage


def test_rollback_with_keep_latest_1_keeps_what_it_saves_and_both_lineages(tmp_path, straight, capsys):
    # The case: --checkpoint.load_step 2 with keep_latest_k 1 after a run that reached step 4.
    folder = tmp_path / "run"
    assert run(folder, 4, "--checkpoint.enable", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0")[0] == 0
    capsys.readouterr()
    rc, recs = run(folder, 4, "--checkpoint.enable", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "1",
                   "--checkpoint.load_step", "2")
    out = capsys.readouterr().out
    ckpt_dir = folder / "checkpoint"
    (branch,) = [p for p in ckpt_dir.iterdir() if p.name.startswith("abandoned-after-step-2-")]
    assert rc == 0 and "forks" in out and str(branch) in out
    assert sorted(p.name for p in branch.iterdir()) == ["step-3", "step-4"]  # the abandoned lineage, kept
    assert complete_steps(ckpt_dir) == [4]  # this lineage's newest; what was just saved is never deleted
    same_losses(recs, straight, range(1, 5))
    # A plain resume continues this lineage's step 4, not the abandoned one's.
    rc, recs = run(folder, 6, "--checkpoint.enable", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "1")
    assert rc == 0 and "resumed from checkpoint" in capsys.readouterr().out
    same_losses(recs, straight, range(1, 7))


def test_rollback_then_plain_resume_equals_straight(tmp_path, straight):
    folder = tmp_path / "run"
    assert run(folder, 6, *CKPT)[0] == 0
    rc, _ = run(folder, 8, *CKPT, "--checkpoint.load_step", "4")
    assert rc == 0
    ckpt_dir = folder / "checkpoint"
    assert complete_steps(ckpt_dir) == [2, 4, 6, 8]  # the new lineage's 6 and 8
    (branch,) = [p for p in ckpt_dir.iterdir() if p.name.startswith("abandoned-")]
    assert sorted(p.name for p in branch.iterdir()) == ["step-6"]
    recs = records(folder)  # the last record of each step: the new lineage's
    same_losses(recs, straight, range(1, 9))
    rc, recs = run(folder, 8, *CKPT)
    assert rc == 0  # the plain resume finds the new lineage's step-8: nothing to do


# ------------------------------------------------------------------------------------------ the run's folder


def test_a_concurrent_run_is_refused_with_the_other_runs_pid_and_host(tmp_path, capsys):
    folder = tmp_path / "run"
    folder.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom trainer.run.folder import RunLock\n"
                               f"lock = RunLock({str(folder)!r}); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline().strip() == "held"
        rc, recs = run(folder, 2)
        err = capsys.readouterr().err
        assert rc == 1 and err.count("\n") == 1 and f"pid {holder.pid} on {os.uname().nodename}" in err, err
        assert recs == {}  # the refused run wrote nothing into the other run's metrics
    finally:
        holder.kill()
        holder.wait()
    assert run(folder, 2)[0] == 0  # released when the holder died (kill -9 included)


def test_dump_folder_that_is_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    for folder in (tmp_path / "file", tmp_path / "file" / "sub"):
        rc, _ = run(folder, 2)
        err = capsys.readouterr().err
        assert rc == 1 and err.count("\n") == 1 and "not a folder" in err and "Traceback" not in err


def _mount_tmpfs(path: Path, options: str):
    path.mkdir(parents=True, exist_ok=True)
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (mount -t tmpfs: {out.stderr.strip() or out.returncode})")


def test_read_only_dump_folder_is_one_line(tmp_path, capsys):
    ro = tmp_path / "ro"
    _mount_tmpfs(ro, "size=1m,ro")
    try:
        rc, _ = run(ro, 2)
        err = capsys.readouterr().err
        assert rc == 1 and err.count("\n") == 1 and "read-only" in err and str(ro) in err
    finally:
        subprocess.run(["umount", str(ro)], check=False)


def test_disk_full_is_one_line_and_leaves_no_partial(tmp_path, capsys, monkeypatch):
    small = tmp_path / "small"
    _mount_tmpfs(small, "size=90m")  # one checkpoint (63 MB) fits, a second does not
    try:
        rc, _ = run(small, 4, *CKPT)
        err = capsys.readouterr().err
        assert rc == 1 and err.count("\n") == 1 and "not enough space" in err and "bytes" in err, err
        assert complete_steps(small / "checkpoint") == [2]
        # The pre-check out of the way, the write itself fills the disk: one line, .partial removed.
        from trainer.checkpoint.publish import FolderWriter

        monkeypatch.setattr(FolderWriter, "_needed", lambda self, state: (1, "test"))
        rc, _ = run(small, 6, *CKPT)
        err = capsys.readouterr().err
        assert rc == 1 and err.count("\n") == 1 and "disk is full" in err, err
        assert not [p for p in (small / "checkpoint").iterdir() if p.name.endswith(".partial")]
        assert complete_steps(small / "checkpoint") == [2]
    finally:
        subprocess.run(["umount", str(small)], check=False)


def test_on_save_error_continue_trains_on(tmp_path, straight, monkeypatch, capsys):
    from trainer.checkpoint.publish import FolderWriter, SaveError

    real = FolderWriter.write

    def flaky(self, state, name, *a, **kw):
        if name == "step-4":
            raise SaveError(f"writing checkpoint {name} into {self.folder} failed: test")
        return real(self, state, name, *a, **kw)

    monkeypatch.setattr(FolderWriter, "write", flaky)
    rc, recs = run(tmp_path / "run", 6, *CKPT, "--checkpoint.on_save_error", "continue")
    assert rc == 0 and "training continues without this checkpoint" in capsys.readouterr().out
    assert complete_steps(tmp_path / "run" / "checkpoint") == [2, 6]
    same_losses(recs, straight, range(1, 7))
    rc, _ = run(tmp_path / "stop", 6, *CKPT)
    assert rc == 1 and "on_save_error continue" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ metrics, messages


def test_torn_metrics_line_is_repaired_on_resume(tmp_path, straight, capsys):
    folder = tmp_path / "run"
    assert run(folder, 4, *CKPT)[0] == 0
    with open(folder / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 5, "loss": 4.1')  # killed in the middle of a write
    rc, recs = run(folder, 6, *CKPT)
    assert rc == 0 and "removed a torn last line (23 bytes" in capsys.readouterr().out
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    assert all(json.loads(x) for x in lines) and sorted(recs) == list(range(1, 7))
    same_losses(recs, straight, range(1, 7))


def test_non_finite_loss_right_after_a_load_blames_the_weights(tmp_path, capsys):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    folder = tmp_path / "run"
    assert run(folder, 2, *CKPT)[0] == 0
    step = folder / "checkpoint" / "step-2"
    dcp_to_torch_save(step, tmp_path / "sd.pt")
    sd = torch.load(tmp_path / "sd.pt", weights_only=False)
    sd["model"]["tok_embeddings.weight"].fill_(float("inf"))  # finite structure, non-finite values
    torch.save(sd, tmp_path / "sd.pt")
    shutil.rmtree(step)
    torch_save_to_dcp(tmp_path / "sd.pt", step)
    write_manifest(step, digest_files(step, data_files(step)))  # a checkpoint that verifies
    capsys.readouterr()
    rc, _ = run(folder, 4, *CKPT)
    err = capsys.readouterr().err
    assert rc == 1 and "step 3: non-finite loss" in err and "just loaded from the checkpoint" in err
    assert "optimizer.lr" not in err


def test_too_little_data_warns_once(tmp_path, capsys):
    data = tmp_path / "tiny.txt"
    data.write_text("ab")
    rc, _ = run(tmp_path / "run", 3, "--training.dataset_path", str(data))
    out = capsys.readouterr().out
    assert rc == 0 and out.count("has 4 tokens and a step reads 66") == 1 and "more than once" in out
    rc, _ = run(tmp_path / "run2", 2, "--training.dataset_path", str(REPO / "tests/data/tinyshakespeare.txt"))
    assert rc == 0 and "repeats" not in capsys.readouterr().out
