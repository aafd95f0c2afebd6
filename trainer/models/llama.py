"""Llama 3 (Grattafiori et al., "The Llama 3 Herd of Models", 2024) built from titan_kernels.

Architecture: token embedding -> n_layers x [RMSNorm -> GQA attention with rotary -> residual,
RMSNorm -> SwiGLU feed-forward -> residual] -> RMSNorm -> output projection. Rotary uses the Meta
"interleaved" layout (pairs (2i, 2i+1) of each head rotate together, as in Meta's reference code and
torchtitan) with Llama 3.1 frequency scaling; ``to_hf_state_dict`` converts to the Hugging Face
layout (rotate-half), which needs a permutation of the wq/wk rows.

Flavors (``LLAMA3_FLAVORS``) carry the published hyperparameters:
debugmodel (dim 256, 6 layers, 16 heads; vocab from the tokenizer), 1B and 3B (Llama 3.2, tied
embeddings, rope factor 32), 8B, 70B and 405B (Llama 3.1, rope factor 8).

The model is built on the meta device (``build_model``), parallelized, materialized with
``to_empty`` and filled by ``Transformer.init_weights(seed)``, whose result does not depend on the
parallel layout: each parameter is drawn whole from a generator seeded by (seed, parameter name) and
each rank keeps its shard.
"""
from __future__ import annotations

import re

import torch

# Hyperparameters and flavors (torch-free, for the estimate and the planner); re-exported here.
from trainer.models.llama_args import (  # noqa: F401
    LLAMA3_FLAVORS,
    LLAMA31_ROPE_SCALING,
    LLAMA32_ROPE_SCALING,
    ModelArgs,
    model_args,
)

# The modules, shared with the other families (trainer/models/blocks.py); re-exported here.
from trainer.models.blocks import (  # noqa: E402,F401
    AddRMSNorm,
    Attention,
    FeedForward,
    Transformer,
    TransformerBlock,
    _param_seed,
    _trunc_normal_,
    build_model,
    cross_entropy_loss,
    document_cu_seqlens,
    linear_cross_entropy_loss,
)


# ------------------------------------------------------------------------------------------------
# Hugging Face Llama state dict

# ours (layer index as {}) -> Hugging Face LlamaForCausalLM
HF_KEY_MAP: dict[str, str] = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "layers.{}.attention.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
    "layers.{}.attention.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
    "layers.{}.attention.wo.weight": "model.layers.{}.self_attn.o_proj.weight",
    "layers.{}.feed_forward.w1.weight": "model.layers.{}.mlp.gate_proj.weight",
    "layers.{}.feed_forward.w2.weight": "model.layers.{}.mlp.down_proj.weight",
    "layers.{}.feed_forward.w3.weight": "model.layers.{}.mlp.up_proj.weight",
    "layers.{}.attention_norm.weight": "model.layers.{}.input_layernorm.weight",
    "layers.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_HF_INV = {v: k for k, v in HF_KEY_MAP.items()}


def _rename(key: str, table: dict[str, str]) -> str:
    m = re.search(r"\.(\d+)\.", key)
    pattern = key.replace(f".{m.group(1)}.", ".{}.", 1) if m else key
    if pattern not in table:
        raise KeyError(f"state dict key {key!r} has no Hugging Face Llama counterpart")
    return table[pattern].format(m.group(1)) if m else table[pattern]


def hf_key(key: str) -> str:
    """Our parameter name -> its Hugging Face ``LlamaForCausalLM`` name. Raises KeyError if it has none."""
    return _rename(key, HF_KEY_MAP)


def _interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of wq/wk from rotary pairs (2i, 2i+1) per head to halves (i, i + head_dim/2) per head."""
    out_dim, in_dim = w.shape
    return w.view(n_heads, out_dim // n_heads // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def _half_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    out_dim, in_dim = w.shape
    return w.view(n_heads, 2, out_dim // n_heads // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def to_hf_state_dict(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our (full, unsharded) state dict -> Hugging Face ``LlamaForCausalLM`` names and rotary layout.

    Tied models (1B/3B) get ``lm_head.weight`` = the embedding, as HF expects when it is saved.
    Raises KeyError for a key with no counterpart.
    """
    out = {}
    for key, t in state_dict.items():
        if key.endswith("attention.wq.weight"):
            t = _interleaved_to_half(t, args.n_heads)
        elif key.endswith("attention.wk.weight"):
            t = _interleaved_to_half(t, args.kv_heads)
        out[_rename(key, HF_KEY_MAP)] = t
    if args.tie_word_embeddings and "lm_head.weight" not in out and "model.embed_tokens.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def from_hf_state_dict(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Inverse of ``to_hf_state_dict`` (a tied model drops ``lm_head.weight``). Raises KeyError for unknown keys."""
    out = {}
    for key, t in state_dict.items():
        if key == "lm_head.weight" and args.tie_word_embeddings:
            continue
        if key.endswith("rotary_emb.inv_freq"):  # a buffer some HF checkpoints carry
            continue
        ours = _rename(key, _HF_INV)
        if ours.endswith("attention.wq.weight"):
            t = _half_to_interleaved(t, args.n_heads)
        elif ours.endswith("attention.wk.weight"):
            t = _half_to_interleaved(t, args.kv_heads)
        out[ours] = t
    return out
