"""What a dump folder already holds when a run starts, and what the run does with it: no run appends
its records to another run's ``metrics.jsonl``.

- A fresh run (nothing to resume) in a folder with an earlier run's metrics moves that run's outputs
  (``metrics.jsonl``, ``metrics.png``, the TensorBoard folder) aside into ``previous/<UTC time>/`` and
  says so. When the earlier run ended in a Hugging Face export (``checkpoint.last_save_in_hf``: an
  ``hf-step-N`` folder, which does not resume training), the message says how to continue from it.
- A resumed run whose folder holds records past the resumed step (the earlier run went on after its
  last checkpoint, or a rollback with ``checkpoint.load_step``) moves those records into
  ``metrics.after-step-<N>-<UTC time>.jsonl`` and says so; the records up to the step stay.

Rank 0 only (the metrics belong to it). Called by the Trainer after the checkpoint is resolved and
before the metrics logger opens the file.
"""
from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

logger = logging.getLogger("trainer")

METRICS = "metrics.jsonl"
PLOT = "metrics.png"


def _stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime())


def _records(path: Path) -> list[tuple[str, int | None]]:
    """(line, step or None) of each whole line of ``path``."""
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            step = None
        out.append((line, step if isinstance(step, int) else None))
    return out


def _hf_exports(checkpoint_folder: Path) -> list[Path]:
    if not checkpoint_folder.is_dir():
        return []
    found = [p for p in checkpoint_folder.glob("hf-step-*") if p.is_dir() and p.name[8:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[8:]))


def settle_previous_outputs(dump_folder: str | Path, resumed_step: int, checkpoint_folder: str | Path,
                            tb_folder: str = "tb") -> Path | None:
    """Move an earlier run's outputs out of this run's way (module docstring); returns where they went,
    or None when nothing had to move."""
    folder = Path(dump_folder)
    metrics = folder / METRICS
    if not metrics.is_file() or metrics.stat().st_size == 0:
        return None
    records = _records(metrics)
    steps = [s for _, s in records if s is not None]
    if not steps:
        return None
    if resumed_step == 0:
        dest = folder / "previous" / _stamp()
        dest.mkdir(parents=True, exist_ok=True)
        for name in (METRICS, PLOT, tb_folder):
            if (folder / name).exists():
                shutil.move(str(folder / name), str(dest / name))
        hint = ""
        exports = _hf_exports(Path(checkpoint_folder))
        if exports:
            hint = (f"; it ended in a Hugging Face export, which does not resume training: to continue from it, "
                    f"--checkpoint.initial_load_path {exports[-1]} --checkpoint.initial_load_in_hf")
        logger.warning("%s holds an earlier run's metrics (steps %d..%d) and no checkpoint to resume: they moved to "
                       "%s; this run starts at step 1%s", folder, min(steps), max(steps), dest, hint)
        return dest
    later = [line for line, s in records if s is not None and s > resumed_step]
    if not later:
        return None
    keep = [line for line, s in records if s is None or s <= resumed_step]
    dest = folder / f"metrics.after-step-{resumed_step}-{_stamp()}.jsonl"
    dest.write_text("".join(line + "\n" for line in later), encoding="utf-8")
    tmp = metrics.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in keep), encoding="utf-8")
    tmp.replace(metrics)
    logger.warning("%s has records of steps %d..%d past the resumed step %d (the earlier run went on after its last "
                   "checkpoint): they moved to %s", metrics, resumed_step + 1, max(steps), resumed_step, dest)
    return dest
