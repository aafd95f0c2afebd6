"""Weights & Biases logging (``--metrics.enable_wandb``): the same records as metrics.jsonl.

The run lives under ``<dump_folder>/<metrics.save_wandb_folder>`` and is written offline unless the
environment says otherwise (``WANDB_MODE=online`` with an API key; without a network, offline is the
only mode that works): ``wandb sync <that folder>/wandb/offline-run-*`` uploads it later. The
project comes from ``--metrics.wandb_project`` (or ``WANDB_PROJECT``); the whole job configuration
is the run's config. Rank 0 only.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# Record keys logged as train/<key> (the numbers of metrics.jsonl's step records).
TRAIN_KEYS = ("loss", "grad_norm", "lr", "tps", "mfu", "memory_gib", "data_wait")


class WandbLogger:
    """A wandb run; ``log_train(record)``, ``log_validation(step, record)``, ``finish()``.

    Raises RuntimeError when the wandb package is missing (the message says how to install it).
    """

    def __init__(self, folder: str | os.PathLike, project: str, config: dict[str, Any], name: str | None = None) -> None:
        try:
            import wandb
        except ImportError:
            raise RuntimeError("--metrics.enable_wandb: needs the wandb package (pip install wandb)") from None
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        mode = os.environ.get("WANDB_MODE", "offline")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", project), dir=str(folder), mode=mode,
                              config=config, name=name, reinit="finish_previous")
        self.folder = folder

    def log_train(self, record: dict[str, Any]) -> None:
        data = {f"train/{k}": record[k] for k in TRAIN_KEYS if record.get(k) is not None}
        data.update({f"train/{k}": v for k, v in record.items() if k.startswith("moe_")})
        self.run.log(data, step=record["step"])

    def log_validation(self, step: int, record: dict[str, Any]) -> None:
        values = {"validation/loss": record["val_loss"]}
        if "val_perplexity" in record:  # a language model's
            values["validation/perplexity"] = record["val_perplexity"]
        self.run.log(values, step=step)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
