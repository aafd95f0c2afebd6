"""Hugging Face Llama 3 (``LlamaForCausalLM``) <-> our Llama 3: config.json, names and the rotary layout.

The fields are those of transformers' ``LlamaConfig``; the FFN width follows Meta's rule
(``Llama3Args.ffn_hidden_dim``). Our rotary pairs (2i, 2i+1) of a head, Hugging Face rotates halves,
so the rows of wq/wk are permuted per head (``trainer.hf.adapter.interleaved_to_half``).
"""
from __future__ import annotations

import torch

from trainer.hf.adapter import DECODER_KEYS, HFAdapter, half_to_interleaved, interleaved_to_half
from trainer.hf.common import DTYPE_NAMES, HFCheckpointError, _int_fields, _rope_from_config, config_errors
from trainer.hf.common import rope_to_config
from trainer.hf.compare import differences
from trainer.models.llama3.args import LLAMA3_FLAVORS, Llama3Args

# ours (layer index as {}) -> Hugging Face LlamaForCausalLM
KEY_MAP: dict[str, str] = {
    **DECODER_KEYS,
    "layers.{}.attention.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
    "layers.{}.attention.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
    "layers.{}.attention.wo.weight": "model.layers.{}.self_attn.o_proj.weight",
    "layers.{}.feed_forward.w1.weight": "model.layers.{}.mlp.gate_proj.weight",
    "layers.{}.feed_forward.w2.weight": "model.layers.{}.mlp.down_proj.weight",
    "layers.{}.feed_forward.w3.weight": "model.layers.{}.mlp.up_proj.weight",
}


class RotaryPermutingAdapter(HFAdapter):
    """An adapter whose wq/wk rows (and QK-norm weights) go from our interleaved rotary layout to
    Hugging Face's halves and back (the decoder families: Llama 3, Qwen3)."""

    def _heads(self, key: str, args) -> int | None:
        if key.endswith(("attention.wq.weight", "attention.wq.bias")):
            return args.n_heads
        if key.endswith(("attention.wk.weight", "attention.wk.bias")):
            return args.kv_heads
        if key.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
            return 1  # one head of head_dim values (RMSNorm commutes with the permutation)
        return None

    def tensor_to_hf(self, key, t, args):
        heads = self._heads(key, args)
        return t if heads is None else interleaved_to_half(t, heads)

    def tensor_from_hf(self, key, t, args):
        heads = self._heads(key, args)
        return t if heads is None else half_to_interleaved(t, heads)


class LlamaAdapter(RotaryPermutingAdapter):
    title = "Llama"
    model_types = ("llama",)
    key_map = KEY_MAP

    def config(self, args: Llama3Args, dtype: torch.dtype = torch.float32) -> dict:
        """The ``config.json`` of the ``LlamaForCausalLM`` equal to ``args``, in the long-standing layout
        (``rope_theta`` + ``rope_scaling``), which every transformers version reads.
        ``max_position_embeddings`` is the published 131072 for rope-scaled (Llama 3.1/3.2) models; it
        does not change the math (``original_max_position_embeddings`` does)."""
        cfg = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": args.dim, "intermediate_size": args.ffn_hidden_dim,
            "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim, "vocab_size": args.vocab_size,
            "hidden_act": "silu", "rms_norm_eps": args.norm_eps, "max_position_embeddings": args.max_seq_len,
            "tie_word_embeddings": args.tie_word_embeddings, "attention_bias": False, "mlp_bias": False,
            "torch_dtype": DTYPE_NAMES.get(dtype, "float32"),
            **rope_to_config(args.rope_theta, args.rope_scaling),
        }
        if args.rope_scaling is not None:
            cfg["max_position_embeddings"] = max(args.max_seq_len, 131072)
        return cfg

    def args_from_config(self, cfg: dict, where: str) -> tuple[Llama3Args, str]:
        """Llama3Args of a Llama config. The FFN width is reproduced exactly: by a flavor's
        ``multiple_of``/``ffn_dim_multiplier`` when the shapes are a flavor's, else by
        ``multiple_of = intermediate_size``. Raises HFCheckpointError for options our model does not
        have (biases, another activation, other rope scaling)."""
        need = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        _int_fields(cfg, need, "Llama", where)
        if cfg.get("hidden_act", "silu") != "silu":
            raise HFCheckpointError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported (expected 'silu')")
        for bias in ("attention_bias", "mlp_bias"):
            if cfg.get(bias):
                raise HFCheckpointError(f"{where}: {bias}=true is not supported (our Llama has no biases)")
        dim, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        theta, scaling = _rope_from_config(cfg, where, ("llama3",))
        hidden = cfg["intermediate_size"]
        common = dict(dim=dim, n_layers=cfg["num_hidden_layers"], n_heads=heads,
                      n_kv_heads=cfg.get("num_key_value_heads") or heads, vocab_size=cfg["vocab_size"],
                      head_dim=cfg.get("head_dim") or None,
                      norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
                      max_seq_len=int(cfg.get("max_position_embeddings") or 8192),
                      tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)))
        with config_errors(where):  # Llama3Args' own checks (e.g. heads not dividing dim)
            for name, flavor in LLAMA3_FLAVORS.items():
                # The flavor's multiple_of / ffn_dim_multiplier with the config's sizes: a match gives
                # the flavor's own arguments.
                cand = flavor.replace(**common)
                if cand.ffn_hidden_dim == hidden and not differences(cand, flavor, ignore_vocab=True):
                    return cand, name
            base = int(2 * (4 * dim) / 3)
            args = Llama3Args(multiple_of=hidden, ffn_dim_multiplier=hidden / base, **common)
        if args.ffn_hidden_dim != hidden:  # cannot happen for hidden >= 1; a guard on the arithmetic
            raise HFCheckpointError(f"{where}: cannot express intermediate_size {hidden} for hidden_size {dim}")
        return args, "custom"


ADAPTER = LlamaAdapter()
