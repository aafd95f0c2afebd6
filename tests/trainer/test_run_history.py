"""No silent restarts: a rerun of a dump folder never appends a second run to its metrics, says what it
does with the earlier run's outputs (trainer/run/history.py), and a resume under a longer run says how
the LR schedule changes (trainer/optim/schedule.py)."""
import json

import pytest

from trainer import train
from trainer.config import parse_args

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"), pytest.mark.usefixtures("one_thread")]

TINY = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--metrics.log_freq", "1",
        "--metrics.save_plot", "false", "--lr_scheduler.warmup_steps", "1"]


def _run(folder, *argv):
    return train.main(parse_args([*TINY, *argv, "--job.dump_folder", str(folder)]))


def _steps(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_a_fresh_rerun_moves_the_earlier_runs_metrics_aside(tmp_path, capsys):
    assert _run(tmp_path, "--training.steps", "3") == 0
    capsys.readouterr()
    assert _run(tmp_path, "--training.steps", "2") == 0
    assert _steps(tmp_path / "metrics.jsonl") == [1, 2]  # this run's records only
    (previous,) = (tmp_path / "previous").iterdir()
    assert _steps(previous / "metrics.jsonl") == [1, 2, 3]
    msg = " ".join(capsys.readouterr().out.split())
    assert "holds an earlier run's metrics (steps 1..3) and no checkpoint to resume" in msg and str(previous) in msg


def test_a_rerun_after_a_hugging_face_export_says_how_to_continue_from_it(tmp_path, capsys):
    assert _run(tmp_path, "--training.steps", "2", "--checkpoint.last_save_in_hf") == 0
    assert (tmp_path / "checkpoint" / "hf-step-2").is_dir()
    capsys.readouterr()
    assert _run(tmp_path, "--training.steps", "3", "--checkpoint.last_save_in_hf") == 0
    msg = " ".join(capsys.readouterr().out.split())
    assert "does not resume training: to continue from it, --checkpoint.initial_load_path" in msg
    assert "hf-step-2 --checkpoint.initial_load_in_hf" in msg
    assert _steps(tmp_path / "metrics.jsonl") == [1, 2, 3]


def test_a_resume_moves_records_past_its_step_and_reports_a_longer_schedule(tmp_path, capsys):
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "2"]
    assert _run(tmp_path, "--training.steps", "3", *ckpt) == 0  # checkpoints 2 and 3; records 1..3
    # roll back to step 2, with a longer run: steps 3.. are redone under a schedule of 6 steps
    capsys.readouterr()
    assert _run(tmp_path, "--training.steps", "6", *ckpt, "--checkpoint.load_step", "2") == 0
    assert _steps(tmp_path / "metrics.jsonl") == [1, 2, 3, 4, 5, 6]
    (moved,) = tmp_path.glob("metrics.after-step-2-*.jsonl")
    assert _steps(moved) == [3]
    msg = " ".join(capsys.readouterr().out.split())
    assert "records of steps 3..3 past the resumed step 2" in msg
    assert "lr schedule changed since the checkpoint (steps 3 -> 6)" in msg and "step 3's LR is" in msg
