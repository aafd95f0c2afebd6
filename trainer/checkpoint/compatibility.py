"""Whether a checkpoint's optimizer state fits this run's optimizer, and what differs when it does not.

A checkpoint that passes its manifest is intact; when its training state cannot be loaded into this
run, that is a difference of settings, not damage (``trainer.checkpoint.checkpointer`` never calls it damaged and
never sets it aside). The usual one: another optimizer (AdamW state saved, Muon asked for), another
state dtype (float32 saved, bfloat16 asked for), or the other implementation (torch.optim.AdamW's
param groups against titan's, whose groups carry ``optimizer``, ``label``, ``state_dtype``...).

The comparison reads the checkpoint's DCP metadata (keys and tensor dtypes, no tensor data) and the
optimizer state dict this run would load into (``get_optimizer_state_dict``: ``{"state": {fqn:
{name: tensor}}, "param_groups": [{key: value, "params": [fqn, ...]}]}``), under DCP's flattened
names ``optimizer.state.<fqn>.<name>`` and ``optimizer.param_groups.<i>.<key>``.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Mapping

import torch

# The state each optimizer keeps per parameter (trainer.optim.optimizer, torch.optim.AdamW).
STATE_KIND = {"exp_avg": "AdamW", "exp_avg_sq": "AdamW", "momentum_buffer": "Muon"}
# Param-group keys only titan's optimizer writes (trainer.optim.optimizer._CONFIG_KEYS).
TITAN_GROUP_KEYS = ("optimizer", "label", "state_dtype")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                torch.float64: "float64"}


def _dtype_name(dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _saved_layout(metadata: Mapping[str, Any]):
    """From the DCP metadata: ``({fqn: {state name: dtype or None}}, [set of keys of each group])``."""
    states: dict[str, dict[str, Any]] = {}
    groups: dict[int, set[str]] = {}
    for key, meta in metadata.items():
        if key.startswith("optimizer.state."):
            fqn, _, name = key[len("optimizer.state."):].rpartition(".")
            dtype = getattr(getattr(meta, "properties", None), "dtype", None)
            states.setdefault(fqn, {})[name] = dtype
        elif key.startswith("optimizer.param_groups."):
            index, _, rest = key[len("optimizer.param_groups."):].partition(".")
            if index.isdigit():
                groups.setdefault(int(index), set()).add(rest.split(".")[0])
    return states, [groups[i] for i in sorted(groups)]


def _expected_layout(optim_state: Mapping[str, Any]):
    states = {fqn: {name: (v.dtype if isinstance(v, torch.Tensor) else None) for name, v in st.items()}
              for fqn, st in optim_state.get("state", {}).items()}
    groups = [set(g) for g in optim_state.get("param_groups", [])]
    return states, groups


def _kind(names) -> str | None:
    kinds = {STATE_KIND[n] for n in names if n in STATE_KIND}
    return "Muon" if "Muon" in kinds else ("AdamW" if kinds else None)


def optimizer_mismatch(metadata: Mapping[str, Any], optim_state: Mapping[str, Any]) -> tuple[str, str] | None:
    """What differs between the optimizer state a checkpoint holds and the one this run loads into.

    Args:
        metadata: the checkpoint's ``state_dict_metadata`` (DCP key -> storage metadata).
        optim_state: this run's optimizer state dict (``get_optimizer_state_dict``), initialised.

    Returns None when every key this run needs is in the checkpoint with the same state dtype; else
    ``(what differs, the settings that resume it)``: e.g. ``("the checkpoint holds AdamW state for 42
    tensor(s) that this run gives to Muon; ...", "--optimizer.name adamw, ...")``. A state dtype that
    differs alone is no mismatch (the load casts it: ``state_dtype_change``).
    """
    saved, saved_groups = _saved_layout(metadata)
    want, want_groups = _expected_layout(optim_state)
    what: list[str] = []
    how: list[str] = []
    pairs = Counter((_kind(saved[f]), _kind(want[f])) for f in want if f in saved and _kind(saved[f]) != _kind(want[f]))
    if pairs:
        for (s, w), n in sorted(pairs.items(), key=lambda kv: -kv[1]):
            what.append(f"the checkpoint holds {s or 'no'} state for {n} tensor(s) that this run gives to "
                        f"{w or 'no optimizer'}")
        saved_kinds = Counter(_kind(v) for v in saved.values())
        how.append("--optimizer.name muon" if saved_kinds.get("Muon") else "--optimizer.name adamw")
        if saved_kinds.get("Muon"):
            how.append("the same --optimizer.groups")
    change = _dtype_change(saved, want)
    if change is not None:  # alone it loads (cast); beside another difference it is part of the story
        what.append(f"its optimizer states are {change[0]}, this run asks for {change[1]}")
        how.append(f"--optimizer.state_dtype {change[0].split('/')[0]}")
    saved_keys = set().union(*saved_groups) if saved_groups else set()
    want_keys = set().union(*want_groups) if want_groups else set()
    titan_saved = any(k in saved_keys for k in TITAN_GROUP_KEYS)
    titan_wanted = any(k in want_keys for k in TITAN_GROUP_KEYS)
    if titan_saved != titan_wanted:
        what.append("it was written by " + ("titan's optimizer, this run uses torch.optim.AdamW" if titan_saved else
                                            "torch.optim.AdamW, this run uses titan's optimizer"))
        if not titan_saved:
            how.append("without --optimizer.groups, --optimizer.qk_clip_threshold or --optimizer.implementation titan")
    elif len(saved_groups) != len(want_groups):
        what.append(f"it has {len(saved_groups)} optimizer param groups, this run {len(want_groups)}")
        how.append("the same --optimizer.groups")
    if what == [] or (change is not None and len(what) == 1):
        missing = sorted(f"optimizer.state.{f}.{n}" for f, st in want.items() for n in st
                         if f not in saved or n not in saved[f])
        if not missing:
            return None
        what.insert(0, f"it lacks {missing[0]}" + (f" and {len(missing) - 1} more optimizer key(s)" if len(missing) > 1
                                                else ""))
    return "; ".join(what), ", ".join(dict.fromkeys(how))


def _dtype_change(saved: dict, want: dict) -> tuple[str, str] | None:
    """``(saved dtypes, wanted dtypes)`` of the optimizer states that exist on both sides with another
    dtype (names joined by '/'), or None."""
    pairs = {(d, w_d) for f, st in want.items() for n, w_d in st.items()
             if n in STATE_KIND and f in saved and n in saved[f] and (d := saved[f][n]) is not None
             and w_d is not None and d != w_d}
    if not pairs:
        return None
    return "/".join(sorted({_dtype_name(d) for d, _ in pairs})), "/".join(sorted({_dtype_name(w) for _, w in pairs}))


def state_dtype_change(metadata: Mapping[str, Any], optim_state: Mapping[str, Any]) -> tuple[str, str] | None:
    """``(saved, wanted)`` state dtype names when the checkpoint's optimizer states have another dtype
    than this run's (which the load casts: the log says so), else None."""
    return _dtype_change(_saved_layout(metadata)[0], _expected_layout(optim_state)[0])
