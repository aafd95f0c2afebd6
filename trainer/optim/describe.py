"""What the optimizer is, in the start-up log: ``optimizer_lines`` (and ``log_optimizer``).

One line names the optimizer and its shared settings, then one line per parameter group: its label
(which kinds of parameters it takes: ``muon[hidden,expert]``, ``adamw[embedding,output,norm]``),
how many tensors and parameters, its peak learning rate (the schedule scales it), weight decay and
the dtype of its states; then QK-clip's line when it is on (``QKClip.describe``). Parameter counts
are the full tensors' (DTensor shards counted whole); with pipeline stages they are this rank's.
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger("trainer")


def _dtype(d) -> str:
    return str(d).replace("torch.", "")


def _count(params) -> tuple[int, int]:
    return len(params), sum(p.numel() for p in params)


def _torch_adamw_lines(opt: torch.optim.AdamW) -> list[str]:
    d = opt.defaults
    impl = "fused" if d.get("fused") else "foreach" if d.get("foreach") else "for-loop"
    b1, b2 = d["betas"]
    lines = [f"optimizer: AdamW (torch.optim.AdamW, {impl}), betas {b1:g}/{b2:g}, eps {d['eps']:g}, "
             f"{len(opt.param_groups)} group(s):"]
    for g in opt.param_groups:
        n, size = _count(g["params"])
        label = "adamw[2+ dims]" if all(p.dim() >= 2 for p in g["params"]) else "adamw[1-D]"
        dtypes = sorted({_dtype(p.dtype) for p in g["params"]})
        lines.append(f"  {label}: {n} tensors, {size:,} parameters, peak lr {g['lr']:g}, weight decay "
                     f"{g['weight_decay']:g}, states {'/'.join(dtypes)} (the parameters' dtype)")
    return lines


def _titan_lines(opt) -> list[str]:
    groups = opt.param_groups
    kinds = sorted({g["optimizer"] for g in groups})
    names = {"adamw": "AdamW", "muon": "Muon"}
    head = f"optimizer: {' + '.join(names[k] for k in kinds)} (TitanOptimizer)"
    g0 = groups[0]
    if "adamw" in kinds:
        b1, b2 = g0["betas"]
        head += f"; AdamW: betas {b1:g}/{b2:g}, eps {g0['eps']:g}, titan_kernels.fused_adamw_"
    if "muon" in kinds:
        head += (f"; Muon: momentum {g0['momentum']:g}{' (Nesterov)' if g0['nesterov'] else ''}, "
                 f"{g0['ns_steps']} Newton-Schulz steps in {_dtype(opt.ns_dtype)}, rms match {g0['rms_match']:g}")
    lines = [f"{head}; {len(groups)} group(s):"]
    for g in groups:
        n, size = _count(g["params"])
        state = "momentum" if g["optimizer"] == "muon" else "states"
        lines.append(f"  {g['label']}: {n} tensors, {size:,} parameters, peak lr {g['lr']:g}, weight decay "
                     f"{g['weight_decay']:g}, {state} {g['state_dtype']}")
    return lines


def optimizer_lines(opt: torch.optim.Optimizer) -> list[str]:
    """The start-up lines of ``opt`` (module docstring): torch.optim.AdamW or TitanOptimizer."""
    lines = _torch_adamw_lines(opt) if isinstance(opt, torch.optim.AdamW) else _titan_lines(opt)
    clip = getattr(opt, "after_step", None)
    if clip is not None and hasattr(clip, "describe"):
        lines.append(clip.describe())
    return lines


def log_optimizer(opt: torch.optim.Optimizer) -> None:
    for line in optimizer_lines(opt):
        logger.info("%s", line)
