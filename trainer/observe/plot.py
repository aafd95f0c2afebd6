"""Draw a run's metrics.jsonl, or several runs' for comparison, to a PNG.

    python -m trainer.plot DUMP_FOLDER [DUMP_FOLDER ...] [--out FILE.png]

Four panels against the training step: the training loss with the validation loss (dashed, where
the run validated), the learning rate, tokens/s per device and peak memory (GiB). Each run is one
color, labelled with its folder's name. A resumed run logs some steps again; the last record of
each step wins. Without ``--out`` the picture goes to ``DUMP_FOLDER/metrics.png`` for one run and
to ``metrics_comparison.png`` in the current folder for several. The trainer draws
``<dump_folder>/metrics.png`` itself at the end of a run (``--metrics.save_plot``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from pathlib import Path
from trainer.errors import PlotError  # noqa: F401  (defined on the ground floor)

JSONL_NAME = "metrics.jsonl"  # trainer.observe.metrics.JSONL_NAME (not imported: that pulls in torch)

PANELS = (
    ("loss", "loss (nats/token)"),
    ("lr", "learning rate"),
    ("tps", "tokens/s per device"),
    ("memory_gib", "peak memory (GiB)"),
)


def read_metrics(folder: str | os.PathLike) -> tuple[dict[int, dict], dict[int, dict]]:
    """``(training records, validation records)`` of ``folder/metrics.jsonl``, each by step (last wins).

    A line that is not valid JSON (torn by a kill in the middle of a write) is skipped with a
    warning naming it. Raises PlotError for a missing file or a JSON line that is not a record.
    """
    path = Path(folder) / JSONL_NAME
    if not path.is_file():
        raise PlotError(f"{folder}: no {JSONL_NAME} (is it a trainer dump folder, --job.dump_folder?)")
    train: dict[int, dict] = {}
    val: dict[int, dict] = {}
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            warnings.warn(f"{path}:{lineno}: skipped a line that is not valid JSON (torn by a kill?): {exc}",
                          stacklevel=2)
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
            raise PlotError(f"{path}:{lineno}: expected a record with an integer 'step'")
        if "val_loss" in rec:
            val[rec["step"]] = rec
        if "loss" in rec:
            train[rec["step"]] = rec
    return train, val


def _series(records: dict[int, dict], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for step in sorted(records):
        v = records[step].get(key)
        if isinstance(v, (int, float)) and math.isfinite(v):
            steps.append(step)
            values.append(float(v))
    return steps, values


def build_figure(folders: list[str | os.PathLike], labels: list[str] | None = None):
    """The matplotlib figure of the runs in ``folders`` (overlaid): one axis per ``PANELS`` entry.

    Raises PlotError (no metrics in a folder) and ImportError (matplotlib missing).
    """
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    if not folders:
        raise PlotError("no dump folder given")
    runs = [read_metrics(f) for f in folders]
    labels = labels or [Path(f).resolve().name or str(f) for f in folders]
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5), constrained_layout=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, ((train, val), label) in enumerate(zip(runs, labels)):
        color = colors[i % len(colors)]
        for ax, (key, _) in zip(axes.flat, PANELS):
            steps, values = _series(train, key)
            if steps:
                ax.plot(steps, values, color=color, label=f"{label} train" if key == "loss" else label,
                        marker="." if len(steps) < 30 else None)
            if key == "loss":
                vs, vv = _series(val, "val_loss")
                if vs:
                    ax.plot(vs, vv, color=color, linestyle="--", marker="o", markersize=4, label=f"{label} validation")
    for ax, (key, title) in zip(axes.flat, PANELS):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        if key == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        if ax.lines:
            ax.legend(fontsize="small")
    fig.suptitle(" vs ".join(labels) if len(labels) > 1 else labels[0])
    return fig


def plot_runs(folders: list[str | os.PathLike], out: str | os.PathLike, labels: list[str] | None = None) -> Path:
    """Draw the runs in ``folders`` (overlaid, ``build_figure``) to the PNG ``out`` (1200 x 750); returns its path.

    Raises PlotError (no metrics in a folder) and ImportError (matplotlib missing).
    """
    fig = build_figure(folders, labels)  # selects the Agg backend first
    import matplotlib.pyplot as plt

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.plot",
        description="Draw metrics.jsonl of one or more trainer runs (loss and validation loss, LR, tokens/s, "
                    "memory against step) to a PNG; several runs are overlaid.",
    )
    parser.add_argument("folders", nargs="+", metavar="DUMP_FOLDER", help="a run's --job.dump_folder")
    parser.add_argument("--out", metavar="FILE.png", default=None,
                        help="output file (default: DUMP_FOLDER/metrics.png for one run, "
                             "./metrics_comparison.png for several)")
    args = parser.parse_args(argv)
    out = args.out or (Path(args.folders[0]) / "metrics.png" if len(args.folders) == 1 else Path("metrics_comparison.png"))
    try:
        path = plot_runs(args.folders, out)
    except PlotError as exc:
        print(f"python -m trainer.plot: error: {exc}", file=sys.stderr)
        return 1
    except ImportError as exc:
        print(f"python -m trainer.plot: error: {exc}; install matplotlib (pip install matplotlib)", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
