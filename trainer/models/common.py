"""The model families (``--model.name``) behind one interface.

Every family is the same decoder (``trainer.models.blocks``: Attention with optional QK-norm and its
own head_dim, the SwiGLU FeedForward or a ``trainer.models.moe.MoE`` per layer, the pre-norm
TransformerBlock and the Transformer); a family contributes only its hyperparameters and flavors:

  llama3   ``trainer.models.llama_args.ModelArgs``, ``LLAMA3_FLAVORS``
  qwen3    ``trainer.models.qwen3_args.Qwen3Args``, ``QWEN3_FLAVORS`` (dense and MoE)

Torch-free at import (the estimate and the planner use it); ``build_model`` imports the modules.
"""
from __future__ import annotations

import dataclasses

from trainer.models.llama_args import LLAMA3_FLAVORS, ModelArgs
from trainer.models.llama_args import model_args as llama3_model_args
from trainer.models.qwen3_args import QWEN3_FLAVORS, Qwen3Args, format_params, qwen3_model_args

FAMILIES = ("llama3", "qwen3")
FLAVORS = {"llama3": LLAMA3_FLAVORS, "qwen3": QWEN3_FLAVORS}
_ARGS = {"llama3": ModelArgs, "qwen3": Qwen3Args}

__all__ = ["FAMILIES", "FLAVORS", "family_of", "model_args", "args_from_record", "build_model", "format_params",
           "active_params"]


def family_of(args) -> str:
    """``llama3`` or ``qwen3`` for a ModelArgs / Qwen3Args."""
    return getattr(args, "name", "llama3")


def model_args(name: str, flavor: str, vocab_size: int, max_seq_len: int, model_config=None):
    """The hyperparameters of ``flavor`` of family ``name`` for a tokenizer of ``vocab_size`` tokens.

    ``model_config``: the ``[model]`` config section; its ``moe_*`` keys set the load balancing of a
    MoE flavor. Raises ValueError for an unknown family or flavor, or a tokenizer too large.
    """
    if name not in FAMILIES:
        raise ValueError(f"model.name: expected one of {', '.join(FAMILIES)}, got {name!r}")
    if name == "llama3":
        return llama3_model_args(flavor, vocab_size, max_seq_len)
    args = qwen3_model_args(flavor, vocab_size, max_seq_len)
    if args.moe is not None and model_config is not None:
        args = args.replace(moe=args.moe.replace(
            load_balance=model_config.moe_load_balance, bias_update_rate=model_config.moe_bias_update_rate,
            aux_loss_coeff=model_config.moe_aux_loss_coeff))
    return args


def args_record(args) -> dict:
    """The JSON-able fields of ``args`` plus its family (checkpoints record them)."""
    return {"model": family_of(args), **dataclasses.asdict(args)}


def args_from_record(fields: dict, family: str | None = None):
    """Rebuild the args of ``fields`` (``dataclasses.asdict`` of them); ``family`` default llama3
    (checkpoints written before Qwen3 did not name it)."""
    fields = dict(fields)
    family = fields.pop("model", None) or family or "llama3"
    if family not in _ARGS:
        raise ValueError(f"model: expected one of {', '.join(FAMILIES)}, got {family!r}")
    return _ARGS[family](**fields)


def active_params(args) -> int:
    """Parameters one token uses (all of them for a dense model)."""
    fn = getattr(args, "active_params", None)
    return fn() if fn is not None else args.num_params()


def build_model(args, device="meta"):
    """The Transformer of any family on ``device`` (``trainer.models.blocks.build_model``)."""
    from trainer.models.blocks import build_model as _build

    return _build(args, device)
