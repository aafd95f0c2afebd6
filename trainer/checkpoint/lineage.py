"""Which step folders a run keeps: its lineage, set-aside branches, damaged checkpoints, retention.

The checkpoint folder holds the ``step-<N>`` folders of one lineage: the chain of checkpoints the
current run descends from. Nothing else in it is ever resumed from:

- A run started with ``--checkpoint.load_step L`` below the newest step forks: the steps after L
  belong to the abandoned branch and are moved, not deleted, into
  ``abandoned-after-step-<L>-<UTC time>/`` (logged), so a later plain resume continues this run and
  never the abandoned one, and retention counts this lineage only.
- A newest checkpoint that fails verification, when the run falls back to an older one, is moved
  into ``damaged/step-<N>-<UTC time>/`` (kept for inspection; the next save of that step would
  otherwise replace it).
- Retention (``keep_latest_k``) removes the oldest steps of the lineage beyond k, never the one just
  saved. A folder is renamed to a dot name first and then deleted, so a kill in the middle never
  leaves a half-deleted folder that looks complete.

Every function here runs on rank 0 only (the callers see to it) and logs what it moved or removed.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import time
from pathlib import Path

logger = logging.getLogger("trainer")

STEP_RE = re.compile(r"^step-(\d+)$")
DAMAGED = "damaged"


def _stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def _unique(path: Path) -> Path:
    """``path``, or ``path-2``, ``path-3``... if it exists (two moves within one second)."""
    out, n = path, 1
    while out.exists():
        n += 1
        out = path.with_name(f"{path.name}-{n}")
    return out


def fork(folder: Path, load_step: int, steps: list[int]) -> Path | None:
    """Move the step folders of ``steps`` after ``load_step`` aside into ``abandoned-after-step-<L>-<time>``.

    Returns the new folder, or None when no step is after ``load_step``."""
    later = [s for s in steps if s > load_step]
    if not later:
        return None
    branch = _unique(folder / f"abandoned-after-step-{load_step}-{_stamp()}")
    branch.mkdir()
    for s in later:
        os.rename(folder / f"step-{s}", branch / f"step-{s}")
    logger.warning("checkpoint.load_step %d is below the newest step %d: this run forks there; the abandoned "
                   "branch (steps %s) was moved to %s (not deleted)", load_step, later[-1],
                   ", ".join(map(str, later)), branch)
    return branch


def set_aside_damaged(folder: Path, step: int) -> Path:
    """Move ``step-<step>`` into ``damaged/step-<step>-<time>``; returns where it went."""
    target = _unique(folder / DAMAGED / f"step-{step}-{_stamp()}")
    target.parent.mkdir(exist_ok=True)
    os.rename(folder / f"step-{step}", target)
    logger.warning("moved the damaged checkpoint step-%d to %s", step, target)
    return target


def remove_folder(path: Path) -> None:
    """Delete the folder ``path``: renamed to a hidden ``.<name>.deleting`` first, so it is never half a checkpoint."""
    doomed = _unique(path.with_name(f".{path.name}.deleting"))
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def retain(folder: Path, steps: list[int], keep_latest_k: int, just_saved: int) -> list[int]:
    """Remove the oldest of ``steps`` (this lineage's complete steps) beyond ``keep_latest_k``; the
    step ``just_saved`` is always kept. Returns the removed steps."""
    if keep_latest_k <= 0:
        return []
    keep = set(sorted(steps)[-keep_latest_k:]) | {just_saved}
    removed = [s for s in sorted(steps) if s not in keep]
    for s in removed:
        remove_folder(folder / f"step-{s}")
    if removed:
        logger.info("removed checkpoint(s) %s (checkpoint.keep_latest_k %d)", ", ".join(f"step-{s}" for s in removed),
                    keep_latest_k)
    return removed


def remove_leftovers(folder: Path) -> None:
    """Delete what a killed save or deletion left: ``.*.partial`` and ``.*.deleting`` folders."""
    if not folder.is_dir():
        return
    for p in folder.iterdir():
        if p.name.startswith(".") and (p.name.endswith(".partial") or p.name.endswith(".deleting")) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
