"""``build_optimizer``: the optimizer of the ``[optimizer]`` section for a (parallelized) model.

With CPU offload and ``implementation auto`` it is TitanOptimizer (titan's native CPU kernel). Otherwise
plain AdamW with float32 states and no group rules is ``torch.optim.AdamW`` (fused, foreach or a
for-loop, ``optimizer.implementation``), in two groups: weight decay on parameters with >= 2 dims,
none on 1-D ones. Anything else (``optimizer.name muon``, ``optimizer.groups`` rules, bfloat16
states, QK-clip, or ``implementation titan``) is ``trainer.optim.optimizer.TitanOptimizer``, whose
groups come from ``trainer.optim.groups``. Either is named in the log, with its groups
(``trainer.optim.describe``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from trainer.optim.describe import log_optimizer
from trainer.optim.groups import param_groups
from trainer.parallel.cpu_offload import OverlappedStep
from trainer.optim.optimizer import TitanOptimizer
from trainer.optim.qk_clip import QKClip

if TYPE_CHECKING:
    from trainer.config import Optimizer as OptimizerConfig

NS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "auto": None}


def _implementation_flags(implementation: str, params: list[torch.Tensor]) -> dict:
    if implementation == "for-loop":
        return {"foreach": False, "fused": False}
    if implementation == "foreach":
        return {"foreach": True, "fused": False}
    fused_ok = all(p.device.type in ("cuda", "cpu") for p in params)
    if implementation == "fused":
        if not fused_ok:
            kinds = sorted({p.device.type for p in params})
            raise RuntimeError(f"optimizer.implementation: 'fused' AdamW needs cuda or cpu parameters, got {kinds}")
        return {"fused": True}
    if implementation == "auto":
        return {"fused": True} if fused_ok else {"foreach": True}
    raise ValueError(
        f"optimizer.implementation: expected one of auto, titan, fused, foreach, for-loop, got {implementation!r}"
    )


def uses_titan_optimizer(cfg: "OptimizerConfig") -> bool:
    """True when the configuration needs TitanOptimizer (module docstring)."""
    return (cfg.name == "muon" or bool(cfg.groups) or cfg.state_dtype != "float32"
            or cfg.qk_clip_threshold is not None or cfg.implementation == "titan")


def build_optimizer(model: nn.Module, cfg: "OptimizerConfig", *, mesh=None, seed: int = 0,
                    cpu_offload: bool = False, overlap: bool = True) -> torch.optim.Optimizer:
    """The optimizer over ``model``'s trainable parameters (module docstring).

    Args:
        model: this rank's model (a pipeline rank: the union of its stages), parallelized.
        cfg: the ``[optimizer]`` section.
        mesh: the world DeviceMesh, or None in one process (Muon's exchange groups, QK-clip's reductions).
        seed: the stochastic rounding seed of bfloat16 states (``training.seed``).
        cpu_offload: the parameters live in host memory (``--training.enable_cpu_offload``): with
            implementation auto the step is TitanOptimizer's, i.e. titan's native CPU ``fused_adamw_``,
            and with ``overlap`` (not under pipeline parallel) it overlaps the next forward
            (``trainer.parallel.cpu_offload.OverlappedStep``).

    Raises ValueError for an unknown optimizer name or implementation, group rules that give Muon to
    a vector, or QK-clip on a model without it; RuntimeError if 'fused' was asked for parameters on
    a device without a fused kernel.
    """
    name = cfg.name.lower() if isinstance(cfg.name, str) else cfg.name
    if name not in ("adamw", "muon"):
        raise ValueError(f"optimizer.name: expected one of AdamW, adamw, muon, got {cfg.name!r}")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("model: has no trainable parameters")
    if not (uses_titan_optimizer(cfg) or (cpu_offload and cfg.implementation == "auto")):
        decay = [p for _, p in named if p.dim() >= 2]
        no_decay = [p for _, p in named if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}]
        if no_decay:
            groups.append({"params": no_decay, "weight_decay": 0.0})
        flags = _implementation_flags(cfg.implementation, [p for _, p in named])
        opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **flags)
        log_optimizer(opt)
        return opt
    if cfg.implementation not in ("auto", "titan"):
        raise ValueError(f"optimizer.implementation: expected auto or titan for titan's optimizer (Muon, groups, "
                         f"bfloat16 states or QK-clip), got {cfg.implementation!r}")
    groups = param_groups(model, name, cfg.lr, cfg.weight_decay, list(cfg.groups))
    clip = QKClip(model, cfg.qk_clip_threshold, mesh) if cfg.qk_clip_threshold is not None else None
    opt = TitanOptimizer(groups, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, state_dtype=cfg.state_dtype, seed=seed,
                         momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov, ns_steps=cfg.muon_ns_steps,
                         rms_match=cfg.muon_rms_match, ns_dtype=NS_DTYPES[cfg.muon_ns_dtype], mesh=mesh,
                         after_step=clip)
    log_optimizer(opt)  # the start-up log names it, its groups and QK-clip (trainer.optim.describe)
    if cpu_offload and overlap:
        OverlappedStep(model, opt)
    return opt
