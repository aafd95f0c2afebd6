"""Hugging Face Llama 4 text models (``Llama4ForCausalLM``, model_type ``llama4_text``) <-> our Llama 4.

The fields are those of transformers' ``Llama4TextConfig``; the layer lists (``no_rope_layers``,
``layer_types``, ``moe_layers``) are read as the file gives them and written out in full. Names (ours ->
theirs, in ``model.layers.{i}.``): attention.wq/wk/wv/wo -> self_attn.q_proj/k_proj/v_proj/o_proj;
dense feed_forward.w1/w3/w2 -> feed_forward.gate_proj/up_proj/down_proj; in MoE layers
feed_forward.router.gate -> feed_forward.router, feed_forward.shared_experts.w1/w3/w2 ->
feed_forward.shared_expert.gate_proj/up_proj/down_proj, and the experts stored fused as transformers
keeps and saves them, (in, out) like ours:
  feed_forward.experts.w1 / w3 (E, dim, hidden)  feed_forward.experts.gate_up_proj (E, dim, 2 hidden):
                                                 gate in the first half of the columns, up in the second
  feed_forward.experts.w2 (E, hidden, dim)       feed_forward.experts.down_proj (E, hidden, dim)
Llama 4 rotates interleaved pairs (a complex view), as we do: no row permutation. Hugging Face has no
load-balancing bias (an export of a model trained with one warns, ``HFAdapter.export_warning``).

Refused in one line naming the field: a multimodal config (model_type ``llama4``, its vision tower),
quantization, biases, another activation, rope scaling other than Llama 3's, layer_types other than
chunked / full attention, chunked layers without a chunk size.
"""
from __future__ import annotations

import re

import torch

from trainer.hf.adapter import DECODER_KEYS, HFAdapter, fuse_gate_up, split_gate_up
from trainer.hf.common import DTYPE_NAMES, HFCheckpointError, _int_fields, _rope_from_config, config_errors
from trainer.hf.common import decoder_fields, refuse_activation_and_quantization, rope_to_config
from trainer.hf.compare import matching_flavor
from trainer.models.llama4.args import LLAMA4_FLAVORS, Llama4Args
from trainer.models.common.moe_args import MoEArgs

_FFN = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
KEY_MAP: dict[str, str] = {
    **DECODER_KEYS,
    **{f"layers.{{}}.attention.{k}.weight": f"model.layers.{{}}.self_attn.{v}.weight"
       for k, v in {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}.items()},
    **{f"layers.{{}}.feed_forward.{k}.weight": f"model.layers.{{}}.feed_forward.{v}.weight" for k, v in _FFN.items()},
    **{f"layers.{{}}.feed_forward.shared_experts.{k}.weight": f"model.layers.{{}}.feed_forward.shared_expert.{v}.weight"
       for k, v in _FFN.items()},
    "layers.{}.feed_forward.router.gate.weight": "model.layers.{}.feed_forward.router.weight",
}
_OURS_EXPERT = re.compile(r"^layers\.(\d+)\.feed_forward\.experts\.(w[123])$")
_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.feed_forward\.experts\.(gate_up_proj|down_proj)$")
_LAYER_TYPES = ("chunked_attention", "full_attention")


class Llama4Adapter(HFAdapter):
    title = "Llama 4"
    model_types = ("llama4_text", "llama4")
    key_map = KEY_MAP

    # -- the fused experts --

    def hf_names(self, args, key: str, fused: bool = False) -> list[str]:
        m = _OURS_EXPERT.match(key)
        if m:
            which = "down_proj" if m.group(2) == "w2" else "gate_up_proj"
            return [f"model.layers.{m.group(1)}.feed_forward.experts.{which}"]
        return super().hf_names(args, key, fused)

    def hf_shape(self, key: str, want: tuple[int, ...], name: str) -> tuple[int, ...]:
        if name.endswith("gate_up_proj"):
            return (*want[:-1], 2 * want[-1])  # gate and up side by side in the last dim
        return want

    def export_group(self, key: str) -> tuple[str, ...]:
        """w1 and w3 of a layer make one gate_up_proj: they convert together."""
        m = _OURS_EXPERT.match(key)
        if m and m.group(2) in ("w1", "w3"):
            return tuple(f"layers.{m.group(1)}.feed_forward.experts.{w}" for w in ("w1", "w3"))
        return (key,)

    def to_hf(self, state_dict, args):
        """Ours -> theirs; w1 and w3 (``export_group``) must come together. Raises KeyError for a key
        with no counterpart or a half without its other."""
        out, rest = {}, {}
        for key, t in state_dict.items():
            m = _OURS_EXPERT.match(key)
            if m is None:
                rest[key] = t
            elif m.group(2) == "w2":
                out[self.hf_names(args, key)[0]] = t
            elif (fused := fuse_gate_up(state_dict, key, *self.export_group(key), interleaved=False)) is not None:
                out[self.hf_names(args, key)[0]] = fused
        out.update(super().to_hf(rest, args))
        return out

    def from_hf(self, state_dict, args):
        out, rest = {}, {}
        for key, t in state_dict.items():
            m = _HF_EXPERT.match(key)
            if m is None:
                rest[key] = t
                continue
            base = f"layers.{m.group(1)}.feed_forward"
            if t.dim() != 3:
                raise ValueError(f"{key}: expected a 3-D fused expert tensor, got shape {tuple(t.shape)}")
            if m.group(2) == "down_proj":
                out[f"{base}.experts.w2"] = t
            else:
                out[f"{base}.experts.w1"], out[f"{base}.experts.w3"] = split_gate_up(key, t, interleaved=False)
            out.setdefault(f"{base}.expert_bias", torch.zeros(t.shape[0], dtype=torch.float32))
        out.update(super().from_hf(rest, args))
        return out

    # -- config.json --

    def config(self, args: Llama4Args, dtype: torch.dtype = torch.float32) -> dict:
        """The ``config.json`` of the ``Llama4ForCausalLM`` equal to ``args``. Raises HFCheckpointError
        for what that class cannot express (weighted QK-norm, biases, sinks, sliding windows, other
        routing or experts)."""
        moe = args.moe
        bad = [what for what, ok in (
            ("a weighted QK-norm", not args.qk_norm), ("attention biases", not args.attention_bias),
            ("attention sinks", not args.attention_sinks),
            ("sliding-window layers", "sliding_attention" not in args.layer_types),
            ("dense first layers (n_dense_layers)", not args.n_dense_layers)) if not ok]
        if moe is not None:
            bad += [what for what, ok in (
                ("softmax routing", moe.score_func == "sigmoid"),
                ("weights on the expert outputs", moe.score_before_experts),
                ("normalised top-k weights", moe.top_k == 1 or not moe.route_norm),
                ("a route scale", moe.route_scale == 1.0), ("group-limited routing", moe.n_group == 1),
                ("a router bias", not moe.router_bias), ("expert biases", not moe.expert_proj_bias),
                ("a clamped SwiGLU", not moe.swiglu_limit and moe.swiglu_alpha == 1.0 and not moe.swiglu_up_offset),
                ("other than one shared expert", moe.num_shared_experts == 1)) if not ok]
        if bad:
            raise HFCheckpointError(f"cannot write a Hugging Face Llama 4 config: this model has {', '.join(bad)}")
        return {
            "architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text",
            "vocab_size": args.vocab_size, "hidden_size": args.dim, "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads, "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim,
            "intermediate_size": moe.hidden_dim if moe is not None else args.hidden_dim,
            "intermediate_size_mlp": args.hidden_dim,
            "num_local_experts": moe.num_experts if moe is not None else 1,
            "num_experts_per_tok": moe.top_k if moe is not None else 1,
            "moe_layers": list(args.moe_layers or ()), "interleave_moe_layer_step": args.interleave_moe_layer_step,
            "no_rope_layers": [int(args.uses_rope(i)) for i in range(args.n_layers)],
            "layer_types": list(args.layer_types), "attention_chunk_size": args.attention_chunk or None,
            "use_qk_norm": args.use_qk_norm, "attn_temperature_tuning": args.attn_temperature_tuning,
            "floor_scale": args.floor_scale, "attn_scale": args.attn_scale, "rms_norm_eps": args.norm_eps,
            "max_position_embeddings": args.max_seq_len, "tie_word_embeddings": args.tie_word_embeddings,
            "attention_bias": False, "hidden_act": "silu", "attention_dropout": 0.0,
            "torch_dtype": DTYPE_NAMES.get(dtype, "float32"), **rope_to_config(args.rope_theta, args.rope_scaling),
        }

    def args_from_config(self, cfg: dict, where: str) -> tuple[Llama4Args, str]:
        """Llama4Args of a Llama 4 text config (transformers' defaults for absent fields). Raises
        HFCheckpointError, naming the field, for what we cannot reproduce exactly (module docstring)."""
        if cfg.get("model_type") == "llama4" or cfg.get("vision_config") is not None:
            raise HFCheckpointError(f"{where}: vision_config: the multimodal Llama 4 (its vision tower) is not "
                                    f"supported; give the text model (model_type 'llama4_text', Llama4ForCausalLM)")
        _int_fields(cfg, ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"), "Llama 4", where)

        def get(key, default):
            value = cfg.get(key)
            return default if value is None else value

        refuse_activation_and_quantization(cfg, where)
        if cfg.get("attention_bias"):
            raise HFCheckpointError(f"{where}: attention_bias true is not supported (Llama 4 has no biases)")
        n = cfg["num_hidden_layers"]
        rope_flags = cfg.get("no_rope_layers")
        if rope_flags:
            if len(rope_flags) < n or any(f not in (0, 1) for f in rope_flags[:n]):
                raise HFCheckpointError(f"{where}: no_rope_layers: expected 0/1 for each of {n} layers, got "
                                        f"{list(rope_flags)}")
            nope = tuple(i for i in range(n) if not rope_flags[i])
        else:
            nope = None  # the default rule of no_rope_layer_interval
        chunk = get("attention_chunk_size", 0)
        types = tuple(cfg.get("layer_types") or ())
        if types and (len(types) != n or set(types) - set(_LAYER_TYPES)):
            raise HFCheckpointError(f"{where}: layer_types {list(types)} is not supported (expected "
                                    f"{' / '.join(_LAYER_TYPES)} for each of {n} layers)")
        if "chunked_attention" in types and not chunk:
            raise HFCheckpointError(f"{where}: layer_types has chunked_attention layers but attention_chunk_size is "
                                    f"{cfg.get('attention_chunk_size')!r}")
        theta, scaling = _rope_from_config(cfg, where, ("llama3",))
        moe_layers = cfg.get("moe_layers")
        step = get("interleave_moe_layer_step", 1)
        with config_errors(where):  # the args' own checks
            moe_layers = tuple(moe_layers) if moe_layers is not None else None
            has_moe = bool(moe_layers) if moe_layers is not None else step <= n
            moe = MoEArgs(num_experts=get("num_local_experts", 16), top_k=get("num_experts_per_tok", 1),
                          hidden_dim=get("intermediate_size", 8192), num_shared_experts=1, score_func="sigmoid",
                          route_norm=False, score_before_experts=True) if has_moe else None
            args = Llama4Args(
                **decoder_fields(cfg, theta, scaling, norm_eps=1e-5, max_seq_len=131072), attention_chunk=int(chunk),
                hidden_dim=get("intermediate_size_mlp", 16384), nope_layers=nope,
                nope_layer_interval=get("no_rope_layer_interval", 4), moe_layers=moe_layers if has_moe else None,
                interleave_moe_layer_step=step, use_qk_norm=bool(get("use_qk_norm", True)),
                attn_temperature_tuning=bool(get("attn_temperature_tuning", True)),
                floor_scale=get("floor_scale", 8192), attn_scale=float(get("attn_scale", 0.1)),
                layer_types=types, moe=moe)
        return args, matching_flavor(args, LLAMA4_FLAVORS)


ADAPTER = Llama4Adapter()
