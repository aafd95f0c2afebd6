"""Hugging Face Llama 3 (``LlamaForCausalLM``) config.json <-> our ``ModelArgs``.

The fields are those of transformers' ``LlamaConfig``; the FFN width follows Meta's rule
(``trainer.models.llama_args``: 2/3 of 4 dim, times ffn_dim_multiplier, rounded up to multiple_of).
The state-dict names and the rotary row permutation are ``trainer.models.llama``'s
(``hf_key``, ``to_hf_state_dict``, ``from_hf_state_dict``).
"""
from __future__ import annotations

import torch

from trainer.hf.common import HFCheckpointError, _int_fields, _rope_from_config
from trainer.hf.compare import differences
from trainer.models.llama import LLAMA3_FLAVORS, ModelArgs

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hf_config(args: ModelArgs, dtype: torch.dtype = torch.float32) -> dict:
    """The ``config.json`` of the ``LlamaForCausalLM`` equal to ``args`` (``trainer.hf.hf_config``).

    Written in the long-standing layout (``rope_theta`` + ``rope_scaling``), which every
    transformers version reads. ``max_position_embeddings`` is the published 131072 for rope-scaled
    (Llama 3.1/3.2) models; it does not change the math (``original_max_position_embeddings`` does).
    """
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": _DTYPE_NAMES.get(dtype, "float32"),
    }
    if args.rope_scaling is not None:
        cfg["rope_scaling"] = {"rope_type": "llama3", **args.rope_scaling}
        cfg["max_position_embeddings"] = max(args.max_seq_len, 131072)
    return cfg


def args_from_config(cfg: dict, where: str) -> tuple[ModelArgs, str]:
    """ModelArgs of a Llama config. The FFN width is reproduced exactly: by a flavor's
    ``multiple_of``/``ffn_dim_multiplier`` when the shapes are a flavor's, else by
    ``multiple_of = intermediate_size``. Raises HFCheckpointError for options our model does not
    have (biases, another activation, a head_dim other than hidden_size / num_attention_heads,
    other rope scaling)."""
    need = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    _int_fields(cfg, need, "Llama", where)
    if cfg.get("hidden_act", "silu") != "silu":
        raise HFCheckpointError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported (expected 'silu')")
    for bias in ("attention_bias", "mlp_bias"):
        if cfg.get(bias):
            raise HFCheckpointError(f"{where}: {bias}=true is not supported (our Llama has no biases)")
    dim, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim")
    if head_dim is not None and heads and head_dim * heads != dim:
        raise HFCheckpointError(
            f"{where}: head_dim {head_dim} x num_attention_heads {heads} != hidden_size {dim} (not supported)")
    theta, scaling = _rope_from_config(cfg, where)
    hidden = cfg["intermediate_size"]
    common = dict(dim=dim, n_layers=cfg["num_hidden_layers"], n_heads=heads,
                  n_kv_heads=cfg.get("num_key_value_heads") or heads, vocab_size=cfg["vocab_size"],
                  norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
                  max_seq_len=int(cfg.get("max_position_embeddings") or 8192),
                  tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)))
    try:
        for name, flavor in LLAMA3_FLAVORS.items():
            # The flavor's multiple_of / ffn_dim_multiplier with the config's sizes: a match gives
            # the flavor's own arguments.
            cand = flavor.replace(**common)
            if cand.ffn_hidden_dim == hidden and not differences(cand, flavor, ignore_vocab=True):
                return cand, name
        base = int(2 * (4 * dim) / 3)
        args = ModelArgs(multiple_of=hidden, ffn_dim_multiplier=hidden / base, **common)
    except ValueError as exc:  # ModelArgs' own checks (e.g. heads not dividing dim)
        raise HFCheckpointError(f"{where}: {exc}") from None
    if args.ffn_hidden_dim != hidden:  # cannot happen for hidden >= 1; kept as a guard on the arithmetic
        raise HFCheckpointError(f"{where}: cannot express intermediate_size {hidden} for hidden_size {dim}")
    return args, "custom"
