"""Llama 4 (trainer/models/llama4/): published parameter counts, the analytic counts equal the built
modules', logits, loss and gradients equal transformers' Llama4ForCausalLM (eager attention) on small
random configs where every feature changes the result (a chunk shorter than the sequence, RoPE and NoPE
layers, QK norm, temperature tuning from position 2 on, MoE and dense layers interleaved, the shared
expert, Llama 3 rope scaling), the layer lists read from config.json, Hugging Face import, export and
the converter round trip, one-line refusals, the FLOPs of chunked layers, and training the debug flavor."""
import pytest
import torch

from trainer.hf import args_from_hf_config, hf_config
from trainer.models.common.args import attention_entries
from trainer.models.llama4.args import LLAMA4_FLAVORS, Llama4Args
from trainer.models.llama4.model import temperature_scale
from trainer.models.common.moe_args import MoEArgs
from trainer.registry import build_model
from tests.trainer.helpers import assert_debugmodel_learns, assert_matches_float64, assert_near_published, cpu_model
from tests.trainer.hf_parity import assert_converter_round_trip, assert_logits_loss_and_gradients_equal, hf_pair
from tests.trainer.hf_parity import assert_custom_flavor_round_trip, assert_refused_in_one_line

transformers = pytest.importorskip("transformers", reason="the parity tests need transformers (the [test] extra)")
pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"), pytest.mark.usefixtures("one_thread")]

# Text-model counts of Hugging Face's configs (total, active); Meta's cards say 109B / 400B with vision.
PUBLISHED = {"17bx16e": (107.8e9, 17.2e9), "17bx128e": (400.7e9, 17.2e9)}
ROPE = dict(factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8)


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_parameter_counts_match_the_published_figures(flavor):
    args = LLAMA4_FLAVORS[flavor]
    assert_near_published((args.num_params(), args.active_params()), PUBLISHED[flavor])


def test_hf_config_builds_the_same_layers_and_counts():
    # transformers' own config of each flavor: the same NoPE / MoE layers, and its model the same size.
    for flavor in PUBLISHED:
        args = LLAMA4_FLAVORS[flavor]
        cfg = transformers.Llama4TextConfig(**{k: v for k, v in hf_config(args).items()
                                               if k not in ("architectures", "model_type", "torch_dtype")})
        assert [i for i, r in enumerate(cfg.no_rope_layers) if not r] == list(args.nope_layers)
        assert cfg.moe_layers == list(args.moe_layers) and cfg.layer_types == list(args.layer_types)
        with torch.device("meta"):
            hf = transformers.Llama4ForCausalLM(cfg)
        assert sum(p.numel() for p in hf.parameters()) == args.num_params()
    assert LLAMA4_FLAVORS["17bx16e"].nope_layers[:2] == (3, 7)  # (i + 1) % 4 == 0, as the checkpoints
    assert LLAMA4_FLAVORS["17bx128e"].moe_layers[:2] == (1, 3)


def _tiny(**kw) -> Llama4Args:
    moe = MoEArgs(num_experts=4, top_k=1, hidden_dim=40, num_shared_experts=1, score_func="sigmoid",
                  route_norm=False, score_before_experts=True)
    base = dict(dim=48, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=12, vocab_size=67, max_seq_len=64,
                attention_chunk=5, hidden_dim=56, interleave_moe_layer_step=2, floor_scale=3, attn_scale=0.5,
                rope_scaling=ROPE, moe=moe)
    base.update(kw)
    return Llama4Args(**base)


TINY = {
    "default": _tiny(),
    # the lists of config.json, not the default rule: NoPE on 0 and 2, MoE on 0, 2 and 3
    "lists": _tiny(nope_layers=(0, 2), moe_layers=(0, 2, 3)),
    "top2_no_qk_norm": _tiny(use_qk_norm=False, moe=_tiny().moe.replace(top_k=2), rope_scaling=None),
}


@pytest.mark.parametrize("args", [*TINY.values(), LLAMA4_FLAVORS["debugmodel"].replace(vocab_size=258)],
                         ids=[*TINY, "debug"])
def test_analytic_counts_equal_the_built_modules(args):
    model = build_model(args, "meta")
    assert args.num_params() == sum(p.numel() for p in model.parameters())
    for i, layer in model.layers.items():
        i = int(i)
        assert layer.attention.use_rope == (i not in args.nope_layers)
        assert hasattr(layer.feed_forward, "router") == (i in args.moe_layers)


def _randomize(hf) -> None:
    for name, p in hf.named_parameters():
        if name.endswith("norm.weight"):
            p.uniform_(0.5, 1.5)
        elif name.endswith("router.weight"):
            p.normal_(0, 0.5)  # routing that differs per token
        else:
            p.normal_(0, 0.1)


def _hf_pair(args: Llama4Args, seed: int, tmp_path):
    return hf_pair(args, (transformers.Llama4TextConfig, transformers.Llama4ForCausalLM), seed, tmp_path, _randomize)


@pytest.mark.parametrize("name", list(TINY))
def test_logits_loss_and_gradients_equal_transformers(name, tmp_path):
    args = TINY[name]
    hf, ours, ckpt = _hf_pair(args, 3, tmp_path)
    assert ckpt.args == args and ckpt.flavor == "custom"
    assert_logits_loss_and_gradients_equal(hf, ours, ckpt, args)


def test_every_feature_changes_the_logits(tmp_path):
    # Guards the parity test: each feature off gives other logits than transformers' model with it on.
    args = TINY["default"]
    hf, ours, ckpt = _hf_pair(args, 3, tmp_path)
    tokens = torch.randint(0, args.vocab_size, (2, 19))
    with torch.no_grad():
        want = hf(tokens).logits
    for change in (dict(attention_chunk=0), dict(use_qk_norm=False), dict(attn_temperature_tuning=False),
                   dict(nope_layers=()), dict(moe=args.moe.replace(score_before_experts=False))):
        other = build_model(args.replace(**change), "cpu")
        other.load_state_dict(ours.state_dict())
        with torch.no_grad():
            assert (other(tokens) - want).abs().max() > 1e-4, change


def test_temperature_scale_is_hugging_faces_formula():
    pos = torch.arange(40)
    want = 1 + 0.1 * torch.log(1 + torch.floor((pos.double() + 1) / 8))
    torch.testing.assert_close(temperature_scale(pos, 8, 0.1), want.float())
    assert temperature_scale(torch.tensor([8190]), 8192, 0.1).item() == 1.0


def test_export_loads_in_transformers_and_the_converter_round_trips(tmp_path):
    args = TINY["lists"]
    model = cpu_model(args, seed=5)
    cfg, _ = assert_converter_round_trip(model, args, transformers.Llama4ForCausalLM, tmp_path)
    assert cfg["architectures"] == ["Llama4ForCausalLM"] and cfg["model_type"] == "llama4_text"
    assert cfg["no_rope_layers"] == [0, 1, 0, 1] and cfg["moe_layers"] == [0, 2, 3]


def test_debugmodel_trains(tmp_path):
    assert_debugmodel_learns(tmp_path, "llama4")


def test_custom_flavor_trains_from_and_to_a_hugging_face_folder(tmp_path, monkeypatch):
    """--flavor custom builds the model a transformers Llama4ForCausalLM folder describes; step 1's loss
    is transformers' on the first batch (seq 32: two chunks of 16 and temperature tuning from position 3),
    and the folder exported at the end loads in transformers with the trained model's logits."""
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    args = _tiny(vocab_size=258, attention_chunk=16, floor_scale=4)
    hf, _, _ = _hf_pair(args, 7, tmp_path)
    assert_custom_flavor_round_trip("llama4", hf, args, transformers.Llama4ForCausalLM, tmp_path, steps=3)


def test_configs_we_cannot_reproduce_are_refused_in_one_line():
    cfg = hf_config(_tiny())
    assert_refused_in_one_line(cfg, [
        ({"model_type": "llama4", "vision_config": {"hidden_size": 8}}, "vision_config: the multimodal Llama 4"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"attention_bias": True}, "attention_bias true is not supported"),
        ({"quantization_config": {"quant_method": "fbgemm_fp8"}}, "quantization_config 'fbgemm_fp8' is not supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope scaling type 'yarn' is not supported"),
        ({"layer_types": ["sliding_attention"] * 4}, "layer_types .* is not supported"),
        ({"attention_chunk_size": None}, "chunked_attention layers but attention_chunk_size is None"),
        ({"no_rope_layers": [1, 1]}, "no_rope_layers: expected 0/1 for each of 4 layers")])


def test_configs_read_back_and_published_ones_as_their_flavors():
    for flavor in PUBLISHED:
        got, name = args_from_hf_config(hf_config(LLAMA4_FLAVORS[flavor]), "x")
        assert name == flavor and got == LLAMA4_FLAVORS[flavor]
    # transformers' defaults when the lists are absent: NoPE every 4th from layer 3, MoE by the step
    cfg = {k: v for k, v in hf_config(_tiny()).items() if k not in ("no_rope_layers", "moe_layers", "layer_types")}
    got, _ = args_from_hf_config(cfg, "x")
    assert got.nope_layers == (3,) and got.moe_layers == (1, 3) and got == _tiny()


def test_chunked_layers_count_only_their_chunks_in_the_flops():
    args = LLAMA4_FLAVORS["17bx128e"]
    s, c = 131072, 8192
    per_layer = 6 * args.n_heads * 2 * args.head_dim
    n_nope = len(args.nope_layers)
    want = per_layer * ((args.n_layers - n_nope) * (s // c) * c * (c + 1) // 2 + n_nope * s * (s + 1) // 2) / s
    assert args.attention_flops_per_token(s) == pytest.approx(want)
    assert attention_entries(s, True, -1, c) / attention_entries(s, True) < 2 * c / s  # O(s c), not O(s^2)


def test_cp_cost_model_counts_the_blocks_the_ring_sends():
    # 17bx128e at seq 131072 on cp 8: zigzag chunks of 8192 = the attention chunk, so a chunked layer's
    # ring needs no other rank's K/V block; only the 12 NoPE layers send theirs (cp - 1 each).
    from trainer.estimate.memory import model_costs
    from trainer.estimate.comm import cp_blocks_per_layer

    args = LLAMA4_FLAVORS["17bx128e"].replace(max_seq_len=131072)
    assert cp_blocks_per_layer(model_costs(args), 131072, 8) == pytest.approx(len(args.nope_layers) * 7 / 48)


def test_the_planner_plans_maverick(capsys):
    from trainer.estimate.plan import main

    assert main(["--model.name", "llama4", "--flavor", "17bx128e", "--ngpu", "256", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "400.71e9 parameters (17.18e9 active)" in out and "--model.name llama4 --flavor 17bx128e" in out


def test_a_chunk_that_does_not_fit_the_cp_split_is_refused_before_the_first_step():
    from trainer.parallel.context_parallel import check_cp_chunks

    args = LLAMA4_FLAVORS["debugmodel"]  # chunk 16
    for seq in (32, 64, 16):  # zigzag chunks 8, 16, 4: divisors of the chunk
        check_cp_chunks(args, seq, 2)
    check_cp_chunks(args, 256, 2)  # 64: a multiple
    with pytest.raises(ValueError, match=r"^training.seq_len: with context_parallel_degree 2 each rank holds chunks "
                                         r"of 48 / 4 = 12 tokens, which the attention chunk 16 of layer 0"):
        check_cp_chunks(args, 48, 2)


@pytest.mark.parametrize("top_k", [1, 2])
def test_score_before_experts_scales_each_experts_input(top_k):
    # The MoE with score_before_experts against a per-token float64 loop: sum over the chosen experts e
    # of expert_e(sigmoid(logit_e) * x), plus the shared expert; gradients through the weights too.
    from trainer.models.common.moe import MoE

    torch.manual_seed(0)
    args = MoEArgs(num_experts=4, top_k=top_k, hidden_dim=24, num_shared_experts=1, score_func="sigmoid",
                   route_norm=False, score_before_experts=True, load_balance="none")
    moe = MoE(16, args)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(2, 5, 16, requires_grad=True)
    out = moe(x)
    x64 = x.detach().double().requires_grad_()
    w = {n: p.detach().double().requires_grad_() for n, p in moe.named_parameters()}
    tokens = x64.reshape(-1, 16)
    logits = tokens @ w["router.gate.weight"].t()
    top = logits.topk(top_k, dim=-1).indices
    rows = []
    for t in range(tokens.shape[0]):
        y = torch.zeros(16, dtype=torch.float64)
        for e in top[t].tolist():
            h = torch.sigmoid(logits[t, e]) * tokens[t]
            a, b = h @ w["experts.w1"][e], h @ w["experts.w3"][e]
            y = y + (torch.nn.functional.silu(a) * b) @ w["experts.w2"][e]
        rows.append(y)
    shared = torch.nn.functional.silu(tokens @ w["shared_experts.w1.weight"].t()) * (tokens @ w["shared_experts.w3.weight"].t())
    want = (torch.stack(rows) + shared @ w["shared_experts.w2.weight"].t()).view(2, 5, 16)
    assert_matches_float64(moe, x, out, x64, want, w)
