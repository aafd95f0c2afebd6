"""``--metrics.enable_wandb``: an offline Weights & Biases run (no network) that holds every step's
numbers as metrics.jsonl has them; a one-line error without the package."""
import json
import sys
import time
from pathlib import Path

import pytest

from trainer import train
from trainer.config import parse_args

wandb = pytest.importorskip("wandb", reason="wandb is in the test extra (pip install -e .[test])")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled", "ignore::DeprecationWarning")

ARGS = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", "3",
        "--metrics.log_freq", "1", "--metrics.enable_color", "false", "--metrics.save_plot", "false"]


def test_offline_run_holds_the_logged_records(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    rc = train.main(parse_args([*ARGS, "--job.dump_folder", str(tmp_path), "--metrics.enable_wandb",
                                "--metrics.wandb_project", "test"]))
    assert rc == 0
    runs = list((tmp_path / "wandb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    wanted = [json.dumps(r[key]).encode() for r in records for key in ("loss", "grad_norm", "lr")]
    wanted += [b"train/loss", b"train/grad_norm"]
    # Protobuf records; logged values are stored as their JSON text. wandb's service process writes
    # the file after finish() returns; on loaded cores that was seen to take seconds.
    deadline = time.monotonic() + 60
    while True:
        data = runs[0].read_bytes()
        missing = [w for w in wanted if w not in data]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not missing, missing


def test_missing_package_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    rc = train.main(parse_args([*ARGS, "--job.dump_folder", str(tmp_path), "--metrics.enable_wandb"]))
    err = capsys.readouterr().err
    assert rc == 1 and "--metrics.enable_wandb: needs the wandb package" in err
    assert len([line for line in err.splitlines() if line.strip()]) == 1, err
    assert not (Path(tmp_path) / "wandb").exists()
