"""Hugging Face GPT-OSS (``GptOssForCausalLM``, its bfloat16 layout) <-> our GPT-OSS.

The fields are those of transformers' ``GptOssConfig``. Names (ours -> theirs, in ``model.layers.{i}.``):
attention.wq/wk/wv/wo .weight/.bias -> self_attn.q_proj/k_proj/v_proj/o_proj; attention.sinks ->
self_attn.sinks; feed_forward.router.gate -> mlp.router; the experts, stored fused as transformers
keeps them, (in, out) like ours:
  feed_forward.experts.w1 / w3 (E, dim, hidden)     mlp.experts.gate_up_proj (E, dim, 2 hidden): gate in
                                                    the even columns, up in the odd ones
  feed_forward.experts.w1_bias / w3_bias (E, hidden) mlp.experts.gate_up_proj_bias (E, 2 hidden), alike
  feed_forward.experts.w2 (E, hidden, dim), w2_bias  mlp.experts.down_proj, down_proj_bias
GPT-OSS rotates halves: the rows of wq/wk and their biases are permuted per head to our interleaved
pairs. The MXFP4 checkpoints OpenAI published (``*_blocks`` / ``*_scales`` tensors) are refused in one
line: dequantize them to bfloat16 first (transformers' ``Mxfp4Config(dequantize=True)``).
"""
from __future__ import annotations

import re

import torch

from trainer.hf.adapter import DECODER_KEYS, fuse_gate_up, split_gate_up
from trainer.hf.common import DTYPE_NAMES, HFCheckpointError, _int_fields, _rope_from_config, config_errors
from trainer.hf.common import decoder_fields, refuse_activation_and_quantization, rope_to_config
from trainer.hf.compare import matching_flavor
from trainer.models.gpt_oss.args import GPT_OSS_FLAVORS, GptOssArgs
from trainer.models.llama3.hf import RotaryPermutingAdapter
from trainer.models.common.moe_args import MoEArgs

_ATTN = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}
KEY_MAP: dict[str, str] = {
    **DECODER_KEYS,
    **{f"layers.{{}}.attention.{k}.{t}": f"model.layers.{{}}.self_attn.{v}.{t}"
       for k, v in _ATTN.items() for t in ("weight", "bias")},
    "layers.{}.attention.sinks": "model.layers.{}.self_attn.sinks",
    "layers.{}.feed_forward.router.gate.weight": "model.layers.{}.mlp.router.weight",
    "layers.{}.feed_forward.router.gate.bias": "model.layers.{}.mlp.router.bias",
}
_OURS_EXPERT = re.compile(r"^layers\.(\d+)\.feed_forward\.experts\.(w[123])(_bias)?$")
_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")


class GptOssAdapter(RotaryPermutingAdapter):
    title = "GPT-OSS"
    model_types = ("gpt_oss",)
    key_map = KEY_MAP

    # -- the fused experts --

    def hf_names(self, args, key: str, fused: bool = False) -> list[str]:
        if key.endswith("feed_forward.expert_bias"):
            return []  # the load-balancing state: Hugging Face's router has its own learned bias instead
        m = _OURS_EXPERT.match(key)
        if m:
            layer, w, bias = m.group(1), m.group(2), m.group(3) or ""
            return [f"model.layers.{layer}.mlp.experts.{'down_proj' if w == 'w2' else 'gate_up_proj'}{bias}"]
        return super().hf_names(args, key, fused)

    def hf_shape(self, key: str, want: tuple[int, ...], name: str) -> tuple[int, ...]:
        if name.endswith(("gate_up_proj", "gate_up_proj_bias")):
            return (*want[:-1], 2 * want[-1])  # gate and up interleaved in the last dim
        return want

    def export_group(self, key: str) -> tuple[str, ...]:
        """Our keys converted together: w1 and w3 (and their biases) make one gate_up tensor."""
        m = _OURS_EXPERT.match(key)
        if m and m.group(2) in ("w1", "w3"):
            bias = m.group(3) or ""
            return tuple(f"layers.{m.group(1)}.feed_forward.experts.{w}{bias}" for w in ("w1", "w3"))
        return (key,)

    def to_hf(self, state_dict, args):
        """Ours -> theirs; w1 and w3 (``export_group``) must come together. Raises KeyError for a key
        with no counterpart or a half without its other."""
        out = {}
        for key, t in state_dict.items():
            m = _OURS_EXPERT.match(key)
            if key.endswith("feed_forward.expert_bias"):
                continue
            if m is None:
                out.update(super().to_hf({key: t}, args))
            elif m.group(2) == "w2":
                out[self.hf_names(args, key)[0]] = t
            elif (fused := fuse_gate_up(state_dict, key, *self.export_group(key), interleaved=True)) is not None:
                out[self.hf_names(args, key)[0]] = fused
        return out

    def from_hf(self, state_dict, args):
        out, rest = {}, {}
        for key, t in state_dict.items():
            m = _HF_EXPERT.match(key)
            if m:
                layer, which, bias = m.group(1), m.group(2), m.group(3) or ""
                base = f"layers.{layer}.feed_forward.experts"
                if which == "down_proj":
                    out[f"{base}.w2{bias}"] = t
                else:
                    out[f"{base}.w1{bias}"], out[f"{base}.w3{bias}"] = split_gate_up(key, t, interleaved=True)
                out.setdefault(f"layers.{layer}.feed_forward.expert_bias",
                               torch.zeros(t.shape[0], dtype=torch.float32))
            else:
                rest[key] = t
        out.update(super().from_hf(rest, args))
        return out

    # -- config.json --

    def config(self, args: GptOssArgs, dtype: torch.dtype = torch.float32) -> dict:
        """The ``config.json`` of the ``GptOssForCausalLM`` equal to ``args``. Raises HFCheckpointError for
        what that class cannot express (chunked layers, shared experts, sigmoid or group routing)."""
        moe = args.moe
        bad = [what for what, ok in (
            ("chunked attention layers", "chunked_attention" not in args.layer_types),
            ("shared experts", not moe.num_shared_experts), ("sigmoid routing", moe.score_func == "softmax"),
            ("group-limited routing", moe.n_group == 1), ("a route scale", moe.route_scale == 1.0),
            ("dense layers", not args.n_dense_layers), ("QK-norm", not args.qk_norm),
            ("an unclamped SwiGLU (swiglu_limit none)", moe.swiglu_limit is not None)) if not ok]
        if bad:
            raise HFCheckpointError(f"cannot write a Hugging Face GPT-OSS config: this model has {', '.join(bad)}")
        return {
            "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
            "vocab_size": args.vocab_size, "hidden_size": args.dim, "intermediate_size": moe.hidden_dim,
            "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim, "num_local_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k, "sliding_window": args.sliding_window,
            "layer_types": list(args.layer_types), "rms_norm_eps": args.norm_eps,
            "max_position_embeddings": args.max_seq_len, "tie_word_embeddings": args.tie_word_embeddings,
            "attention_bias": args.attention_bias, "swiglu_limit": moe.swiglu_limit, "swiglu_alpha": moe.swiglu_alpha,
            "hidden_act": "silu", "attention_dropout": 0.0, "torch_dtype": DTYPE_NAMES.get(dtype, "float32"),
            # No scaling is the type "default", not null: transformers reads a null as GptOssConfig's YaRN x32.
            **rope_to_config(args.rope_theta, args.rope_scaling or {"rope_type": "default"}),
        }

    def args_from_config(self, cfg: dict, where: str) -> tuple[GptOssArgs, str]:
        """GptOssArgs of a GPT-OSS config (``cfg`` completed by ``trainer.hf.defaults.complete_config``:
        transformers' defaults for absent fields, e.g. YaRN x32 at theta 150000, window 128, alpha 1.702,
        limit 7; alternating layer types from sliding). Every field means what it means to transformers
        (``swiglu_limit: 0`` clamps at 0). Raises HFCheckpointError, naming the field, for what we cannot
        reproduce (another activation, no attention bias, MXFP4 quantization, layer types other than
        sliding / full) and for values whose meaning differs between GPT-OSS's reference and
        transformers (``_refuse_reference_differences``)."""
        _int_fields(cfg, ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"), "GPT-OSS", where)

        def get(key, default):
            value = cfg.get(key)
            return default if value is None else value

        refuse_activation_and_quantization(
            cfg, where, "dequantize to bfloat16 first (transformers' Mxfp4Config(dequantize=True))")
        if not get("attention_bias", True):
            raise HFCheckpointError(f"{where}: attention_bias false is not supported (GPT-OSS has q/k/v/o biases)")
        n_layers = cfg["num_hidden_layers"]
        types = tuple(get("layer_types", ()))
        bad = sorted(set(types) - {"sliding_attention", "full_attention"})
        if bad or (types and len(types) != n_layers):
            raise HFCheckpointError(f"{where}: layer_types {list(types)} is not supported (expected sliding_attention / "
                                    f"full_attention for each of {n_layers} layers)")
        _refuse_reference_differences(cfg, types, where)
        theta, scaling = _rope_from_config(cfg, where, ("yarn",))
        hidden = get("intermediate_size", 2880)
        with config_errors(where):  # the args' own checks
            moe = MoEArgs(num_experts=get("num_local_experts", get("num_experts", 128)),
                          top_k=get("num_experts_per_tok", 4), hidden_dim=hidden, score_func="softmax",
                          route_norm=True, router_bias=True, expert_proj_bias=True,
                          swiglu_alpha=float(get("swiglu_alpha", 1.702)), swiglu_limit=float(get("swiglu_limit", 7.0)),
                          swiglu_up_offset=1.0)
            args = GptOssArgs(**decoder_fields(cfg, theta, scaling, norm_eps=1e-5, max_seq_len=131072),
                              sliding_window=get("sliding_window", 128), layer_types=types, moe=moe)
        return args, matching_flavor(args, GPT_OSS_FLAVORS)


def _refuse_reference_differences(cfg: dict, types: tuple[str, ...], where: str) -> None:
    """Refuse, naming the field, a GPT-OSS config.json value that OpenAI's reference implementation
    (gpt_oss/torch/model.py) and transformers' ``GptOssForCausalLM`` would run differently:

    - ``swiglu_limit`` < 0 or not finite: clamp(up, -limit, limit) is an empty range (torch.clamp then
      gives every value the bound), a clamp neither defines;
    - ``sliding_window`` 0 or null on sliding layers: the reference reads 0 as "no window" (full
      attention), transformers as a window of no key;
    - YaRN without ``truncate``: transformers rounds the ramp's bounds unless told ``truncate: false``;
      the reference never rounds them (the published configs say false)."""
    limit = cfg.get("swiglu_limit")
    if limit is None or not 0 <= float(limit) < float("inf"):
        raise HFCheckpointError(f"{where}: swiglu_limit {limit!r} is not supported (expected a finite value >= 0: "
                                f"the clamp of the experts' SwiGLU; a negative one is an empty clamp range)")
    sliding = not types or "sliding_attention" in types
    window = cfg.get("sliding_window")
    if sliding and (window is None or window < 1):
        raise HFCheckpointError(f"{where}: sliding_window {window!r} is not supported on sliding_attention layers "
                                f"(expected an integer >= 1: GPT-OSS's reference reads 0 as no window, transformers as "
                                f"a window of no key)")
    params = cfg.get("rope_parameters") or {}
    if params.get("rope_type", params.get("type")) == "yarn" and "truncate" not in params:
        raise HFCheckpointError(f"{where}: rope_scaling 'yarn' without truncate is not supported (transformers "
                                f"rounds the YaRN ramp's bounds unless truncate is false, GPT-OSS's reference never "
                                f"does; say truncate: false as the published configs do, or true)")


ADAPTER = GptOssAdapter()
