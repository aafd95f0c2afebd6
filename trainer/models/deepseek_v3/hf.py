"""Hugging Face DeepSeek-V3 (``DeepseekV3ForCausalLM``; Kimi K2's ``kimi_k2`` configs too) <-> ours.

The fields are those of transformers' ``DeepseekV3Config``. Names (ours -> theirs, in
``model.layers.{i}.``): attention.wq / wq_a / q_norm / wq_b / wkv_a / kv_norm / wkv_b / wo ->
self_attn.q_proj / q_a_proj / q_a_layernorm / q_b_proj / kv_a_proj_with_mqa / kv_a_layernorm /
kv_b_proj / o_proj; feed_forward.router.gate -> mlp.gate; feed_forward.expert_bias ->
mlp.gate.e_score_correction_bias (the auxiliary-loss-free bias is stored, float32); shared_experts
-> mlp.shared_experts; the routed experts as every MoE family's (``trainer.hf.adapter``). Rotary:
the published configs' ``rope_interleave`` true is our layout, so nothing is permuted; a config with
it false is refused.

Multi-token prediction: MTP module k is ``model.layers.{n_layers + k}`` as in DeepSeek's checkpoint
(``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and the block's own names); the shared
embedding and head are not repeated. transformers' ``DeepseekV3ForCausalLM`` does not build it (it
ignores those tensors), so an export keeps it for training and inference ignores it, and a folder
without it (one ``save_pretrained`` wrote) imports with no MTP module.
"""
from __future__ import annotations

import re

import torch

from trainer.hf.adapter import DECODER_KEYS, HFAdapter
from trainer.hf.common import DTYPE_NAMES, HFCheckpointError, _int_fields, _rope_from_config, config_errors
from trainer.hf.common import rope_to_config
from trainer.hf.compare import matching_flavor
from trainer.models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS, DeepSeekV3Args
from trainer.models.common.moe_args import MoEArgs

_ATTN = {"wq": "q_proj", "wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj",
         "wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj"}
_FFN = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
KEY_MAP: dict[str, str] = {
    **DECODER_KEYS,
    **{f"layers.{{}}.attention.{k}.weight": f"model.layers.{{}}.self_attn.{v}.weight" for k, v in _ATTN.items()},
    **{f"layers.{{}}.feed_forward.{k}.weight": f"model.layers.{{}}.mlp.{v}.weight" for k, v in _FFN.items()},
    **{f"layers.{{}}.feed_forward.shared_experts.{k}.weight": f"model.layers.{{}}.mlp.shared_experts.{v}.weight"
       for k, v in _FFN.items()},
    "layers.{}.feed_forward.router.gate.weight": "model.layers.{}.mlp.gate.weight",
    # MTP modules (ours mtp.{k}, renamed to layers.{n_layers + k} first)
    "layers.{}.enorm.weight": "model.layers.{}.enorm.weight",
    "layers.{}.hnorm.weight": "model.layers.{}.hnorm.weight",
    "layers.{}.eh_proj.weight": "model.layers.{}.eh_proj.weight",
    "layers.{}.post_norm.weight": "model.layers.{}.shared_head.norm.weight",
}
_OURS_MTP = re.compile(r"^mtp\.(\d+)\.(?:block\.)?(.*)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_MTP_OWN = ("enorm.", "hnorm.", "eh_proj.", "post_norm.")


class DeepSeekV3Adapter(HFAdapter):
    title = "DeepSeek-V3"
    model_types = ("deepseek_v3", "kimi_k2")
    key_map = KEY_MAP
    expert_bias_hf = "model.layers.{}.mlp.gate.e_score_correction_bias"

    # -- MTP modules: ours mtp.{k}[.block].X <-> layers.{n_layers + k}.X --

    @staticmethod
    def _flat_key(key: str, args) -> str:
        m = _OURS_MTP.match(key)
        return f"layers.{args.n_layers + int(m.group(1))}.{m.group(2)}" if m else key

    @staticmethod
    def _nested_key(key: str, args) -> str:
        m = re.match(r"^layers\.(\d+)\.(.*)$", key)
        if m and int(m.group(1)) >= args.n_layers:
            k, rest = int(m.group(1)) - args.n_layers, m.group(2)
            return f"mtp.{k}.{rest}" if rest.startswith(_MTP_OWN) else f"mtp.{k}.block.{rest}"
        return key

    def hf_names(self, args, key: str, fused: bool = False) -> list[str]:
        return super().hf_names(args, self._flat_key(key, args), fused)

    def to_hf(self, state_dict, args):
        return super().to_hf({self._flat_key(k, args): t for k, t in state_dict.items()}, args)

    def from_hf(self, state_dict, args):
        return {self._nested_key(k, args): t for k, t in super().from_hf(state_dict, args).items()}

    def args_for_weights(self, args, names) -> DeepSeekV3Args:
        """The args with as many MTP modules as the folder holds (``save_pretrained`` drops them)."""
        layers = {int(m.group(1)) for n in names if (m := _HF_LAYER.match(n))}
        present = sum(1 for k in range(args.num_mtp_layers) if args.n_layers + k in layers)
        return args if present == args.num_mtp_layers else args.replace(num_mtp_layers=present)

    # -- config.json --

    def config(self, args: DeepSeekV3Args, dtype: torch.dtype = torch.float32) -> dict:
        """The ``config.json`` of the ``DeepseekV3ForCausalLM`` equal to ``args``. Raises
        HFCheckpointError for what that class cannot express: softmax routing (it scores with a
        sigmoid), no MoE layers, sliding or chunked layers, a normalised single expert."""
        def refuse(what: str):
            raise HFCheckpointError(f"cannot write a Hugging Face DeepSeek-V3 config: {what}")

        moe = args.moe
        if moe is None:
            refuse("DeepseekV3ForCausalLM has mixture-of-experts layers; this model has none")
        if moe.score_func != "sigmoid":
            refuse(f"DeepseekV3ForCausalLM scores experts with a sigmoid; this model uses {moe.score_func!r}")
        if moe.route_norm and moe.top_k == 1:
            refuse("one expert per token with route_norm (transformers would weigh it 1, our router keeps its score)")
        if args.layer_types:
            refuse("per-layer attention types")
        return {
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            "vocab_size": args.vocab_size, "hidden_size": args.dim, "intermediate_size": args.hidden_dim,
            "moe_intermediate_size": moe.hidden_dim, "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_heads,
            "n_shared_experts": moe.num_shared_experts, "n_routed_experts": moe.num_experts,
            "routed_scaling_factor": moe.route_scale, "kv_lora_rank": args.kv_lora_rank,
            "q_lora_rank": args.q_lora_rank or None, "qk_rope_head_dim": args.qk_rope_head_dim,
            "v_head_dim": args.v_head_dim, "qk_nope_head_dim": args.qk_nope_head_dim, "n_group": moe.n_group,
            "topk_group": moe.topk_group, "num_experts_per_tok": moe.top_k,
            "first_k_dense_replace": args.n_dense_layers, "norm_topk_prob": moe.route_norm,
            "topk_method": "noaux_tc", "scoring_func": "sigmoid", "hidden_act": "silu",
            "max_position_embeddings": args.max_seq_len, "rms_norm_eps": args.norm_eps,
            "tie_word_embeddings": args.tie_word_embeddings, "attention_bias": False, "attention_dropout": 0.0,
            "rope_interleave": True, "num_nextn_predict_layers": args.num_mtp_layers,
            "torch_dtype": DTYPE_NAMES.get(dtype, "float32"),
            **rope_to_config(args.rope_theta, args.rope_scaling),
        }

    def args_from_config(self, cfg: dict, where: str) -> tuple[DeepSeekV3Args, str]:
        """DeepSeekV3Args of a DeepSeek-V3 (or Kimi K2) config, with transformers' defaults for absent
        fields. Raises HFCheckpointError, naming the field, for what we cannot reproduce exactly:
        biases, another activation, fewer kv heads than heads, rope_interleave false, rope scaling
        other than none / 'yarn' / 'llama3', a scoring function other than sigmoid, MoE layers not
        every layer after the first k, a normalised single expert."""
        _int_fields(cfg, ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"), "DeepSeek-V3", where)

        def get(key, default):
            value = cfg.get(key)
            return default if value is None else value

        def refuse(key: str, expected: str):
            raise HFCheckpointError(f"{where}: {key} {cfg.get(key)!r} is not supported (expected {expected})")

        if get("hidden_act", "silu") != "silu":
            refuse("hidden_act", "'silu'")
        if cfg.get("attention_bias"):
            refuse("attention_bias", "false: our MLA has no biases")
        heads = cfg["num_attention_heads"]
        if get("num_key_value_heads", heads) != heads:
            refuse("num_key_value_heads", f"{heads}, the number of heads: MLA gives every head its own keys")
        if get("rope_interleave", True) is not True:
            refuse("rope_interleave", "true (the published configs' layout)")
        if get("scoring_func", "sigmoid") != "sigmoid":
            refuse("scoring_func", "'sigmoid' (DeepseekV3ForCausalLM scores with a sigmoid)")
        if get("moe_layer_freq", 1) != 1:
            refuse("moe_layer_freq", "1 (every layer after first_k_dense_replace is a MoE layer)")
        norm, top_k = bool(get("norm_topk_prob", True)), get("num_experts_per_tok", 8)
        if norm and top_k == 1:
            refuse("num_experts_per_tok", "> 1 with norm_topk_prob (transformers would weigh the one expert 1)")
        theta, scaling = _rope_from_config(cfg, where, ("yarn", "llama3"))
        with config_errors(where):  # the args' own checks (sizes, groups)
            moe = MoEArgs(num_experts=get("n_routed_experts", 256), top_k=top_k,
                          hidden_dim=get("moe_intermediate_size", 2048), num_shared_experts=get("n_shared_experts", 1),
                          score_func="sigmoid", route_norm=norm, route_scale=float(get("routed_scaling_factor", 2.5)),
                          n_group=get("n_group", 8), topk_group=get("topk_group", 4))
            args = DeepSeekV3Args(
                dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"], n_heads=heads, vocab_size=cfg["vocab_size"],
                hidden_dim=get("intermediate_size", 18432), q_lora_rank=get("q_lora_rank", 0),
                kv_lora_rank=get("kv_lora_rank", 512), qk_nope_head_dim=get("qk_nope_head_dim", 128),
                qk_rope_head_dim=get("qk_rope_head_dim", 64), v_head_dim=get("v_head_dim", 128),
                norm_eps=float(get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
                max_seq_len=int(get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(get("tie_word_embeddings", False)), moe=moe,
                n_dense_layers=min(get("first_k_dense_replace", 3), cfg["num_hidden_layers"]),
                num_mtp_layers=get("num_nextn_predict_layers", cfg.get("num_mtp_layers", 0)))
        return args, matching_flavor(args, DEEPSEEK_V3_FLAVORS)


ADAPTER = DeepSeekV3Adapter()
