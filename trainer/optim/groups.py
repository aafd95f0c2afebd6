"""Parameter groups: which optimizer, LR multiplier and weight decay each parameter gets.

Every trainable parameter has a kind, from its name and module (names as in
``trainer.models.blocks``):
  embedding  tok_embeddings.*            output  output.* (a tied output is the embedding)
  bias       *.bias, *_bias              norm    weights of normalization layers (RMSNorm, ...)
  router     MoE routers (*.router.*)    expert  routed experts, 3-D (n_experts, in, out)
  hidden     every other 2-D weight      other   every other parameter (1-D, scalars)
Defaults: with ``optimizer.name muon`` the hidden and expert weights take Muon (experts per expert),
everything else AdamW (Jordan et al. 2024: Muon is for hidden matrices; Liu et al. 2025 keep the
embedding and head on AdamW); with adamw everything takes AdamW. Weight decay ``optimizer.weight_decay``
on parameters of 2 or more dims, none on 1-D ones (GPT-2/Megatron practice); LR multiplier 1.
Then the ``optimizer.groups`` rules apply in order, each to the parameters its selector matches (a
kind, or a glob over names), later rules overriding earlier ones key by key.

Parameters with the same (optimizer, lr_multiplier, weight_decay) form one group, in the order
they first appear in the model.
"""
from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass

from torch import nn

from trainer.config.validate import GROUP_KINDS, parse_group_rules

logger = logging.getLogger("trainer")


def param_kind(name: str, param: nn.Parameter, module: nn.Module | None) -> str:
    """The kind of parameter ``name`` (module docstring); ``module`` is the module that owns it."""
    parts = name.split(".")
    if parts[0] == "tok_embeddings":
        return "embedding"
    if parts[0] == "output":
        return "output"
    if parts[-1] == "bias" or parts[-1].endswith("_bias"):  # GPT-OSS's experts.w1_bias (E, hidden) too
        return "bias"
    if module is not None and "norm" in type(module).__name__.lower():
        return "norm"
    if "router" in parts:
        return "router"
    if "experts" in parts and param.dim() == 3:
        return "expert"
    if param.dim() == 2:
        return "hidden"
    return "other"


@dataclass
class ParamSetting:
    name: str
    kind: str
    optimizer: str
    lr_multiplier: float
    weight_decay: float


def settings(model: nn.Module, name: str, weight_decay: float, rules: list[str]) -> list[tuple[nn.Parameter, ParamSetting]]:
    """Each trainable parameter of ``model`` (first occurrence only) with its setting (module docstring).

    Raises ValueError naming ``optimizer.groups`` when a rule gives Muon to a parameter that is not
    a matrix or a batch of matrices (2 or 3 dims).
    """
    owner = {}
    for mod_name, mod in model.named_modules():
        for pname, _ in mod.named_parameters(recurse=False):
            owner[f"{mod_name}.{pname}" if mod_name else pname] = mod
    muon = name.lower() == "muon"
    parsed = parse_group_rules(rules)
    used = [False] * len(parsed)
    out = []
    for pname, p in model.named_parameters():
        if not p.requires_grad:
            continue
        kind = param_kind(pname, p, owner.get(pname))
        s = ParamSetting(pname, kind, "muon" if muon and kind in ("hidden", "expert") else "adamw", 1.0,
                         weight_decay if p.dim() >= 2 else 0.0)
        for i, (sel, values) in enumerate(parsed):
            if sel == kind or (sel not in GROUP_KINDS and fnmatch.fnmatchcase(pname, sel)):
                used[i] = True
                for key, value in values.items():
                    setattr(s, key, value)
        if s.optimizer == "muon" and p.dim() not in (2, 3):
            raise ValueError(f"optimizer.groups: Muon needs a matrix (2 dims) or a batch of them (3 dims), but "
                             f"parameter {pname!r} ({kind}) has shape {tuple(p.shape)}")
        out.append((p, s))
    for i, (sel, _) in enumerate(parsed):
        if not used[i]:
            logger.info("optimizer.groups: rule %r matches no parameter of this rank", rules[i])
    return out


def param_groups(model: nn.Module, name: str, lr: float, weight_decay: float, rules: list[str]) -> list[dict]:
    """The optimizer's param groups: ``{"params", "param_names", "optimizer", "lr", "lr_multiplier",
    "weight_decay", "label"}``, one per distinct setting (module docstring)."""
    groups: dict[tuple, dict] = {}
    for p, s in settings(model, name, weight_decay, rules):
        key = (s.optimizer, s.lr_multiplier, s.weight_decay)
        g = groups.setdefault(key, {"params": [], "param_names": [], "optimizer": s.optimizer,
                                    "lr": lr * s.lr_multiplier, "lr_multiplier": s.lr_multiplier,
                                    "weight_decay": s.weight_decay, "kinds": []})
        g["params"].append(p)
        g["param_names"].append(s.name)
        if s.kind not in g["kinds"]:
            g["kinds"].append(s.kind)
    out = list(groups.values())
    for g in out:
        g["label"] = f"{g['optimizer']}[{','.join(g['kinds'])}]"
        del g["kinds"]
    return out


def rule_errors(args, optimizer_name: str, weight_decay: float, rules: list[str]) -> list[str]:
    """The ``optimizer.groups`` rules that give Muon a vector in the model of ``args`` (its parameters'
    names and shapes from the model built on the meta device: no memory), as error lines; checked
    before the model is built, so that a glob such as ``'layers.*: optimizer=muon'`` (which takes the
    norms too) is a configuration error, not a failure after the build."""
    from trainer.registry import build_model

    try:
        settings(build_model(args, "meta"), optimizer_name, weight_decay, rules)
    except ValueError as exc:
        return [f"--{exc}"]
    return []
