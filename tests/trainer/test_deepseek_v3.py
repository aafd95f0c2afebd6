"""DeepSeek-V3 / Kimi K2 (trainer/models/deepseek_v3/): published parameter counts, the analytic counts
equal the built modules', logits, loss and gradients equal transformers' DeepseekV3ForCausalLM on small
random configs with every feature (q-lora on and off, group-limited sigmoid routing, a non-zero
correction bias, shared experts, a dense first layer, YaRN), multi-token prediction against a float64
recomputation, Hugging Face import, export and the converter round trip, and training the debug
flavor with MTP on and off."""
import json

import pytest
import torch
import torch.nn.functional as F

from trainer.config import parse_args
from trainer.hf import HFCheckpoint, HFCheckpointError, args_from_hf_config, hf_config
from trainer.models.common.args import format_params
from trainer.models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS, DeepSeekV3Args
from trainer.models.common.losses import future_labels
from trainer.models.common.moe_args import MoEArgs
from trainer.registry import build_model
from tests.trainer.helpers import assert_debugmodel_learns, assert_near_published, cpu_model, rel
from tests.trainer.hf_parity import assert_converter_round_trip, assert_logits_loss_and_gradients_equal, hf_pair
from tests.trainer.hf_parity import assert_custom_flavor_round_trip, assert_refused_in_one_line

transformers = pytest.importorskip("transformers", reason="the parity tests need transformers (the [test] extra)")
pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"), pytest.mark.usefixtures("one_thread")]

# (total, active) as published: DeepSeek-V2-Lite / V2 papers, the V3 report (671e9 without its 14e9 of
# MTP), Kimi K2's (1.04e12 / 32.6e9, which count one MTP module). Active parameters as DeepSeek counts
# them: without the input embedding (a lookup). The figures carry their own rounding ("2.4B", "37B"):
# the tolerance is 1%, or half a unit of the published figure's last digit where that is wider.
PUBLISHED = {"16B": (15.7e9, 2.4e9, 0.05e9), "236B": (236e9, 21e9, 0.5e9), "671B": (671e9, 37e9, 0.5e9),
             "kimi_k2": (1.04e12, 32.6e9, 0.05e9)}


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_parameter_counts_match_the_published_figures(flavor):
    total, active, rounding = PUBLISHED[flavor]
    args = DEEPSEEK_V3_FLAVORS[flavor]
    if flavor == "kimi_k2":
        args = args.replace(num_mtp_layers=1)
        n = args.num_params()
    else:
        n = args.num_params() - args.extra_params()
    a = args.active_params() - args.extra_params(active=True) * (flavor != "kimi_k2")  # without the embedding
    assert_near_published((n, a), (total, active), rounding)


def test_format_shows_mtp_apart():
    assert format_params(DEEPSEEK_V3_FLAVORS["671B"]) == "671.03e9 parameters + 11.61e9 MTP (36.63e9 active)"


def _tiny(q_lora: int = 12, mtp: int = 0, **moe) -> DeepSeekV3Args:
    route = dict(num_experts=8, top_k=2, hidden_dim=24, num_shared_experts=1, score_func="sigmoid", route_norm=True,
                 route_scale=2.5, n_group=4, topk_group=2)
    route.update(moe)
    return DeepSeekV3Args(dim=48, n_layers=3, n_heads=4, vocab_size=67, hidden_dim=80, q_lora_rank=q_lora,
                          kv_lora_rank=16, qk_nope_head_dim=10, qk_rope_head_dim=8, v_head_dim=12, n_dense_layers=1,
                          max_seq_len=64, num_mtp_layers=mtp, moe=MoEArgs(**route),
                          rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16,
                                            beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0))


@pytest.mark.parametrize("args", [_tiny(), _tiny(q_lora=0, mtp=2), DEEPSEEK_V3_FLAVORS["debugmodel"].replace(vocab_size=258)],
                         ids=["q-lora", "no-q-lora-mtp2", "debugmodel"])
def test_analytic_counts_equal_the_built_modules(args):
    model = build_model(args, "meta")
    assert args.num_params() == sum(p.numel() for p in model.parameters())
    mtp = sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))
    assert args.extra_params() == mtp


def _randomize(hf) -> None:
    """Random weights and a non-zero correction bias."""
    for name, p in hf.named_parameters():
        p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else p.normal_(0, 0.1)
    for m in hf.modules():
        if hasattr(m, "e_score_correction_bias"):
            m.e_score_correction_bias.normal_(0, 0.05)


def _hf_pair(args: DeepSeekV3Args, seed: int, tmp_path):
    """A transformers DeepseekV3ForCausalLM of ``args``'s config, saved and imported into ours."""
    classes = (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM)
    return hf_pair(args, classes, seed, tmp_path, _randomize)


@pytest.mark.parametrize("args", [_tiny(), _tiny(q_lora=0), _tiny(n_group=1, topk_group=1, route_norm=False),
                                  _tiny().replace(rope_scaling=None)],
                         ids=["q-lora-groups", "plain-q", "no-groups-unnormalised", "no-yarn"])
def test_logits_loss_and_gradients_equal_transformers(args, tmp_path):
    hf, ours, ckpt = _hf_pair(args, 3, tmp_path)
    assert ckpt.args == args and ckpt.flavor == "custom"
    assert_logits_loss_and_gradients_equal(hf, ours, ckpt, args)


def test_export_loads_in_transformers_and_the_converter_round_trips(tmp_path):
    args = _tiny(mtp=1)
    model = cpu_model(args, seed=5)
    with torch.no_grad():
        for _, m in model.named_modules():
            if hasattr(m, "expert_bias"):
                m.expert_bias.normal_(0, 0.05)  # exported as e_score_correction_bias: routes the same
    cfg, hf = assert_converter_round_trip(model, args, transformers.DeepseekV3ForCausalLM, tmp_path)
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["num_nextn_predict_layers"] == 1
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.3.eh_proj.weight" in index and "model.layers.3.shared_head.norm.weight" in index
    # a folder transformers wrote (no MTP tensors) imports without the MTP module
    hf.save_pretrained(tmp_path / "resaved")
    assert HFCheckpoint(tmp_path / "resaved").args.num_mtp_layers == 0


def _mtp_by_hand(model, tokens, stacked):
    """(main summed loss, MTP summed loss) recomputed from the modules: MTP module k reads token t+k
    (the labels shifted by k - 1) and the previous depth's hidden state, and predicts token t+k+1."""
    h = {}
    hook = model.layers[str(model.args.n_layers - 1)].register_forward_hook(lambda m, i, o: h.setdefault("last", o))
    hidden = model(tokens)
    hook.remove()
    main = F.cross_entropy(F.linear(hidden, model.output.weight).flatten(0, 1), stacked[..., 0].flatten(),
                           reduction="sum")
    prev, mtp = h["last"], 0.0
    for k, module in enumerate(model.mtp.values(), start=1):
        prev, out = module(prev, model.tok_embeddings(stacked[..., k - 1].clamp_min(0)), model.rope, None, None)
        mtp = mtp + F.cross_entropy(F.linear(out, model.output.weight).flatten(0, 1), stacked[..., k].flatten(),
                                    ignore_index=-100, reduction="sum")
    return main, mtp


def test_mtp_loss_and_its_gradient_equal_a_recomputation_by_hand():
    # float32: the fused ops (grouped GEMM, fused loss) take float32 / bf16; both sides run the same modules
    args = _tiny(mtp=2)
    model = cpu_model(args, seed=4)
    model.return_hidden = True
    model.mtp_loss_weight = 0.5
    tokens = torch.randint(0, args.vocab_size, (2, 13))
    stacked = future_labels(torch.randint(0, args.vocab_size, (2, 13)), 2)
    main, mtp = _mtp_by_hand(model, tokens, stacked)
    (main + 0.5 / 2 * mtp).backward()  # lambda / depth
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    got = model.token_loss(model(tokens), stacked)
    assert got.item() == pytest.approx(main.item(), rel=1e-6)  # the reported loss is the main one
    got.backward()
    for name, p in model.named_parameters():
        assert rel(p.grad, want[name]) < 1e-5, name
    total, count = model.take_mtp_loss().tolist()
    assert total == pytest.approx(mtp.item(), rel=1e-6)
    assert count == (13 - 1) * 2 + (13 - 2) * 2  # targets past the sequence are ignored
    assert model.take_mtp_loss().tolist() == [0.0, 0.0]  # read and reset
    with torch.no_grad():  # plain labels (validation): the main loss alone, nothing accumulates
        assert model.token_loss(model(tokens), stacked[..., 0]).item() == pytest.approx(main.item(), rel=1e-6)
    assert model.take_mtp_loss().tolist() == [0.0, 0.0]


@pytest.mark.parametrize("mtp", [1, 0])
def test_debugmodel_trains_with_mtp_on_and_off(tmp_path, mtp):
    records = assert_debugmodel_learns(tmp_path, "deepseek_v3", "--model.mtp_layers", str(mtp), seq_len=64)
    assert ("mtp_loss" in records[-1]) == bool(mtp)
    if mtp:
        assert records[-1]["mtp_loss"] < records[0]["mtp_loss"]


def test_configs_we_cannot_reproduce_are_refused_in_one_line():
    assert_refused_in_one_line(hf_config(_tiny()), [
        ({"scoring_func": "softmax"}, "scoring_func 'softmax' is not supported"),
        ({"num_key_value_heads": 2}, "num_key_value_heads 2 is not supported"),
        ({"rope_interleave": False}, "rope_interleave False is not supported"),
        ({"attention_bias": True}, "attention_bias True is not supported"),
        ({"n_group": 3}, "MoEArgs.n_group: expected a divisor of num_experts=8, got 3")])
    with pytest.raises(HFCheckpointError, match="scores experts with a sigmoid"):
        hf_config(_tiny(score_func="softmax"))


def test_published_configs_read_back_as_their_flavors():
    for flavor in ("16B", "671B"):
        args = DEEPSEEK_V3_FLAVORS[flavor]
        if flavor == "16B":  # softmax routing: Hugging Face's DeepseekV3 cannot express it
            with pytest.raises(HFCheckpointError):
                hf_config(args)
            continue
        got, name = args_from_hf_config(hf_config(args), "x")
        assert name == flavor and got == args


def test_custom_flavor_trains_from_and_to_a_hugging_face_folder(tmp_path, monkeypatch):
    """--flavor custom builds the model a transformers DeepseekV3ForCausalLM folder describes (a shape
    no flavor has); step 1's loss is transformers' loss on the first batch, and the exported folder
    loads in transformers with the trained model's logits (balancing off: the bias stays as imported)."""
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    args = _tiny().replace(vocab_size=258)
    hf, _, _ = _hf_pair(args, 7, tmp_path)
    with torch.no_grad():  # small matrices: a loss near ln(258) that can fall
        for p in hf.parameters():
            if p.ndim > 1:
                p.mul_(0.2)
    assert_custom_flavor_round_trip("deepseek_v3", hf, args, transformers.DeepseekV3ForCausalLM, tmp_path, steps=4)


def test_custom_flavor_needs_a_hugging_face_folder():
    from trainer.errors import ConfigError

    with pytest.raises(ConfigError, match="--model.flavor: custom builds the model a Hugging Face folder describes"):
        parse_args(["--model.name", "deepseek_v3", "--flavor", "custom"])


def test_memory_model_within_15_percent_of_the_measured_peak():
    """The estimate counts MLA's saved values (latents, per-head q/k/v), the shared expert and the MTP
    module; measured: the peak of live tensors of a CPU run (tests/trainer/memory_probe.py)."""
    from tests.trainer import memory_probe

    case = "DeepSeek-V3 debugmodel, 1 process"
    world, argv, _ = memory_probe.CASES[case]
    got, est = memory_probe.measure(world, argv), memory_probe.estimate(case).total
    assert abs(est / got - 1) < 0.15, (got, est)


def test_the_planner_finds_a_layout_for_671b_on_2048_gpus_fast():
    import time

    from trainer.estimate.step_time import GPUS
    from trainer.estimate.plan import best, flavor_args

    t0 = time.perf_counter()
    plans = best(flavor_args("671B", 4096, model="deepseek_v3"), "671B", 2048, GPUS["H100"], 4096, top=1)
    assert plans and plans[0].memory.total <= 0.9 * GPUS["H100"].memory
    assert plans[0].layout.pp == 1  # MTP is refused with pipeline parallel, so the planner does not offer it
    assert time.perf_counter() - t0 < 10
