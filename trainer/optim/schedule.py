"""The learning-rate schedule: linear warmup, then linear, cosine or WSD decay. It scales every
parameter group's own base LR (``optimizer.lr`` times the group's ``lr_multiplier``).

Schedule (``LRSchedule.factor(step)``, ``step`` = 1-based training step, times ``optimizer.lr``):
  warmup   steps 1..W:          step / W           (the first step's LR is already > 0)
  stable   until decay starts:  1
  decay    the last D steps:    min + (1 - min) * shape(p), p = (step - (steps - D)) / D in (0, 1]
with ``shape`` = 1 - p (linear), (1 + cos(pi p)) / 2 (cosine) or 1 - sqrt(p) (wsd: Hagele et al.,
"Scaling Laws and Compute-Optimal Training Beyond Fixed Training Durations", 2024, whose (1 - sqrt)
cooldown over the last 20% of steps is the default here). D = steps - W unless ``decay_ratio`` is given
(D = round(decay_ratio * steps), at most steps - W). The last step runs at ``min_lr_factor`` unless it
is still in warmup (W = steps: the last step runs at the peak).
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from trainer.config import LRScheduler as LRSchedulerConfig

logger = logging.getLogger("trainer")

DECAY_TYPES = ("linear", "cosine", "wsd")
WSD_DEFAULT_DECAY_RATIO = 0.2


@dataclass(frozen=True)
class LRSchedule:
    """The LR multiplier at each training step; see the module docstring for the formula.

    Raises ValueError (naming the config key) for steps < 1, warmup_steps outside [0, steps], an
    unknown decay_type, decay_ratio outside [0, 1] or min_lr_factor outside [0, 1].
    """

    steps: int
    warmup_steps: int
    decay_type: str = "linear"
    decay_ratio: float | None = None
    min_lr_factor: float = 0.1

    def __post_init__(self) -> None:
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"training.steps: expected an integer >= 1, got {self.steps!r}")
        if not isinstance(self.warmup_steps, int) or not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(
                f"lr_scheduler.warmup_steps: expected an integer in [0, training.steps={self.steps}], "
                f"got {self.warmup_steps!r}"
            )
        if self.decay_type not in DECAY_TYPES:
            raise ValueError(f"lr_scheduler.decay_type: expected one of {DECAY_TYPES}, got {self.decay_type!r}")
        if self.decay_ratio is not None and not 0.0 <= self.decay_ratio <= 1.0:
            raise ValueError(f"lr_scheduler.decay_ratio: expected none or a value in [0, 1], got {self.decay_ratio!r}")
        if not 0.0 <= self.min_lr_factor <= 1.0:
            raise ValueError(f"lr_scheduler.min_lr_factor: expected a value in [0, 1], got {self.min_lr_factor!r}")

    @property
    def decay_steps(self) -> int:
        ratio = self.decay_ratio
        if ratio is None and self.decay_type == "wsd":
            ratio = WSD_DEFAULT_DECAY_RATIO
        room = self.steps - self.warmup_steps
        return room if ratio is None else min(room, round(ratio * self.steps))

    def factor(self, step: int) -> float:
        """Multiplier of the peak LR at 1-based training ``step`` (steps past the end stay at the last value)."""
        step = min(max(int(step), 1), self.steps)
        if step <= self.warmup_steps:
            return step / self.warmup_steps
        d = self.decay_steps
        decay_start = self.steps - d
        if step <= decay_start:
            return 1.0
        p = (step - decay_start) / d
        if self.decay_type == "linear":
            shape = 1.0 - p
        elif self.decay_type == "cosine":
            shape = 0.5 * (1.0 + math.cos(math.pi * p))
        else:
            shape = 1.0 - math.sqrt(p)
        return self.min_lr_factor + (1.0 - self.min_lr_factor) * shape


class WarmupDecayLR(torch.optim.lr_scheduler.LRScheduler):
    """``LRSchedule`` as a torch LR scheduler.

    After construction the optimizer holds the LR of step 1; after the k-th ``step()`` call it holds
    the LR of step k+1. ``state_dict`` holds the position (``last_epoch``) and the base LRs only, so a
    resumed run follows the schedule of its own configuration from where it stopped, and
    ``load_state_dict`` also writes that step's LR into the optimizer.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: LRSchedule, last_epoch: int = -1) -> None:
        self.schedule = schedule
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        f = self.schedule.factor(self.last_epoch + 1)
        return [base * f for base in self.base_lrs]

    def state_dict(self) -> dict:
        return {"last_epoch": int(self.last_epoch), "base_lrs": [float(b) for b in self.base_lrs],
                "schedule": dataclasses.asdict(self.schedule)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.last_epoch = int(state_dict["last_epoch"])
        self.base_lrs = [float(b) for b in state_dict["base_lrs"]]
        saved = state_dict.get("schedule")  # absent in checkpoints of older versions
        if saved is not None and saved != dataclasses.asdict(self.schedule):
            self._report_change(LRSchedule(**saved))
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self._last_lr = lrs


    def _report_change(self, old: LRSchedule) -> None:
        """A resume under another schedule (e.g. more training.steps): say how the LR changes from here."""
        new, step = self.schedule, self.last_epoch + 1
        changed = [f"{k} {a} -> {b}" for k, a, b in ((f.name, getattr(old, f.name), getattr(new, f.name))
                                                      for f in dataclasses.fields(LRSchedule)) if a != b]
        base = self.base_lrs[0] if self.base_lrs else 1.0
        logger.warning("lr schedule changed since the checkpoint (%s): step %d's LR is %.4g (the saved schedule's "
                       "%.4g), and it %s over the new %d steps", "; ".join(changed), step, base * new.factor(step),
                       base * old.factor(step), "decays" if new.decay_steps else "stays flat", new.steps)


def lr_schedule(cfg: "LRSchedulerConfig", steps: int) -> LRSchedule:
    """The schedule of the ``[lr_scheduler]`` section over ``steps`` training steps; warmup_steps
    beyond ``steps`` warms up over all of them (with a warning)."""
    warmup = cfg.warmup_steps
    if warmup > steps:
        logger.warning("lr_scheduler.warmup_steps=%d > training.steps=%d: warming up over all %d steps",
                       warmup, steps, steps)
        warmup = steps
    return LRSchedule(steps=steps, warmup_steps=warmup, decay_type=cfg.decay_type, decay_ratio=cfg.decay_ratio,
                      min_lr_factor=cfg.min_lr_factor)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, schedule: LRSchedule) -> WarmupDecayLR:
    return WarmupDecayLR(optimizer, schedule)
