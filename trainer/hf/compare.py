"""Whether two models' arguments describe the same model: the fields that fix the tensor shapes (a
mismatch cannot load) and those that only change the math (a mismatch loads, with a warning).

Used to name a config.json's flavor (the families' adapters) and to check a checkpoint against the
run's model (``trainer.checkpoint.checkpointer``). The fields are read from the args dataclasses themselves: every
field (a nested one, e.g. the MoE's, as ``moe.top_k``), its family's ``SHAPE_FIELDS`` saying which fix
shapes and ``IGNORED_FIELDS`` which change nothing of a trained model.
"""
from __future__ import annotations

import dataclasses

from trainer.hf.common import HFCheckpointError, logger
from trainer.registry import family_of


def _flat(args, prefix: str = "") -> dict[str, object]:
    out = {}
    for f in dataclasses.fields(args):
        v = getattr(args, f.name)
        if dataclasses.is_dataclass(v):
            out.update(_flat(v, f"{prefix}{f.name}."))
        elif v is None and f.name == "moe":
            out[f"{prefix}moe.num_experts"] = None  # dense: compares unequal to any MoE
        else:
            out[prefix + f.name] = v
    return out


def _fields(args) -> dict[str, object]:
    out = _flat(args)
    for name in args.SHAPE_FIELDS:  # derived shape fields (kv_heads, ffn_hidden_dim)
        if "." not in name and name not in out:
            try:
                out[name] = getattr(args, name)
            except (AttributeError, NotImplementedError):
                pass
    return out


def _differing(a, b, ignore_vocab: bool = False) -> list[tuple[str, object, object]]:
    if type(a) is not type(b):
        return [("family", family_of(a), family_of(b))]
    fa, fb = _fields(a), _fields(b)
    ignored = set(a.IGNORED_FIELDS) | {"n_kv_heads"}  # kv_heads is compared (None = n_heads)
    out = []
    for name in dict.fromkeys(list(fa) + list(fb)):
        if name in ignored:
            continue
        if name == "vocab_size" and (ignore_vocab or -1 in (a.vocab_size, b.vocab_size)):
            continue
        va, vb = fa.get(name), fb.get(name)
        if va != vb:
            out.append((name, va, vb))
    return out


def is_shape_field(args, name: str) -> bool:
    return name == "family" or name in args.SHAPE_FIELDS


def differences(a, b, ignore_vocab: bool = False) -> list[str]:
    """``field a vs b`` for every shape or math field where the model args ``a`` and ``b`` differ
    (``family llama3 vs qwen3`` alone when they are of two families; ``moe.top_k 8 vs 2``...)."""
    return [f"{f} {va} vs {vb}" for f, va, vb in _differing(a, b, ignore_vocab)]


def matching_flavor(args, flavors: dict) -> str:
    """The name of the flavor in ``flavors`` that is the same model as ``args``, else "custom"."""
    return next((name for name, flavor in flavors.items() if not differences(args, flavor)), "custom")


def check_compatible(found, run, where: str, run_name: str) -> None:
    """Raise HFCheckpointError if ``found`` (a checkpoint's) has other shapes than ``run``; warn for other math."""
    diff = _differing(found, run)
    shape = [f"{f} {va} vs {vb}" for f, va, vb in diff if is_shape_field(run, f)]
    if shape:
        raise HFCheckpointError(f"{where}: shapes do not match {run_name}: {'; '.join(shape)} (checkpoint vs run)")
    if diff:
        logger.warning("%s: loads into %s, but %s (checkpoint vs run): the model is not exactly the one saved",
                       where, run_name, "; ".join(f"{f} {va} vs {vb}" for f, va, vb in diff))
