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

(transformers >= 5 keeps the experts fused in memory, ``mlp.experts.gate_up_proj`` (E, 2 hidden,
dim) and ``mlp.experts.down_proj`` (E, dim, hidden); ``save_pretrained`` writes them per expert as
above, which is what we write; a folder holding the fused tensors is read too), and the rest as
Llama's map. Our rotary pairs (2i, 2i+1) of a head, Hugging Face rotates halves,
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
_HF_FUSED_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_OUR_EXPERT_RE = re.compile(r"^layers\.(\d+)\.feed_forward\.experts\.(w[123])$")
# Our expert weight -> the fused Hugging Face tensor holding it.
_FUSED_HF = {"w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"}


def hf_keys(key: str, args: Qwen3Args, fused: bool = False) -> list[str]:
    """The Hugging Face tensor names that hold our parameter or buffer ``key``: one name, E names
    for a routed expert weight (``fused``: the one fused tensor), none for ``expert_bias``.
    Raises KeyError for a key with no counterpart (e.g. shared experts)."""
    if key.endswith("feed_forward.expert_bias"):
        return []
    m = _OUR_EXPERT_RE.match(key)
    if m:
        layer, name = m.groups()
        if fused:
            return [f"model.layers.{layer}.mlp.experts.{_FUSED_HF[name]}"]
        n = args.moe.num_experts if args.moe is not None else 0
        return [f"model.layers.{layer}.mlp.experts.{e}.{_EXPERT_HF[name]}.weight" for e in range(n)]
    return [_rename(key, HF_KEY_MAP)]


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
    """Inverse of ``to_hf_state_dict``: per-expert matrices stacked into (E, in, out), or the fused
    ``gate_up_proj`` (E, 2 hidden, dim) / ``down_proj`` (E, dim, hidden) split and transposed; MoE
    layers get a zero ``expert_bias``. Raises KeyError for unknown keys, ValueError for a missing
    expert or a fused tensor of the wrong shape."""
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
        m = _HF_FUSED_RE.match(key)
        if m:
            layer = int(m.group(1))
            if t.dim() != 3:
                raise ValueError(f"{key}: expected a 3-D fused expert tensor, got shape {tuple(t.shape)}")
            base = f"layers.{layer}.feed_forward"
            if m.group(2) == "gate_up_proj":
                if t.shape[1] % 2:
                    raise ValueError(f"{key}: gate_up_proj rows {t.shape[1]} are not gate and up halves")
                gate, up = t.chunk(2, dim=1)
                out[f"{base}.experts.w1"] = gate.transpose(1, 2).contiguous()
                out[f"{base}.experts.w3"] = up.transpose(1, 2).contiguous()
            else:
                out[f"{base}.experts.w2"] = t.transpose(1, 2).contiguous()
            out.setdefault(f"{base}.expert_bias", torch.zeros(t.shape[0], dtype=torch.float32))
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
    """The Hugging Face ``config.json`` of ``args``: model_type qwen3 (``Qwen3ForCausalLM``), or
    qwen3_moe (``Qwen3MoeForCausalLM``) for a MoE model, whose first ``n_dense_layers`` are its
    ``mlp_only_layers`` (dense, ``intermediate_size``) and every later layer a MoE layer
    (``decoder_sparse_step`` 1). Written in the long-standing layout (``rope_theta`` +
    ``rope_scaling``), which transformers 4 and 5 both read.

    ``norm_topk_prob`` is our ``route_norm`` for top_k > 1; with one expert per token our router
    keeps the raw score (renormalising it would make every weight 1), which is transformers'
    ``norm_topk_prob = false``.

    Raises ValueError for what the Hugging Face Qwen3 classes cannot express: no QK-norm, shared
    experts, sigmoid scores, a route scale other than 1.
    """
    if not args.qk_norm:
        raise ValueError("hf_config: Hugging Face Qwen3 always has QK-norm; got qk_norm=False")
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM" if args.moe is not None else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if args.moe is not None else "qwen3",
        "vocab_size": args.vocab_size, "hidden_size": args.dim, "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim, "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta, "rope_scaling": None, "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_word_embeddings, "attention_bias": False, "attention_dropout": 0.0,
        "hidden_act": "silu", "use_sliding_window": False, "sliding_window": None,
        "torch_dtype": str(dtype).replace("torch.", ""),
    }
    if args.rope_scaling is not None:
        cfg["rope_scaling"] = {"rope_type": "llama3", **args.rope_scaling}
    if args.moe is not None:
        moe = args.moe
        unsupported = []
        if moe.num_shared_experts:
            unsupported.append(f"num_shared_experts={moe.num_shared_experts}")
        if moe.score_func != "softmax":
            unsupported.append(f"score_func={moe.score_func!r}")
        if moe.route_scale != 1.0:
            unsupported.append(f"route_scale={moe.route_scale}")
        if unsupported:
            raise ValueError("hf_config: Hugging Face Qwen3-MoE has softmax routing without shared experts or a route "
                             f"scale; this model has {', '.join(unsupported)}")
        cfg.update(num_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                   moe_intermediate_size=moe.hidden_dim, norm_topk_prob=bool(moe.route_norm and moe.top_k > 1),
                   decoder_sparse_step=1, mlp_only_layers=list(range(args.n_dense_layers)),
                   output_router_logits=False)
    return cfg
