"""Optimizers and the learning-rate schedule.

  schedule.py    LRSchedule (warmup, then linear / cosine / WSD decay) and its torch scheduler
  build.py       build_optimizer: torch.optim.AdamW, or TitanOptimizer when the config needs it
  optimizer.py   TitanOptimizer: AdamW (titan_kernels.fused_adamw_) and Muon groups in one step
  groups.py      parameter kinds and the [optimizer.groups] rules -> param groups
  muon_dist.py   Newton-Schulz of sharded matrices: each gathered whole on one rank, overlapped
  qk_clip.py     QK-clip (MuonClip) from the attention's per-head max logit bound; its metrics
  describe.py    the start-up log lines of the optimizer, its groups and QK-clip
"""
from trainer.optim.build import build_optimizer, uses_titan_optimizer  # noqa: F401
from trainer.optim.optimizer import TitanOptimizer  # noqa: F401
from trainer.optim.schedule import (  # noqa: F401
    DECAY_TYPES,
    WSD_DEFAULT_DECAY_RATIO,
    LRSchedule,
    WarmupDecayLR,
    build_lr_scheduler,
    lr_schedule,
)
