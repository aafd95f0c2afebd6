"""Qwen3 (trainer/models/qwen3/): published parameter counts (total and active),
the flavors' analytic counts equal the built modules', logits equal transformers' Qwen3 and
Qwen3-MoE models through our Hugging Face state dict (QK-norm, head_dim, rope_theta, softmax top-k
routing with renormalisation), the state dict round trip, the message formats, and
``python -m trainer --model.name qwen3`` training the debug flavors on the embedded corpus."""
import json

import pytest
import torch

from trainer.hf import from_hf_state_dict, hf_config, to_hf_state_dict
from trainer.models.common.moe_args import MoEArgs
from trainer.models.qwen3.args import QWEN3_FLAVORS
from trainer.registry import args_from_record, args_record, build_model, model_args
from tests.trainer.helpers import assert_near_published, cpu_model, train_records
from trainer.models.qwen3.args import Qwen3Args
from trainer.models.common.args import format_params

# Published sizes, total / active (MoE: Qwen3 technical report, checked within 1%) and, for the dense
# models, total / non-embedding as the model cards round them (checked within half the last digit).
PUBLISHED_MOE = {"30B-A3B": (30.53e9, 3.35e9), "235B-A22B": (235e9, 22e9)}
PUBLISHED_DENSE = {"0.6B": (0.6e9, 0.44e9), "1.7B": (1.7e9, 1.4e9), "4B": (4.0e9, 3.6e9), "8B": (8.2e9, 6.95e9),
                   "14B": (14.8e9, 13.2e9), "32B": (32.8e9, 31.2e9)}


@pytest.mark.parametrize("flavor", list(PUBLISHED_MOE))
def test_moe_parameter_counts_match_the_published_figures(flavor):
    args = QWEN3_FLAVORS[flavor]
    assert_near_published((args.num_params(), args.active_params()), PUBLISHED_MOE[flavor])


@pytest.mark.parametrize("flavor", list(PUBLISHED_DENSE))
def test_dense_parameter_counts_match_the_model_cards(flavor):
    total, non_embedding = PUBLISHED_DENSE[flavor]
    args = QWEN3_FLAVORS[flavor]
    n = args.num_params()
    emb = args.embedding_params() * (1 if args.tie_word_embeddings else 2)
    half_digit = {0.44e9: 0.005e9, 6.95e9: 0.005e9}.get(non_embedding, 0.05e9)
    assert abs(n - total) <= 0.05e9 and abs(n - emb - non_embedding) <= half_digit
    assert args.active_params() == n


def test_message_format_names_total_and_active():
    assert format_params(QWEN3_FLAVORS["30B-A3B"]) == "30.53e9 parameters (3.35e9 active)"
    assert format_params(QWEN3_FLAVORS["235B-A22B"]) == "235.09e9 parameters (22.19e9 active)"
    assert format_params(QWEN3_FLAVORS["8B"]) == "8.19e9 parameters"


@pytest.mark.parametrize("flavor", ["30B-A3B", "0.6B", "debugmodel_moe", "debugmodel"])
def test_analytic_counts_equal_the_built_model(flavor):
    args = model_args("qwen3", flavor, 258, 128)
    model = build_model(args, "meta")  # no memory
    params = sum(p.numel() for p in model.parameters())
    assert params == args.num_params()
    if args.moe is not None:
        experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        assert experts == args.expert_params()
        per_token = params - experts + experts * args.moe.top_k // args.moe.num_experts
        assert per_token == args.active_params()
        # FLOPs/token (MFU) count active parameters only
        assert args.flops_per_token(128) < 6 * params


def test_record_round_trip_keeps_the_family_and_moe():
    args = model_args("qwen3", "debugmodel_moe", 258, 64)
    rec = json.loads(json.dumps(args_record(args)))
    assert rec["model"] == "qwen3"
    back = args_from_record(rec)
    assert back == args and isinstance(back.moe, MoEArgs)
    llama = model_args("llama3", "debugmodel", 258, 64)
    assert args_from_record(json.loads(json.dumps(args_record(llama)))) == llama


def _tiny(moe: bool) -> Qwen3Args:
    return Qwen3Args(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=12, hidden_dim=40, vocab_size=67,
                     max_seq_len=16, moe=MoEArgs(num_experts=5, top_k=2, hidden_dim=20) if moe else None)


def _hf_model(args: Qwen3Args):
    transformers = pytest.importorskip("transformers", reason="the comparison needs transformers' Qwen3")
    cfg = hf_config(args)
    cls = transformers.Qwen3MoeForCausalLM if args.moe is not None else transformers.Qwen3ForCausalLM
    conf_cls = transformers.Qwen3MoeConfig if args.moe is not None else transformers.Qwen3Config
    kw = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype", "rope_theta")}
    conf = conf_cls(**kw, rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta})
    conf._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(conf).float().eval()
    with torch.no_grad():
        for p in model.parameters():  # norms away from 1 too, so a wrong norm layout shows
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return model


def _hf_disk_state(model, args: Qwen3Args) -> dict:
    """transformers' in-memory state dict in the on-disk layout (one matrix per expert)."""
    out = {}
    for k, v in model.state_dict().items():
        if k.endswith("mlp.experts.gate_up_proj"):
            base = k.removesuffix("gate_up_proj")
            for e in range(v.shape[0]):
                gate, up = v[e].chunk(2, dim=0)
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = gate, up
        elif k.endswith("mlp.experts.down_proj"):
            base = k.removesuffix("down_proj")
            for e in range(v.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = v[e]
        else:
            out[k] = v
    return out


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_logits_equal_transformers_qwen3(moe):
    args = _tiny(moe)
    hf = _hf_model(args)
    ours = cpu_model(args)
    hf_state = _hf_disk_state(hf, args)
    ours.load_state_dict(from_hf_state_dict(hf_state, args))
    ours.eval()
    tokens = torch.randint(0, args.vocab_size, (2, 11))
    with torch.no_grad():
        want = hf(tokens).logits.double()
        got = ours(tokens).double()
    assert float((got - want).norm() / want.norm()) < 1e-5
    back = to_hf_state_dict(ours.state_dict(), args)
    assert set(back) == set(hf_state)
    for k in back:
        torch.testing.assert_close(back[k], hf_state[k], rtol=0, atol=0, msg=k)


def test_from_hf_names_a_missing_expert():
    args = _tiny(True)
    state = to_hf_state_dict(build_model(args, "cpu").state_dict(), args)
    del state["model.layers.1.mlp.experts.3.up_proj.weight"]
    with pytest.raises(ValueError, match=r"layer 1: Hugging Face experts \[3\] of 5 missing \(up_proj\)"):
        from_hf_state_dict(state, args)


# One training run per family by default: the MoE flavor (its attention is the dense flavor's); the
# dense debugmodel's run is slow, its model covered by default by the HF parity tests (test_hf_qwen3.py).
@pytest.mark.parametrize("flavor", [pytest.param("debugmodel", marks=pytest.mark.slow), "debugmodel_moe"])
def test_cli_trains_the_debug_flavors_with_the_loss_falling(tmp_path, flavor):
    recs = train_records(tmp_path, "--model.name", "qwen3", "--flavor", flavor, "--training.steps", "6",
                         "--training.seq_len", "32", "--training.local_batch_size", "4", "--optimizer.lr", "3e-3",
                         "--lr_scheduler.warmup_steps", "2", "--metrics.enable_tensorboard")
    recs = [r for r in recs if "loss" in r]
    assert recs[-1]["loss"] < recs[0]["loss"] - 1.0
    if flavor == "debugmodel_moe":  # expert loads in the records and TensorBoard
        assert all(r["moe_max_load"] >= 1.0 for r in recs) and "moe_load/layers.3" in recs[0]
        assert list((tmp_path / "tb").glob("**/events.*")) or list(tmp_path.glob("**/events.*"))
    else:
        assert "moe_max_load" not in recs[0]


def test_estimate_knows_expert_parallel():
    from trainer.estimate.memory import Layout, estimate_memory, model_costs
    from trainer.estimate.comm import communication_per_step

    args = QWEN3_FLAVORS["30B-A3B"]
    c = model_costs(args)
    assert c.expert_params == args.expert_params() == 48 * 128 * 3 * 2048 * 768
    assert c.total_params == args.num_params() and c.active_params == args.active_params()
    one, ep8 = (estimate_memory(args, Layout(dp_shard=16, ep=ep), 1, 4096) for ep in (1, 8))
    assert one.params == ep8.params  # sharded over 16 ranks either way
    # Two blocks gathered in bf16 plus one block's fp32 gradients: only E/8 experts of each under EP 8.
    per_block_experts = c.expert_params / 48
    assert one.working - ep8.working == pytest.approx((2 * 2 + 4) * per_block_experts * 7 / 8)
    comm = {(x.dim, x.op): x for x in communication_per_step(args, Layout(dp_shard=16, ep=8), 1, 4096)}
    a2a = comm[("ep", "all-to-all")]
    assert a2a.count == 48 * 4 and a2a.bytes_per_call == pytest.approx(4096 * 8 * 2048 * 2 * 7 / 8)
    assert comm[("dp_shard_mod_ep", "all-gather")].bytes == pytest.approx(0.5 * 2 * 2 * c.expert_params / 8)
    assert ("ep", "all-to-all") not in {(x.dim, x.op) for x in communication_per_step(args, Layout(dp_shard=16), 1, 64)}


def test_too_large_message_names_total_and_active(capsys):
    from trainer import train
    from trainer.config import parse_args

    rc = train.main(parse_args(["--model.name", "qwen3", "--flavor", "30B-A3B", "--training.steps", "1",
                                "--parallelism.expert_parallel_degree", "1"]))
    assert rc == 1
    assert "does not fit: 30.53e9 parameters (3.35e9 active)" in capsys.readouterr().err


def test_a_llama_flavor_is_refused_for_qwen3_with_the_qwen3_flavors_named():
    from trainer.config import ConfigError, parse_args

    with pytest.raises(ConfigError, match="--model.flavor: expected one of debugmodel, debugmodel_moe"):
        parse_args(["--model.name", "qwen3", "--flavor", "70B"])
    # Hugging Face folders in and out are Qwen3's too (tests/trainer/test_hf_qwen3.py trains from and to one)
    config = parse_args(["--model.name", "qwen3", "--flavor", "debugmodel_moe", "--checkpoint.last_save_in_hf"])
    assert config.checkpoint.last_save_in_hf and config.model.name == "qwen3"
