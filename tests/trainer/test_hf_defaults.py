"""config.json read as transformers reads it (issue 30, items 6, 7 and 14): fields left out take
transformers' defaults for the model_type (the table equals transformers' config classes), every field
means what it means to transformers (GPT-OSS's swiglu_limit 0 clamps at 0), values whose meaning
differs between GPT-OSS's reference and transformers are refused, and a field of the wrong type is
one line naming it."""
import dataclasses
import math

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the comparisons need transformers (the [test] extra)")

from trainer.hf import HFCheckpointError, args_from_hf_config
from trainer.hf.defaults import NOT_TRANSFORMERS, SAME_AS, TABLE, complete_config, defaults, from_transformers
from trainer import registry
from trainer.models.common.moe import run_experts
from trainer.models.common.moe_args import MoEArgs

GPT_OSS = {"model_type": "gpt_oss", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 100, "intermediate_size": 32,
           "num_local_experts": 4, "num_experts_per_tok": 2}


def test_the_table_is_transformers_defaults_for_every_model_type_we_read():
    # Every model_type a family reads has an entry (directly, or as the type whose code it ships).
    assert set(registry.hf_model_types()) <= set(TABLE) | set(SAME_AS) | set(NOT_TRANSFORMERS)
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("the table mirrors transformers 5's dataclass configs; transformers 4 has none to read")
    for model_type, entry in TABLE.items():
        got = from_transformers(model_type)
        assert got is not None, model_type
        assert got == entry, model_type
        cls = transformers.CONFIG_MAPPING[model_type]
        for alias, name in entry["aliases"].items():  # the name transformers maps to the field
            assert getattr(cls.from_dict({alias: 3}), name) == 3, (model_type, alias)
        # The resolved rotary settings equal transformers' for a config without rope fields, with a
        # top-level theta only, and with legacy rope_scaling.
        for extra in ({}, {"rope_theta": 12345.0},
                      {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}):
            ours = complete_config({"model_type": model_type, **extra}, "x")["rope_parameters"]
            theirs = cls.from_dict(dict(extra)).rope_parameters
            assert ours == theirs, (model_type, extra, ours, theirs)
    assert defaults("kimi_k2") == defaults("deepseek_v3")


def test_gpt_oss_without_rope_fields_is_yarn_x32_at_theta_150000():
    args, _ = args_from_hf_config(dict(GPT_OSS), "config.json")
    assert args.rope_theta == 150000.0
    assert args.rope_scaling["rope_type"] == "yarn" and args.rope_scaling["factor"] == 32.0
    assert args.rope_scaling["original_max_position_embeddings"] == 4096 and args.rope_scaling["truncate"] is False
    # A theta alone keeps the class's YaRN (as transformers does); an explicit default type turns it off.
    args, _ = args_from_hf_config({**GPT_OSS, "rope_theta": 10000}, "config.json")
    assert (args.rope_theta, args.rope_scaling["factor"]) == (10000.0, 32.0)
    args, _ = args_from_hf_config({**GPT_OSS, "rope_scaling": {"rope_type": "default"}}, "config.json")
    assert args.rope_scaling is None and args.rope_theta == 150000.0


def test_fields_left_out_take_transformers_defaults():
    # DeepSeek-V3 without q_lora_rank: transformers' 1536 (a low-rank q path), not a plain projection.
    cfg = {"model_type": "deepseek_v3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 4, "vocab_size": 100, "intermediate_size": 96, "moe_intermediate_size": 16, "n_routed_experts": 8,
           "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
           "qk_rope_head_dim": 8, "v_head_dim": 8}
    args, _ = args_from_hf_config(cfg, "config.json")
    hf = transformers.DeepseekV3Config.from_dict(cfg)
    assert args.q_lora_rank == hf.q_lora_rank == 1536
    assert args.moe.route_norm is hf.norm_topk_prob is True and args.n_dense_layers == 2  # min(3, layers)
    assert args_from_hf_config({**cfg, "q_lora_rank": None}, "x")[0].q_lora_rank == 0  # null: a plain q projection
    with pytest.raises(HFCheckpointError, match="q_lora_rank 0 is not supported"):  # transformers: a rank-0 latent
        args_from_hf_config({**cfg, "q_lora_rank": 0}, "x")
    # Qwen3 without max_position_embeddings: 32768; Llama without rms_norm_eps: 1e-6.
    q = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 100, "intermediate_size": 96}
    assert args_from_hf_config(q, "x")[0].max_seq_len == transformers.Qwen3Config.from_dict(q).max_position_embeddings
    llama = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "vocab_size": 100, "intermediate_size": 96}
    assert args_from_hf_config(llama, "x")[0].norm_eps == transformers.LlamaConfig.from_dict(llama).rms_norm_eps


@pytest.mark.parametrize("field, value, expected", [
    ("sliding_window", "16", "an integer or null"), ("num_hidden_layers", 2.0, "an integer"),
    ("rms_norm_eps", "1e-5", "a number"), ("attention_bias", "true", "true or false"),
    ("swiglu_limit", None, "a number"), ("rope_theta", "1e4", "a number"), ("rope_scaling", [1], "an object"),
    ("rope_parameters", {"full_attention": {"rope_type": "default"}}, "per layer type (full_attention)"),
])
def test_a_field_of_the_wrong_type_names_the_field(field, value, expected):
    with pytest.raises(HFCheckpointError) as info:
        args_from_hf_config({**GPT_OSS, field: value}, "config.json")
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"config.json: {field}") and expected in msg, msg
    # An integer where transformers wants a float is read as the float.
    assert complete_config({**GPT_OSS, "swiglu_limit": 7}, "x")["swiglu_limit"] == 7.0


def test_swiglu_limit_0_clamps_at_0_as_transformers_does():
    args, _ = args_from_hf_config({**GPT_OSS, "swiglu_limit": 0.0}, "config.json")
    assert args.moe.swiglu_limit == 0.0
    # Our experts against transformers' GptOssExperts at limit 0 (and 7), float64.
    hf_cfg = transformers.GptOssConfig.from_dict({**GPT_OSS, "swiglu_limit": 0.0})
    torch.manual_seed(0)
    for limit in (0.0, 7.0):
        hf_cfg.swiglu_limit = limit
        experts = transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts(hf_cfg).double()
        with torch.no_grad():
            for p in experts.parameters():
                p.normal_(0, 1.0)
        x = torch.randn(5, 64, dtype=torch.float64)
        e = 1  # one expert, every row
        want = experts(x, torch.full((5, 1), e), torch.ones(5, 1, dtype=torch.float64))
        gu, gub = experts.gate_up_proj[e], experts.gate_up_proj_bias[e]
        w1, w3, b1, b3 = gu[:, 0::2], gu[:, 1::2], gub[0::2], gub[1::2]
        moe = MoEArgs(num_experts=1, top_k=1, hidden_dim=32, swiglu_alpha=1.702, swiglu_limit=limit,
                      swiglu_up_offset=1.0)
        act = dict(alpha=moe.swiglu_alpha, limit=moe.swiglu_limit, up_offset=moe.swiglu_up_offset)
        f = lambda t: t.detach().float()[None]  # noqa: E731  (our kernels run float32)
        got = run_experts(x.float(), torch.tensor([5]), f(w1), f(experts.down_proj[e]), f(w3),
                          biases=(f(b1), f(experts.down_proj_bias[e]), f(b3)), activation=act)
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < 1e-5, (limit, err)
    # Records written before "no clamp" was None: a plain SwiGLU's 0 still reads as no clamp.
    rec = registry.get("qwen3").flavors["debugmodel_moe"].replace(vocab_size=10).record()
    rec["moe"]["swiglu_limit"] = 0.0
    assert registry.args_from_record({**rec, "model": "qwen3"}).moe.swiglu_limit is None


@pytest.mark.parametrize("extra, match", [
    ({"swiglu_limit": -1.0}, "swiglu_limit -1.0 is not supported"),
    ({"sliding_window": 0}, "sliding_window 0 is not supported on sliding_attention layers"),
    ({"sliding_window": None}, "sliding_window None is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64}},
     "without truncate is not supported"),
])
def test_values_the_reference_and_transformers_read_differently_are_refused(extra, match):
    with pytest.raises(HFCheckpointError, match=match) as info:
        args_from_hf_config({**GPT_OSS, **extra}, "config.json")
    assert "\n" not in str(info.value)
    # Full-attention layers only: no window is needed.
    ok = {**GPT_OSS, "sliding_window": 0, "layer_types": ["full_attention"] * 2}
    assert args_from_hf_config(ok, "x")[0].layer_types == ("full_attention", "full_attention")


def test_a_model_without_scaling_exports_a_config_transformers_reads_without_scaling():
    from trainer.hf import hf_config

    args, _ = args_from_hf_config({**GPT_OSS, "rope_scaling": {"rope_type": "default"}, "rope_theta": 5e4}, "x")
    cfg = hf_config(args)
    assert transformers.GptOssConfig.from_dict(cfg).rope_parameters == {"rope_type": "default", "rope_theta": 5e4}
    assert args_from_hf_config(cfg, "x")[0] == args
    assert math.isclose(dataclasses.replace(args.moe).swiglu_limit, 7.0)
