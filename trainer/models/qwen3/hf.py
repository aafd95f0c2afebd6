"""Hugging Face Qwen3 and Qwen3-MoE (``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM``) <-> our Qwen3.

The fields and their defaults are those of transformers' ``Qwen3Config`` / ``Qwen3MoeConfig``. Names
(ours -> theirs) are Llama's plus:

  layers.{i}.attention.q_norm.weight       model.layers.{i}.self_attn.q_norm.weight (and k_norm)
  layers.{i}.feed_forward.router.gate      model.layers.{i}.mlp.gate.weight (E, dim)
  layers.{i}.feed_forward.experts.w1[e]    model.layers.{i}.mlp.experts.{e}.gate_proj.weight, transposed
  layers.{i}.feed_forward.experts.w3[e]    ... .up_proj.weight, transposed
  layers.{i}.feed_forward.experts.w2[e]    ... .down_proj.weight, transposed
  layers.{i}.feed_forward.expert_bias      (none: the load-balancing state; zeros when read)

The rows of wq/wk are permuted per head as for Llama, and so are the QK-norm weights (one head of
head_dim values; RMSNorm commutes with the permutation). Sliding windows: a dense config's
``use_sliding_window`` makes layers ``max_window_layers``.. sliding (or ``layer_types`` says which),
a MoE config's makes every layer sliding, each seeing ``sliding_window`` keys (its own included).
"""
from __future__ import annotations

import torch

from trainer.hf.common import HFCheckpointError, _int_fields, _rope_from_config, config_errors, rope_to_config
from trainer.hf.compare import matching_flavor
from trainer.models.llama3.hf import KEY_MAP as _LLAMA_KEYS
from trainer.models.llama3.hf import RotaryPermutingAdapter
from trainer.models.common.moe_args import MoEArgs
from trainer.models.qwen3.args import QWEN3_FLAVORS, Qwen3Args

KEY_MAP: dict[str, str] = {
    **_LLAMA_KEYS,
    "layers.{}.attention.q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",
    "layers.{}.attention.k_norm.weight": "model.layers.{}.self_attn.k_norm.weight",
    "layers.{}.feed_forward.router.gate.weight": "model.layers.{}.mlp.gate.weight",
}


class Qwen3Adapter(RotaryPermutingAdapter):
    title = "Qwen3"
    model_types = ("qwen3", "qwen3_moe")
    key_map = KEY_MAP

    def config(self, args: Qwen3Args, dtype: torch.dtype = torch.float32) -> dict:
        """The ``config.json`` of the ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` equal to ``args``:
        model_type qwen3, or qwen3_moe for a MoE model, whose first ``n_dense_layers`` are its
        ``mlp_only_layers`` and every later layer a MoE layer (``decoder_sparse_step`` 1).

        ``norm_topk_prob`` is our ``route_norm`` for top_k > 1; with one expert per token our router
        keeps the raw score (renormalising it would make every weight 1), which is transformers'
        ``norm_topk_prob = false``.

        Raises HFCheckpointError for what the Hugging Face Qwen3 classes cannot express: no QK-norm,
        shared experts, sigmoid scores, a route scale, group-limited routing, chunked attention,
        sliding layers a Qwen3 config cannot place.
        """
        def refuse(what: str):
            raise HFCheckpointError(f"cannot write a Hugging Face Qwen3 config: {what}")

        if not args.qk_norm:
            refuse("Hugging Face Qwen3 always has QK-norm; got qk_norm=False")
        cfg = {
            "architectures": ["Qwen3MoeForCausalLM" if args.moe is not None else "Qwen3ForCausalLM"],
            "model_type": "qwen3_moe" if args.moe is not None else "qwen3",
            "vocab_size": args.vocab_size, "hidden_size": args.dim, "intermediate_size": args.hidden_dim,
            "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim, "rms_norm_eps": args.norm_eps,
            "max_position_embeddings": args.max_seq_len,
            "tie_word_embeddings": args.tie_word_embeddings, "attention_bias": False, "attention_dropout": 0.0,
            "hidden_act": "silu", "use_sliding_window": False, "sliding_window": None,
            "torch_dtype": str(dtype).replace("torch.", ""),
            **rope_to_config(args.rope_theta, args.rope_scaling),
        }
        kinds = set(args.layer_types)
        if "chunked_attention" in kinds:
            refuse("chunked attention layers")
        if "sliding_attention" in kinds:
            cfg.update(use_sliding_window=True, sliding_window=args.sliding_window)
            if args.moe is not None:
                if kinds != {"sliding_attention"}:
                    refuse("Qwen3-MoE's sliding window applies to every layer; this model mixes layer types")
            else:
                cfg.update(layer_types=list(args.layer_types),
                           max_window_layers=args.layer_types.index("sliding_attention"))
        if args.moe is not None:
            moe = args.moe
            unsupported = []
            if moe.num_shared_experts:
                unsupported.append(f"num_shared_experts={moe.num_shared_experts}")
            if moe.score_func != "softmax":
                unsupported.append(f"score_func={moe.score_func!r}")
            if moe.route_scale != 1.0:
                unsupported.append(f"route_scale={moe.route_scale}")
            if moe.n_group != 1:
                unsupported.append(f"n_group={moe.n_group}")
            if unsupported:
                refuse("Hugging Face Qwen3-MoE has softmax routing without shared experts, groups or a route "
                       f"scale; this model has {', '.join(unsupported)}")
            cfg.update(num_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                       moe_intermediate_size=moe.hidden_dim, norm_topk_prob=bool(moe.route_norm and moe.top_k > 1),
                       decoder_sparse_step=1, mlp_only_layers=list(range(args.n_dense_layers)),
                       output_router_logits=False)
        return cfg

    def args_from_config(self, cfg: dict, where: str) -> tuple[Qwen3Args, str]:
        """Qwen3Args of a Qwen3 or Qwen3-MoE config (the fields as transformers reads them, with its
        defaults: head_dim 128 for qwen3 and hidden_size / num_attention_heads for qwen3_moe when
        absent, norm_topk_prob false, decoder_sparse_step 1, no mlp_only_layers).

        Raises HFCheckpointError for what our model does not have: biases, another activation, rope
        scaling other than none, 'llama3' or 'yarn', layer types other than full and sliding, and for
        Qwen3-MoE: no experts, decoder_sparse_step != 1, mlp_only_layers that are not the first k
        layers, shared experts, or num_experts_per_tok 1 with norm_topk_prob (transformers then
        weighs every token's expert by 1).
        """
        moe_type = cfg.get("model_type") == "qwen3_moe"
        what = "Qwen3-MoE" if moe_type else "Qwen3"
        _int_fields(cfg, ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                          "vocab_size"), what, where)
        if cfg.get("hidden_act", "silu") != "silu":
            raise HFCheckpointError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported (expected 'silu')")
        if cfg.get("attention_bias"):
            raise HFCheckpointError(f"{where}: attention_bias=true is not supported (our Qwen3 has no biases)")
        dim, heads, n_layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
        head_dim = cfg.get("head_dim") or (dim // heads if moe_type else 128)
        theta, scaling = _rope_from_config(cfg, where, ("llama3", "yarn"))
        layer_types, window = self._windows(cfg, n_layers, moe_type, where)
        moe, n_dense = None, 0
        if moe_type:
            moe, n_dense = self._moe(cfg, where)
        with config_errors(where):  # Qwen3Args' own checks (heads, head_dim, layers)
            args = Qwen3Args(
                dim=dim, n_layers=n_layers, n_heads=heads, n_kv_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=head_dim, hidden_dim=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
                norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
                max_seq_len=int(cfg.get("max_position_embeddings") or 4096),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), moe=moe, n_dense_layers=n_dense,
                layer_types=layer_types, sliding_window=window)
        return args, matching_flavor(args, QWEN3_FLAVORS)

    @staticmethod
    def _windows(cfg: dict, n_layers: int, moe_type: bool, where: str) -> tuple[tuple[str, ...], int]:
        """(layer_types, sliding_window) as transformers derives them (module docstring)."""
        if not cfg.get("use_sliding_window"):
            types = cfg.get("layer_types") or []
            if any(t != "full_attention" for t in types):
                raise HFCheckpointError(f"{where}: layer_types {sorted(set(types))} without use_sliding_window: "
                                        f"transformers would run them as full attention; not supported")
            return (), 0
        window = cfg.get("sliding_window")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise HFCheckpointError(f"{where}: use_sliding_window needs an integer sliding_window >= 1, got {window!r}")
        if moe_type:
            return ("sliding_attention",) * n_layers, window
        types = cfg.get("layer_types")
        if types is None:
            first = cfg.get("max_window_layers", 28)
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
        bad = sorted(set(types) - {"full_attention", "sliding_attention"})
        if bad or len(types) != n_layers:
            raise HFCheckpointError(f"{where}: layer_types must list full_attention / sliding_attention for each of "
                                    f"{n_layers} layers, got {types!r}")
        if "sliding_attention" not in types:
            return (), 0
        return tuple(types), window

    @staticmethod
    def _moe(cfg: dict, where: str) -> tuple[MoEArgs, int]:
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
        with config_errors(where):
            moe = MoEArgs(num_experts=n_exp, top_k=top_k, hidden_dim=hidden, score_func="softmax", route_norm=norm)
        return moe, len(only)


ADAPTER = Qwen3Adapter()
