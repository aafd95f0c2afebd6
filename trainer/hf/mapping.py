"""Our model <-> a Hugging Face model, for either family: the config.json, our parameter names and
shapes, the Hugging Face tensors holding each, and whole state dicts.

Each call dispatches on ``trainer.models.common.family_of(args)`` to the family's own mapping:
Llama 3 (``trainer.hf.llama``, ``trainer.models.llama``) or Qwen3 / Qwen3-MoE
(``trainer.hf.qwen3``, ``trainer.models.qwen3``). The shapes are those the modules of
``trainer.models.blocks.Transformer`` create; no model is built.
"""
from __future__ import annotations

import torch

from trainer.hf import llama as _llama_cfg
from trainer.hf import qwen3 as _qwen3_cfg
from trainer.hf.common import CONFIG, MODEL_TYPES, HFCheckpointError
from trainer.models import qwen3 as _qwen3
from trainer.models.common import family_of
from trainer.models.llama import from_hf_state_dict as _llama_from_hf
from trainer.models.llama import hf_key as _llama_hf_key
from trainer.models.llama import to_hf_state_dict as _llama_to_hf

# ------------------------------------------------------------------------------------------------
# config.json <-> ModelArgs


def hf_config(args, dtype: torch.dtype = torch.float32) -> dict:
    """The ``config.json`` of the Hugging Face model equal to our model ``args``: a
    ``LlamaForCausalLM`` for ModelArgs, a ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` for
    Qwen3Args (``trainer.hf.llama.hf_config``, ``trainer.hf.qwen3.hf_config``).

    Written in the long-standing layout (``rope_theta`` + ``rope_scaling``), which every
    transformers version reads. ``max_position_embeddings`` is the published 131072 for rope-scaled
    (Llama 3.1/3.2) models; it does not change the math (``original_max_position_embeddings`` does).
    Raises HFCheckpointError for a model the Hugging Face classes cannot express (a Qwen3-MoE with
    shared experts, sigmoid routing or a route scale; no QK-norm).
    """
    if family_of(args) == "qwen3":
        return _qwen3_cfg.hf_config(args, dtype)
    return _llama_cfg.hf_config(args, dtype)


def args_from_hf_config(cfg: dict, where: str = CONFIG):
    """Our model args for a Hugging Face ``config.json`` dict, and the flavor they match ("custom" if
    none): ModelArgs for model_type llama (``trainer.hf.llama``), Qwen3Args for qwen3 and qwen3_moe
    (``trainer.hf.qwen3``).

    Raises HFCheckpointError for another model_type or options our models do not have.
    """
    model_type = cfg.get("model_type")
    if model_type == "llama":
        return _llama_cfg.args_from_config(cfg, where)
    if model_type in ("qwen3", "qwen3_moe"):
        return _qwen3_cfg.args_from_config(cfg, where)
    archs = cfg.get("architectures") or []
    raise HFCheckpointError(f"{where}: not a Llama or Qwen3 checkpoint (model_type {model_type!r}, architectures "
                            f"{archs}; supported: {', '.join(MODEL_TYPES)})")


# ------------------------------------------------------------------------------------------------
# our parameter names and shapes, and their Hugging Face names


def expected_shapes(args, buffers: bool = False) -> dict[str, tuple[int, ...]]:
    """Our parameter names -> shapes for ``args`` (ModelArgs or Qwen3Args), in module order, as
    ``trainer.models.blocks.Transformer`` has them (checked against the built model in
    tests/trainer/test_hf.py). ``buffers``: also the persistent buffers (the MoE layers'
    ``feed_forward.expert_bias`` (E,)), which DCP checkpoints hold. No model is built."""
    d, hd = args.dim, args.head_dim
    q, kv = args.n_heads * hd, args.kv_heads * hd
    qk_norm = getattr(args, "qk_norm", False)
    moe_layer = getattr(args, "moe_layer", None)
    out: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (args.vocab_size, d)}
    for i in range(args.n_layers):
        p = f"layers.{i}."
        out[p + "attention_norm.weight"] = (d,)
        out.update({p + "attention.wq.weight": (q, d), p + "attention.wk.weight": (kv, d),
                    p + "attention.wv.weight": (kv, d), p + "attention.wo.weight": (d, q)})
        if qk_norm:
            out[p + "attention.q_norm.weight"] = out[p + "attention.k_norm.weight"] = (hd,)
        out[p + "ffn_norm.weight"] = (d,)
        if moe_layer is not None and moe_layer(i):
            m = args.moe
            e, h = m.num_experts, m.hidden_dim
            out[p + "feed_forward.router.gate.weight"] = (e, d)
            out.update({p + "feed_forward.experts.w1": (e, d, h), p + "feed_forward.experts.w2": (e, h, d),
                        p + "feed_forward.experts.w3": (e, d, h)})
            if m.num_shared_experts:
                hs = h * m.num_shared_experts
                out.update({p + "feed_forward.shared_experts.w1.weight": (hs, d),
                            p + "feed_forward.shared_experts.w2.weight": (d, hs),
                            p + "feed_forward.shared_experts.w3.weight": (hs, d)})
            if buffers:
                out[p + "feed_forward.expert_bias"] = (e,)
        else:
            f = args.ffn_hidden_dim
            out.update({p + "feed_forward.w1.weight": (f, d), p + "feed_forward.w2.weight": (d, f),
                        p + "feed_forward.w3.weight": (f, d)})
    out["norm.weight"] = (d,)
    if not args.tie_word_embeddings:
        out["output.weight"] = (args.vocab_size, d)
    return out


def expected_keys(args) -> list[str]:
    """Our parameter names for ``args``, in module order."""
    return list(expected_shapes(args))


def expected_shape(args, key: str) -> tuple[int, ...]:
    """The shape of our parameter (or buffer) ``key`` for ``args``. Raises KeyError for another name."""
    return expected_shapes(args, buffers=True)[key]


def hf_names(args, key: str, fused: bool = False) -> list[str]:
    """The Hugging Face tensors holding our parameter ``key``: one, or for a Qwen3-MoE expert weight
    E per-expert matrices (``fused``: transformers' one fused tensor); none for ``expert_bias``.
    Raises KeyError for a key with no counterpart."""
    if family_of(args) == "qwen3":
        return _qwen3.hf_keys(key, args, fused)
    return [_llama_hf_key(key)]


def to_hf_state_dict(state_dict: dict[str, torch.Tensor], args) -> dict[str, torch.Tensor]:
    """Our (full) state dict -> Hugging Face names and layout, for either family."""
    if family_of(args) == "qwen3":
        return _qwen3.to_hf_state_dict(state_dict, args)
    return _llama_to_hf(state_dict, args)


def from_hf_state_dict(state_dict: dict[str, torch.Tensor], args) -> dict[str, torch.Tensor]:
    """Hugging Face names and layout -> ours, for either family."""
    if family_of(args) == "qwen3":
        return _qwen3.from_hf_state_dict(state_dict, args)
    return _llama_from_hf(state_dict, args)
