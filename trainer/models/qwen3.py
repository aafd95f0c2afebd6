"""Qwen3 dense and MoE models: the shared decoder of ``trainer.models.llama`` with ``Qwen3Args``
(QK-norm, head_dim 128, rope_theta 1e6, MoE feed-forwards), plus the Hugging Face state dict.

The modules are the families' common ones: ``build_model(args)`` is ``trainer.models.blocks.build_model``
(the blocks read ``args.qk_norm``, ``args.head_dim`` and ``args.moe_layer``). Only the weight layout
of a Hugging Face checkpoint is Qwen3's own:

  ours                                     Hugging Face Qwen3ForCausalLM / Qwen3MoeForCausalLM
  layers.{i}.attention.q_norm.weight       model.layers.{i}.self_attn.q_norm.weight (and k_norm)
  layers.{i}.feed_forward.router.gate      model.layers.{i}.mlp.gate.weight (E, dim)
  layers.{i}.feed_forward.experts.w1[e]    model.layers.{i}.mlp.experts.{e}.gate_proj.weight, transposed
  layers.{i}.feed_forward.experts.w3[e]    ... .up_proj.weight, transposed
  layers.{i}.feed_forward.experts.w2[e]    ... .down_proj.weight, transposed
  layers.{i}.feed_forward.expert_bias      (none: the load-balancing state; zeros when read)

and the rest as Llama's map. Our rotary pairs (2i, 2i+1) of a head, Hugging Face rotates halves,
so the rows of wq/wk are permuted per head as for Llama, and so are the QK-norm weights (one head
of head_dim values; RMSNorm commutes with the permutation).
"""
from __future__ import annotations

import re

import torch

from trainer.models.blocks import build_model  # noqa: F401
from trainer.models.llama import HF_KEY_MAP as _LLAMA_KEYS
from trainer.models.llama import _half_to_interleaved, _interleaved_to_half
from trainer.models.qwen3_args import QWEN3_FLAVORS, MoEArgs, Qwen3Args, qwen3_model_args  # noqa: F401

HF_KEY_MAP: dict[str, str] = {
    **{k: v for k, v in _LLAMA_KEYS.items() if "feed_forward" not in k},
    "layers.{}.attention.q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",
    "layers.{}.attention.k_norm.weight": "model.layers.{}.self_attn.k_norm.weight",
    "layers.{}.feed_forward.w1.weight": "model.layers.{}.mlp.gate_proj.weight",
    "layers.{}.feed_forward.w2.weight": "model.layers.{}.mlp.down_proj.weight",
    "layers.{}.feed_forward.w3.weight": "model.layers.{}.mlp.up_proj.weight",
    "layers.{}.feed_forward.router.gate.weight": "model.layers.{}.mlp.gate.weight",
}
_HF_INV = {v: k for k, v in HF_KEY_MAP.items()}
_EXPERT_HF = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT_OURS = {v: k for k, v in _EXPERT_HF.items()}
_HF_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _rename(key: str, table: dict[str, str]) -> str:
    m = re.search(r"\.(\d+)\.", key)
    pattern = key.replace(f".{m.group(1)}.", ".{}.", 1) if m else key
    if pattern not in table:
        raise KeyError(f"state dict key {key!r} has no Hugging Face Qwen3 counterpart")
    return table[pattern].format(m.group(1)) if m else table[pattern]


def _permute_norm(w: torch.Tensor, to_half: bool) -> torch.Tensor:
    fn = _interleaved_to_half if to_half else _half_to_interleaved
    return fn(w.reshape(-1, 1), 1).reshape(-1)


def to_hf_state_dict(state_dict: dict[str, torch.Tensor], args: Qwen3Args) -> dict[str, torch.Tensor]:
    """Our (full, unsharded) state dict -> Hugging Face Qwen3 names and layout (module docstring);
    routed experts split into one (out, in) matrix per expert. Tied models get ``lm_head.weight``.
    Raises KeyError for a key with no counterpart."""
    out = {}
    for key, t in state_dict.items():
        if key.endswith("feed_forward.expert_bias"):
            continue
        m = re.match(r"^layers\.(\d+)\.feed_forward\.experts\.(w[123])$", key)
        if m:
            for e in range(t.shape[0]):
                out[f"model.layers.{m.group(1)}.mlp.experts.{e}.{_EXPERT_HF[m.group(2)]}.weight"] = t[e].t().contiguous()
            continue
        if key.endswith("attention.wq.weight"):
            t = _interleaved_to_half(t, args.n_heads)
        elif key.endswith("attention.wk.weight"):
            t = _interleaved_to_half(t, args.kv_heads)
        elif key.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
            t = _permute_norm(t, to_half=True)
        out[_rename(key, HF_KEY_MAP)] = t
    if args.tie_word_embeddings and "lm_head.weight" not in out and "model.embed_tokens.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def from_hf_state_dict(state_dict: dict[str, torch.Tensor], args: Qwen3Args) -> dict[str, torch.Tensor]:
    """Inverse of ``to_hf_state_dict``: per-expert matrices stacked into (E, in, out); MoE layers get
    a zero ``expert_bias``. Raises KeyError for unknown keys, ValueError for a missing expert."""
    out, experts = {}, {}
    for key, t in state_dict.items():
        if key == "lm_head.weight" and args.tie_word_embeddings:
            continue
        if key.endswith("rotary_emb.inv_freq"):
            continue
        m = _HF_EXPERT_RE.match(key)
        if m:
            experts.setdefault((int(m.group(1)), _EXPERT_OURS[m.group(3)]), {})[int(m.group(2))] = t
            continue
        ours = _rename(key, _HF_INV)
        if ours.endswith("attention.wq.weight"):
            t = _half_to_interleaved(t, args.n_heads)
        elif ours.endswith("attention.wk.weight"):
            t = _half_to_interleaved(t, args.kv_heads)
        elif ours.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
            t = _permute_norm(t, to_half=False)
        out[ours] = t
    for (layer, name), by_expert in sorted(experts.items()):
        n = args.moe.num_experts if args.moe is not None else len(by_expert)
        missing = sorted(set(range(n)) - set(by_expert))
        if missing:
            raise ValueError(f"layer {layer}: Hugging Face experts {missing} of {n} missing ({_EXPERT_HF[name]})")
        out[f"layers.{layer}.feed_forward.experts.{name}"] = torch.stack([by_expert[e].t() for e in range(n)])
        out.setdefault(f"layers.{layer}.feed_forward.expert_bias", torch.zeros(n, dtype=torch.float32))
    return out


def hf_config(args: Qwen3Args, dtype: torch.dtype = torch.float32) -> dict:
    """The Hugging Face ``config.json`` of ``args``: model_type qwen3, or qwen3_moe for a MoE model."""
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM" if args.moe is not None else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if args.moe is not None else "qwen3",
        "vocab_size": args.vocab_size, "hidden_size": args.dim, "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim, "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta, "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_word_embeddings, "attention_bias": False, "hidden_act": "silu",
        "torch_dtype": str(dtype).replace("torch.", ""),
    }
    if args.moe is not None:
        moe = args.moe
        if moe.score_func != "softmax" or moe.num_shared_experts or moe.route_scale != 1.0:
            raise ValueError("hf_config: Hugging Face Qwen3-MoE has softmax routing without shared experts or "
                             f"route scale; got {moe}")
        cfg.update(num_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                   moe_intermediate_size=moe.hidden_dim, norm_topk_prob=moe.route_norm, decoder_sparse_step=1,
                   mlp_only_layers=list(range(args.n_dense_layers)), output_router_logits=False)
    return cfg
