"""Damage is decided by the manifest alone (issue 30, items 8 and 13): a file the manifest does not list
makes a step damaged; an intact checkpoint that does not fit this run's optimizer is never called
damaged, stays in place, and the error says what differs and the ways on."""
import json
from pathlib import Path

import pytest

from trainer import train
from trainer.checkpoint.folder import complete_steps
from trainer.checkpoint.manifest import ManifestError, digest_files, verify_folder, write_manifest
from trainer.config import parse_args

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"), pytest.mark.usefixtures("one_thread")]
BASE = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--lr_scheduler.warmup_steps", "2",
        "--metrics.log_freq", "1", "--metrics.enable_color", "false", "--metrics.save_plot", "false",
        "--checkpoint.enable", "--checkpoint.interval", "2"]


def run(folder, steps, *extra) -> int:
    return train.main(parse_args([*BASE, "--training.steps", str(steps), "--job.dump_folder", str(folder), *extra]))


def test_a_file_the_manifest_does_not_list_makes_the_step_damaged(tmp_path):
    step = tmp_path / "step-2"
    step.mkdir()
    (step / ".metadata").write_bytes(b"m" * 10)
    (step / "__0_0.distcp").write_bytes(b"d" * 100)
    write_manifest(step, digest_files(step, [".metadata", "__0_0.distcp"]))
    verify_folder(step)
    (step / "__1_0.distcp").write_bytes(b"x" * 7)  # a shard copied in from elsewhere: it would load unverified
    with pytest.raises(ManifestError, match=r"__1_0\.distcp: not in the manifest"):
        verify_folder(step)
    (step / "__1_0.distcp").unlink()
    (step / "extra").mkdir()  # a folder is an entry of the step folder too
    with pytest.raises(ManifestError, match=r"extra: not in the manifest"):
        verify_folder(step)


def test_resume_with_another_optimizer_or_state_dtype_says_what_differs(tmp_path, capsys):
    folder = tmp_path / "run"
    assert run(folder, 2) == 0
    ckpt = folder / "checkpoint"
    manifest = (ckpt / "step-2" / "manifest.json").read_text()
    for extra, saved, wanted in ((["--optimizer.name", "muon"], "AdamW", "Muon"),
                                 (["--optimizer.state_dtype", "bfloat16"], "float32", "bfloat16")):
        capsys.readouterr()
        assert run(folder, 4, *extra) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert "damaged" not in err and "is intact" in err and saved in err and wanted in err, err
        # The ways on: the saved optimizer's settings, or a new optimizer from the weights.
        assert "--optimizer.name adamw" in err or "--optimizer.state_dtype float32" in err, err
        assert f"--checkpoint.initial_load_path {ckpt / 'step-2'} --checkpoint.initial_load_model_only" in err, err
        # Nothing moved or rewritten.
        assert complete_steps(ckpt) == [2] and not (ckpt / "damaged").exists()
        assert (ckpt / "step-2" / "manifest.json").read_text() == manifest
    # The way it offers works: a new optimizer (Muon) from the intact checkpoint's weights.
    capsys.readouterr()
    assert run(folder, 2, "--optimizer.name", "muon", "--checkpoint.initial_load_path", str(ckpt / "step-2"),
               "--checkpoint.initial_load_model_only", "--checkpoint.folder", "muon_ckpt") == 0
    assert "loaded model weights from" in capsys.readouterr().out
    # Titan's own AdamW states cast to another dtype on a resume: that loads (the log says so).
    titan = tmp_path / "titan"
    assert run(titan, 2, "--optimizer.implementation", "titan") == 0
    capsys.readouterr()
    assert run(titan, 3, "--optimizer.implementation", "titan", "--optimizer.state_dtype", "bfloat16") == 0
    out = capsys.readouterr().out
    assert "are float32; loaded as bfloat16" in out and "resumed from checkpoint" in out
    assert [json.loads(l)["step"] for l in (titan / "metrics.jsonl").read_text().splitlines() if '"loss"' in l][-1] == 3


def test_last_save_in_hf_without_checkpoints_says_what_it_saves_and_names_only_what_exists(tmp_path, capsys):
    folder = tmp_path / "run"
    assert train.main(parse_args([*BASE[:-3], "--training.steps", "1", "--job.dump_folder", str(folder),
                                  "--checkpoint.last_save_in_hf"])) == 0
    out = capsys.readouterr().out
    hf = folder / "checkpoint" / "hf-step-1"
    line = next(l for l in out.splitlines() if "outputs:" in l)
    assert f"step 1 as the Hugging Face folder {hf} at the end" in line and "no checkpoints to resume from" in line
    # Every path the log names under the checkpoint folder is on disk afterwards (no temporary folder).
    named = {w.rstrip(";,:") for l in out.splitlines() for w in l.split() if w.startswith(str(folder / "checkpoint"))}
    assert named and all(Path(p).exists() for p in named), named
    assert sorted(p.name for p in (folder / "checkpoint").iterdir()) == ["hf-step-1"]
