"""GPT-OSS (trainer/models/gpt_oss/): published parameter counts, the analytic counts equal the built
modules', logits, loss and gradients equal transformers' GptOssForCausalLM (eager attention) on small
random configs with every feature (non-zero sinks, a window shorter than the sequence, q/k/v/o
biases, router and expert biases, the clamped SwiGLU, YaRN), Hugging Face import, export and the
converter round trip, and training the debug flavor."""
import pytest
import torch

from trainer.hf import args_from_hf_config, hf_config
from trainer.models.gpt_oss.args import GPT_OSS_FLAVORS, YARN, GptOssArgs
from trainer.models.common.moe_args import MoEArgs
from trainer.registry import build_model
from tests.trainer.helpers import assert_debugmodel_learns, assert_near_published, cpu_model
from tests.trainer.hf_parity import assert_converter_round_trip, assert_logits_loss_and_gradients_equal, hf_pair
from tests.trainer.hf_parity import assert_refused_in_one_line

transformers = pytest.importorskip("transformers", reason="the parity tests need transformers (the [test] extra)")
pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"), pytest.mark.usefixtures("one_thread")]

# OpenAI's model card: total and active parameters (active without the embedding lookup, as counted there).
PUBLISHED = {"20B": (20.9e9, 3.6e9), "120B": (116.8e9, 5.1e9)}


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_parameter_counts_match_the_published_figures(flavor):
    args = GPT_OSS_FLAVORS[flavor]
    assert_near_published((args.num_params(), args.active_params()), PUBLISHED[flavor])


def _tiny(window: int = 5, **kw) -> GptOssArgs:
    moe = MoEArgs(num_experts=4, top_k=2, hidden_dim=40, score_func="softmax", route_norm=True, router_bias=True,
                  expert_proj_bias=True, swiglu_alpha=1.702, swiglu_limit=7.0, swiglu_up_offset=1.0)
    base = dict(dim=48, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=12, vocab_size=67, sliding_window=window,
                max_seq_len=64, moe=moe, rope_scaling=dict(YARN, factor=4.0, original_max_position_embeddings=16))
    base.update(kw)
    return GptOssArgs(**base)


@pytest.mark.parametrize("args", [_tiny(), GPT_OSS_FLAVORS["debugmodel"].replace(vocab_size=258)], ids=["tiny", "debug"])
def test_analytic_counts_equal_the_built_modules(args):
    assert args.num_params() == sum(p.numel() for p in build_model(args, "meta").parameters())
    assert args.layer_types == ("sliding_attention", "full_attention", "sliding_attention")[: args.n_layers] or \
        args.n_layers > 3


def _randomize(hf) -> None:
    for name, p in hf.named_parameters():
        if name.endswith("norm.weight"):
            p.uniform_(0.5, 1.5)
        elif name.endswith("sinks"):
            p.normal_(0, 1.0)  # sinks that matter
        elif "gate_up_proj" in name and not name.endswith("bias"):
            p.normal_(0, 0.5)  # expert inputs past the clamp of 7 in places
        else:
            p.normal_(0, 0.1)


def _hf_pair(args: GptOssArgs, seed: int, tmp_path):
    return hf_pair(args, (transformers.GptOssConfig, transformers.GptOssForCausalLM), seed, tmp_path, _randomize)


@pytest.mark.parametrize("args", [_tiny(), _tiny(window=1), _tiny(window=40)], ids=["window5", "window1", "window40"])
def test_logits_loss_and_gradients_equal_transformers(args, tmp_path):
    hf, ours, ckpt = _hf_pair(args, 3, tmp_path)
    assert ckpt.args == args and ckpt.flavor == "custom"
    assert_logits_loss_and_gradients_equal(hf, ours, ckpt, args)


def test_export_loads_in_transformers_and_the_converter_round_trips(tmp_path):
    args = _tiny()
    model = cpu_model(args, seed=5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.normal_(0, 0.3)  # biases and sinks that are not zero
    cfg, _ = assert_converter_round_trip(model, args, transformers.GptOssForCausalLM, tmp_path)
    assert cfg["architectures"] == ["GptOssForCausalLM"]
    assert cfg["layer_types"][:2] == ["sliding_attention", "full_attention"]


def test_debugmodel_trains(tmp_path):
    assert_debugmodel_learns(tmp_path, "gpt_oss")


def test_configs_we_cannot_reproduce_are_refused_in_one_line():
    assert_refused_in_one_line(hf_config(_tiny()), [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"attention_bias": False}, "attention_bias false is not supported"),
        ({"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config 'mxfp4' is not supported: dequantize"),
        ({"layer_types": ["chunked_attention"] * 3}, "layer_types .* is not supported")])


def test_published_configs_read_back_as_their_flavors():
    for flavor in ("20B", "120B"):
        got, name = args_from_hf_config(hf_config(GPT_OSS_FLAVORS[flavor]), "x")
        assert name == flavor and got == GPT_OSS_FLAVORS[flavor]


def test_sliding_layers_count_their_window_in_the_flops():
    args = GPT_OSS_FLAVORS["20B"]
    full = args.replace(layer_types=("full_attention",) * args.n_layers)
    per_layer = 6 * args.n_heads * 2 * args.head_dim
    s, w = 8192, 128
    sliding_entries = w * (w + 1) // 2 + (s - w) * w
    full_entries = s * (s + 1) // 2
    want = args.n_layers // 2 * per_layer * (sliding_entries + full_entries) / s
    assert args.attention_flops_per_token(s) == pytest.approx(want)
    assert args.flops_per_token(s) < full.flops_per_token(s)
