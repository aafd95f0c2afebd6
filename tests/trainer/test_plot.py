"""trainer.plot: metrics.jsonl -> PNG (train + validation loss, LR, tokens/s, memory), runs overlaid, resumes."""
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.observe.plot import PANELS, PlotError, build_figure, plot_runs, read_metrics

REPO = Path(__file__).resolve().parents[2]


def _write_run(folder: Path, steps, loss0: float, resumed_from: int | None = None) -> None:
    folder.mkdir(parents=True)
    lines = []
    for s in steps:
        lines.append({"step": s, "loss": loss0 - 0.1 * s, "grad_norm": 1.0, "lr": 1e-3 * min(1, s / 3), "tps": 1000 + s,
                      "mfu": None, "memory_gib": 0.5 + 0.01 * s, "data_wait": 0.0, "elapsed_s": s, "eta_s": None})
        if s % 4 == 0:
            lines.append({"step": s, "val_loss": loss0 - 0.09 * s, "val_perplexity": 1.0, "val_tokens": 10,
                          "val_batches": 1, "val_time_s": 0.1, "elapsed_s": s})
    if resumed_from is not None:  # the resumed process logs steps after its checkpoint again
        for s in steps:
            if s > resumed_from:
                lines.append({"step": s, "loss": 99.0 + s, "lr": 2e-3, "tps": 5.0, "memory_gib": 1.0})
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_read_metrics_splits_records_and_the_last_of_a_step_wins(tmp_path):
    _write_run(tmp_path / "a", range(1, 9), 5.0, resumed_from=6)
    train, val = read_metrics(tmp_path / "a")
    assert sorted(train) == list(range(1, 9)) and sorted(val) == [4, 8]
    assert train[7]["loss"] == 106.0 and train[5]["loss"] == pytest.approx(4.5)  # resumed records replace
    assert val[8]["val_loss"] == pytest.approx(5.0 - 0.72)


def test_figure_overlays_runs_with_validation(tmp_path):
    _write_run(tmp_path / "a", range(1, 9), 5.0)
    _write_run(tmp_path / "b", range(1, 13), 6.0)
    fig = build_figure([tmp_path / "a", tmp_path / "b"])
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == [title for _, title in PANELS]
    loss_ax = axes[0]
    labels = [line.get_label() for line in loss_ax.lines]
    assert labels == ["a train", "a validation", "b train", "b validation"]
    assert list(loss_ax.lines[2].get_xdata()) == list(range(1, 13))
    assert list(loss_ax.lines[3].get_xdata()) == [4, 8, 12]
    assert list(loss_ax.lines[1].get_ydata()) == pytest.approx([5.0 - 0.36, 5.0 - 0.72])
    assert list(axes[2].lines[0].get_ydata()) == [1000 + s for s in range(1, 9)]  # tokens/s of run a
    assert list(axes[3].lines[1].get_xdata()) == list(range(1, 13))  # memory of run b
    out = plot_runs([tmp_path / "a", tmp_path / "b"], tmp_path / "out" / "cmp.png")
    assert _png_size(out) == (1200, 750)


def test_command_line(tmp_path):
    _write_run(tmp_path / "a", range(1, 5), 5.0)
    _write_run(tmp_path / "b", range(1, 5), 5.5)
    run = lambda *args: subprocess.run([sys.executable, "-m", "trainer.plot", *map(str, args)], cwd=tmp_path,
                                       env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
                                       capture_output=True, text=True, timeout=120)
    one = run(tmp_path / "a")
    assert one.returncode == 0, one.stderr
    assert _png_size(tmp_path / "a" / "metrics.png") == (1200, 750)
    both = run(tmp_path / "a", tmp_path / "b", "--out", tmp_path / "both.png")
    assert both.returncode == 0 and (tmp_path / "both.png").is_file() and "wrote" in both.stdout
    missing = run(tmp_path / "nothing")
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1
    assert "no metrics.jsonl" in missing.stderr and "Traceback" not in missing.stderr


def test_torn_line_is_skipped_with_a_warning_and_a_non_record_is_an_error(tmp_path):
    # A kill in the middle of a write leaves a torn line; the records around it still plot.
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n{"step": 3, "loss": 1.5}\n')
    with pytest.warns(UserWarning, match=r"metrics.jsonl:2: skipped a line that is not valid JSON"):
        train, _ = read_metrics(tmp_path)
    assert sorted(train) == [1, 3]
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n[1, 2]\n')
    with pytest.raises(PlotError, match=r"metrics.jsonl:2: expected a record"):
        read_metrics(tmp_path)
