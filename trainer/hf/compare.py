"""Whether two models' arguments describe the same model: the fields that fix the tensor shapes (a
mismatch cannot load) and those that only change the math (a mismatch loads, with a warning).

Used to name a config.json's flavor (``trainer.hf.llama``, ``trainer.hf.qwen3``) and to check a
checkpoint against the run's model (``trainer.checkpoint``). The fields are those of
``trainer.models.llama_args.ModelArgs`` and ``trainer.models.qwen3_args.Qwen3Args``.
"""
from __future__ import annotations

from trainer.hf.common import HFCheckpointError, logger
from trainer.models.common import family_of

# Fields of the model args that fix the tensor shapes (a mismatch cannot load) and those that only
# change the math (a mismatch loads, but the model is not the one that was trained). "moe.x" reads
# the MoEArgs field x (None for a dense model); fields a family lacks are skipped.
_SHAPE_FIELDS = ("family", "dim", "n_layers", "n_heads", "kv_heads", "head_dim", "ffn_hidden_dim", "vocab_size",
                 "tie_word_embeddings", "qk_norm", "n_dense_layers", "moe.num_experts", "moe.hidden_dim",
                 "moe.num_shared_experts")
_MATH_FIELDS = ("norm_eps", "rope_theta", "rope_scaling", "moe.top_k", "moe.score_func", "moe.route_norm",
                "moe.route_scale")


def _field(args, name: str):
    if name == "family":
        return family_of(args)
    if name.startswith("moe."):
        moe = getattr(args, "moe", None)
        return None if moe is None else getattr(moe, name[4:])
    return getattr(args, name, None)


def _differing(a, b, ignore_vocab: bool = False) -> list[tuple[str, object, object]]:
    out = []
    for f in _SHAPE_FIELDS + _MATH_FIELDS:
        if f == "vocab_size" and (ignore_vocab or -1 in (a.vocab_size, b.vocab_size)):
            continue
        if f == "qk_norm":  # Llama's args have no field: no QK-norm
            va, vb = bool(_field(a, f)), bool(_field(b, f))
        elif f == "n_dense_layers":
            va, vb = _field(a, f) or 0, _field(b, f) or 0
        else:
            va, vb = _field(a, f), _field(b, f)
        if va != vb:
            out.append((f, va, vb))
    return out


def differences(a, b, ignore_vocab: bool = False) -> list[str]:
    """``field a vs b`` for every shape or math field where the model args ``a`` and ``b`` differ
    (``family llama3 vs qwen3`` first when they are of two families; ``moe.top_k 8 vs 2``...)."""
    return [f"{f} {va} vs {vb}" for f, va, vb in _differing(a, b, ignore_vocab)]


def check_compatible(found, run, where: str, run_name: str) -> None:
    """Raise HFCheckpointError if ``found`` (a checkpoint's) has other shapes than ``run``; warn for other math."""
    shape = [f"{f} {va} vs {vb}" for f, va, vb in _differing(found, run) if f in _SHAPE_FIELDS]
    if shape:
        raise HFCheckpointError(f"{where}: shapes do not match {run_name}: {'; '.join(shape)} (checkpoint vs run)")
    math_ = differences(found, run)
    if math_:
        logger.warning("%s: loads into %s, but %s (checkpoint vs run): the model is not exactly the one saved",
                       where, run_name, "; ".join(math_))
