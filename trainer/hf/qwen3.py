"""Hugging Face Qwen3 and Qwen3-MoE (``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM``) config.json <->
our ``Qwen3Args``, and the shapes of the Hugging Face expert tensors.

The fields and their defaults are those of transformers' ``Qwen3Config`` / ``Qwen3MoeConfig``; the
state-dict names, the rotary row (and QK-norm) permutation and the expert layout (ours stacked
(E, in, out), Hugging Face's per-expert (out, in) matrices, or transformers >= 5's fused
``gate_up_proj`` / ``down_proj``) are ``trainer.models.qwen3``'s.
"""
from __future__ import annotations

import torch

from trainer.hf.common import HFCheckpointError, _int_fields, _rope_from_config
from trainer.hf.compare import differences
from trainer.models import qwen3 as _qwen3
from trainer.models.qwen3_args import QWEN3_FLAVORS, MoEArgs, Qwen3Args


def hf_config(args: Qwen3Args, dtype: torch.dtype = torch.float32) -> dict:
    """The ``config.json`` of the ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` equal to ``args``
    (``trainer.models.qwen3.hf_config``). Raises HFCheckpointError for a model the Hugging Face
    classes cannot express (a Qwen3-MoE with shared experts, sigmoid routing or a route scale; no
    QK-norm)."""
    try:
        return _qwen3.hf_config(args, dtype)
    except ValueError as exc:
        raise HFCheckpointError(f"cannot write a Hugging Face Qwen3 config: {exc}") from None


def args_from_config(cfg: dict, where: str) -> tuple[Qwen3Args, str]:
    """Qwen3Args of a Qwen3 or Qwen3-MoE config (the fields as transformers reads them, with its
    defaults: head_dim 128 for qwen3 and hidden_size / num_attention_heads for qwen3_moe when absent,
    norm_topk_prob false, decoder_sparse_step 1, no mlp_only_layers).

    Raises HFCheckpointError for what our model does not have: biases, another activation, sliding-
    window attention, rope scaling other than none or 'llama3', and for Qwen3-MoE: no experts,
    decoder_sparse_step != 1, mlp_only_layers that are not the first k layers, shared experts, or
    num_experts_per_tok 1 with norm_topk_prob (transformers then weighs every token's expert by 1).
    """
    moe_type = cfg.get("model_type") == "qwen3_moe"
    what = "Qwen3-MoE" if moe_type else "Qwen3"
    _int_fields(cfg, ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"),
                what, where)
    if cfg.get("hidden_act", "silu") != "silu":
        raise HFCheckpointError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported (expected 'silu')")
    if cfg.get("attention_bias"):
        raise HFCheckpointError(f"{where}: attention_bias=true is not supported (our Qwen3 has no biases)")
    layer_types = cfg.get("layer_types") or []
    if cfg.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
        raise HFCheckpointError(f"{where}: sliding-window attention (use_sliding_window / layer_types) is not "
                                f"supported (our attention is full causal)")
    dim, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or (dim // heads if moe_type else 128)
    theta, scaling = _rope_from_config(cfg, where)
    moe, n_dense = None, 0
    if moe_type:
        n_exp = cfg.get("num_experts", cfg.get("num_local_experts", 128))
        top_k, hidden = cfg.get("num_experts_per_tok", 8), cfg.get("moe_intermediate_size", 768)
        bad = [f"{k} {v!r}" for k, v in (("num_experts", n_exp), ("num_experts_per_tok", top_k),
                                         ("moe_intermediate_size", hidden))
               if isinstance(v, bool) or not isinstance(v, int) or v < 1]
        if bad:
            raise HFCheckpointError(f"{where}: expected integers >= 1, got {', '.join(bad)}")
        step = cfg.get("decoder_sparse_step", 1)
        if step != 1:
            raise HFCheckpointError(f"{where}: decoder_sparse_step {step} is not supported (expected 1: every layer "
                                    f"after the mlp_only_layers is a MoE layer)")
        only = sorted(cfg.get("mlp_only_layers") or [])
        if only != list(range(len(only))):
            raise HFCheckpointError(f"{where}: mlp_only_layers {only} is not supported (only the first k layers "
                                    f"may be dense: [0, ..., k-1])")
        if cfg.get("shared_expert_intermediate_size"):
            raise HFCheckpointError(f"{where}: shared experts (shared_expert_intermediate_size) are not part of "
                                    f"Hugging Face Qwen3-MoE; not supported")
        norm = bool(cfg.get("norm_topk_prob", False))
        if norm and top_k == 1:
            raise HFCheckpointError(f"{where}: num_experts_per_tok 1 with norm_topk_prob true is not supported (every "
                                    f"routing weight would be 1; our router keeps the score)")
        try:
            moe = MoEArgs(num_experts=n_exp, top_k=top_k, hidden_dim=hidden, score_func="softmax", route_norm=norm)
        except ValueError as exc:
            raise HFCheckpointError(f"{where}: {exc}") from None
        n_dense = len(only)
    try:
        args = Qwen3Args(
            dim=dim, n_layers=cfg["num_hidden_layers"], n_heads=heads,
            n_kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=head_dim,
            hidden_dim=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
            max_seq_len=int(cfg.get("max_position_embeddings") or 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), moe=moe, n_dense_layers=n_dense)
    except ValueError as exc:  # Qwen3Args' own checks (heads, head_dim, layers)
        raise HFCheckpointError(f"{where}: {exc}") from None
    for name, flavor in QWEN3_FLAVORS.items():
        if not differences(args, flavor):
            return args, name
    return args, "custom"


def is_expert(key: str) -> bool:
    """Whether our parameter ``key`` is a MoE layer's stacked expert weight (E, in, out)."""
    return key.endswith(("feed_forward.experts.w1", "feed_forward.experts.w2", "feed_forward.experts.w3"))


def expert_hf_shape(want: tuple[int, ...], name: str) -> tuple[int, ...]:
    """The shape of the Hugging Face tensor ``name`` holding (part of) our expert weight of shape
    ``want`` (E, in, out): fused ``gate_up_proj`` (E, 2 out, in), fused ``down_proj`` (E, out, in),
    else one expert's (out, in)."""
    e, a, b = want  # ours (E, in, out)
    if name.endswith("gate_up_proj"):
        return (e, 2 * b, a)
    if name.endswith("experts.down_proj"):
        return (e, b, a)
    return (b, a)  # one expert's (out, in)
