"""GPT-OSS (trainer/models/gpt_oss/): published parameter counts, the analytic counts equal the built
modules', logits, loss and gradients equal transformers' GptOssForCausalLM (eager attention) on small
random configs with every feature (non-zero sinks, a window shorter than the sequence, q/k/v/o
biases, router and expert biases, the clamped SwiGLU, YaRN), Hugging Face import, export and the
converter round trip, and training the debug flavor."""
import json

import pytest
import torch
import torch.nn.functional as F

from trainer import train
from trainer.checkpoint import Checkpointer
from trainer.config import parse_args
from trainer.convert import main as convert_main
from trainer.hf.convert import hf_to_dcp
from trainer.hf import HFCheckpoint, HFCheckpointError, args_from_hf_config, hf_config, load_into_model
from trainer.models.gpt_oss.args import GPT_OSS_FLAVORS, YARN, GptOssArgs
from trainer.models.moe_args import MoEArgs
from trainer.models.registry import build_model

transformers = pytest.importorskip("transformers", reason="the parity tests need transformers (the [test] extra)")
pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"), pytest.mark.usefixtures("one_thread")]

# OpenAI's model card: total and active parameters (active without the embedding lookup, as counted there).
PUBLISHED = {"20B": (20.9e9, 3.6e9), "120B": (116.8e9, 5.1e9)}


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_parameter_counts_match_the_published_figures(flavor):
    total, active = PUBLISHED[flavor]
    args = GPT_OSS_FLAVORS[flavor]
    assert abs(args.num_params() - total) <= 0.01 * total
    assert abs(args.active_params() - active) <= 0.01 * active


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


def _hf_pair(args: GptOssArgs, seed: int, tmp_path):
    cfg = transformers.GptOssConfig(**{k: v for k, v in hf_config(args).items()
                                       if k not in ("architectures", "model_type", "torch_dtype")},
                                    attn_implementation="eager")
    torch.manual_seed(seed)
    hf = transformers.GptOssForCausalLM(cfg).float()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("sinks"):
                p.normal_(0, 1.0)  # sinks that matter
            elif "gate_up_proj" in name and not name.endswith("bias"):
                p.normal_(0, 0.5)  # expert inputs past the clamp of 7 in places
            else:
                p.normal_(0, 0.1)
    hf.save_pretrained(tmp_path / "hf")
    ckpt = HFCheckpoint(tmp_path / "hf")
    ours = build_model(ckpt.args, "cpu")
    ours.init_weights(0)
    load_into_model(ours, ckpt)
    return hf, ours, ckpt


@pytest.mark.parametrize("args", [_tiny(), _tiny(window=1), _tiny(window=40)], ids=["window5", "window1", "window40"])
def test_logits_loss_and_gradients_equal_transformers(args, tmp_path):
    hf, ours, ckpt = _hf_pair(args, 3, tmp_path)
    assert ckpt.args == args and ckpt.flavor == "custom"
    tokens = torch.randint(0, args.vocab_size, (2, 19))
    labels = torch.randint(0, args.vocab_size, (2, 19))
    ours_logits, hf_logits = ours(tokens), hf(tokens).logits
    assert _rel(ours_logits, hf_logits) < 1e-5
    loss_ours = F.cross_entropy(ours_logits.flatten(0, 1), labels.flatten())
    loss_hf = F.cross_entropy(hf_logits.flatten(0, 1), labels.flatten())
    assert loss_ours.item() == pytest.approx(loss_hf.item(), rel=1e-6)
    loss_ours.backward()
    loss_hf.backward()
    hf_grads = ckpt.adapter.from_hf({n: p.grad for n, p in hf.named_parameters()}, args)
    for name, p in ours.named_parameters():
        assert _rel(p.grad, hf_grads[name]) < 1e-5, name


def test_export_loads_in_transformers_and_the_converter_round_trips(tmp_path):
    args = _tiny()
    model = build_model(args, "cpu")
    model.init_weights(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.normal_(0, 0.3)  # biases and sinks that are not zero
    Checkpointer(tmp_path / "ckpt", model, model_args=args).save_seed()
    assert convert_main(["dcp-to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--max_shard_size", "40KB"]) == 0
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["architectures"] == ["GptOssForCausalLM"] and cfg["layer_types"][:2] == ["sliding_attention",
                                                                                        "full_attention"]
    hf = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
    tokens = torch.randint(0, args.vocab_size, (2, 17))
    with torch.no_grad():
        assert _rel(hf(tokens).logits, model.eval()(tokens)) < 1e-5
    back = hf_to_dcp(tmp_path / "hf", tmp_path / "dcp")
    again = build_model(args, "cpu")
    again.init_weights(9)
    Checkpointer(tmp_path / "c", again, model_args=args).initial_load(back, model_only=True)
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name


def test_debugmodel_trains(tmp_path):
    config = parse_args(["--model.name", "gpt_oss", "--flavor", "debugmodel", "--training.steps", "8",
                         "--training.seq_len", "128", "--training.local_batch_size", "4", "--lr_scheduler.warmup_steps",
                         "2", "--optimizer.lr", "2e-3", "--metrics.log_freq", "1", "--metrics.save_plot", "false",
                         "--job.dump_folder", str(tmp_path)])
    assert train.main(config) == 0
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < losses[0] - 0.5, losses


def test_configs_we_cannot_reproduce_are_refused_in_one_line():
    cfg = hf_config(_tiny())
    for change, message in [({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
                            ({"attention_bias": False}, "attention_bias false is not supported"),
                            ({"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config 'mxfp4' is not "
                                                                                 "supported: dequantize"),
                            ({"layer_types": ["chunked_attention"] * 3}, "layer_types .* is not supported")]:
        with pytest.raises(HFCheckpointError, match=message) as e:
            args_from_hf_config({**cfg, **change}, "x/config.json")
        assert "\n" not in str(e.value) and str(e.value).startswith("x/config.json: ")


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
