"""TitanOptimizer: parameter kinds and [optimizer.groups] rules, Muon equal to torch.optim.Muon and
AdamW groups equal to torch.optim.AdamW, bf16 states, the LR schedule on every group, the state
dict (dtypes kept, groups checked), and a bit-exact resume of a run with Muon, rules and bf16 states.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from trainer import train
from trainer.config import ConfigError, parse_args
from trainer.config import Optimizer as OptimizerConfig
from trainer.optim import LRSchedule, TitanOptimizer, build_lr_scheduler, build_optimizer
from trainer.optim.groups import param_groups, settings
from tests.trainer.helpers import cpu_model, tiny_llama

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"), pytest.mark.usefixtures("one_thread")]
TINY = tiny_llama(dim=32, vocab_size=64, multiple_of=16, max_seq_len=16)


def _model(seed=0):
    return cpu_model(TINY, seed)


def _kinds(model, name="muon", rules=()):
    return {s.name: (s.kind, s.optimizer, s.lr_multiplier, s.weight_decay)
            for _, s in settings(model, name, 0.1, list(rules))}


def test_kinds_and_default_groups():
    k = _kinds(_model())
    assert k["tok_embeddings.weight"] == ("embedding", "adamw", 1.0, 0.1)
    assert k["output.weight"] == ("output", "adamw", 1.0, 0.1)
    assert k["norm.weight"] == ("norm", "adamw", 1.0, 0.0)
    assert k["layers.0.attention_norm.weight"][:2] == ("norm", "adamw")
    for w in ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2"):
        assert k[f"layers.1.{w}.weight"] == ("hidden", "muon", 1.0, 0.1)
    assert all(v[1] == "adamw" for v in _kinds(_model(), "adamw").values())
    assert _kinds(_model(), "AdamW") == _kinds(_model(), "adamw")


def test_moe_kinds():
    from trainer.registry import build_model as build_any, model_args

    args = model_args("qwen3", "debugmodel_moe", 64, 16)
    k = _kinds(build_any(args, device="meta"))
    experts = [n for n in k if ".experts." in n]
    routers = [n for n in k if ".router." in n]
    assert experts and routers
    assert all(k[n][:2] == ("expert", "muon") for n in experts)
    assert all(k[n][:2] == ("router", "adamw") for n in routers)
    assert k["layers.0.attention.q_norm.weight"][:2] == ("norm", "adamw")


def test_rules_apply_in_order_by_kind_and_glob():
    rules = ["embedding: optimizer=muon lr_multiplier=0.5", "hidden: weight_decay=0.01",
             "layers.1.attention.w[qk].weight: lr_multiplier=2 optimizer=adamw", "norm: weight_decay=0.2",
             "layers.*.attention_norm.weight: weight_decay=0"]
    k = _kinds(_model(), "muon", rules)
    assert k["tok_embeddings.weight"] == ("embedding", "muon", 0.5, 0.1)
    assert k["layers.0.attention.wq.weight"] == ("hidden", "muon", 1.0, 0.01)
    assert k["layers.1.attention.wq.weight"] == ("hidden", "adamw", 2.0, 0.01)
    assert k["layers.1.attention.wv.weight"] == ("hidden", "muon", 1.0, 0.01)
    assert k["layers.0.ffn_norm.weight"][3] == 0.2 and k["layers.0.attention_norm.weight"][3] == 0.0
    groups = param_groups(_model(), "muon", 1e-3, 0.1, rules)
    total = sum(len(g["params"]) for g in groups)
    assert total == len(list(_model().parameters()))
    assert len({(g["optimizer"], g["lr_multiplier"], g["weight_decay"]) for g in groups}) == len(groups)
    emb = next(g for g in groups if "tok_embeddings.weight" in g["param_names"])
    assert emb["lr"] == 5e-4 and emb["optimizer"] == "muon"


def test_rule_errors():
    with pytest.raises(ValueError, match="optimizer.groups: Muon needs a matrix"):
        settings(_model(), "muon", 0.1, ["norm: optimizer=muon"])
    for bad, msg in [("embedding", "SELECTOR"), ("x: lr=1", "lr_multiplier"), ("x: optimizer=sgd", "adamw, muon"),
                     ("x: weight_decay=-1", ">= 0"), ("x: lr_multiplier=abc", ">= 0")]:
        with pytest.raises(ConfigError, match=msg):
            parse_args(["--optimizer.groups", bad])
    with pytest.raises(ConfigError, match="optimizer.implementation"):
        parse_args(["--optimizer.name", "muon", "--optimizer.implementation", "foreach"])


def test_toml_groups_table(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[optimizer]\nname = "muon"\n[optimizer.groups]\nembedding = {optimizer = "adamw", '
                    'lr_multiplier = 0.5}\n"layers.*.wq.weight" = {weight_decay = 0}\n')
    c = parse_args(["--config", str(path)])
    assert c.optimizer.groups == ["embedding: optimizer=adamw lr_multiplier=0.5", "layers.*.wq.weight: weight_decay=0"]


def _fp32_muon_reference(monkeypatch):
    """torch.optim.Muon with its Newton-Schulz in float32 (it always iterates in bf16)."""
    import torch.optim._muon as mu

    from titan_kernels.reference.newton_schulz import newton_schulz

    monkeypatch.setattr(mu, "_zeropower_via_newtonschulz",
                        lambda g, coef, steps, eps: newton_schulz(g, steps, *coef, eps))


def test_muon_and_adamw_groups_equal_torch_optimizers(monkeypatch):
    _fp32_muon_reference(monkeypatch)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 40, bias=False), nn.LayerNorm(40))
    ref = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 40, bias=False), nn.LayerNorm(40))
    ref.load_state_dict(net.state_dict())
    opt = build_optimizer(net, OptimizerConfig(name="muon", lr=2e-2, weight_decay=0.1, muon_ns_dtype="float32"))
    assert sorted(g["label"] for g in opt.param_groups) == ["adamw[bias,norm]", "muon[hidden]"]
    o1 = torch.optim.Muon([ref[0].weight, ref[2].weight], lr=2e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    o2 = torch.optim.AdamW([ref[0].bias, ref[3].weight, ref[3].bias], lr=2e-2, betas=(0.9, 0.95), weight_decay=0.0)
    x = torch.randn(32, 16)
    for _ in range(6):
        for model, opts in ((net, [opt]), (ref, [o1, o2])):
            for o in opts:
                o.zero_grad()
            model(x).square().mean().backward()
            for o in opts:
                o.step()
    from tests.kernels.helpers import rel_err

    for (n, a), b in zip(net.named_parameters(), ref.parameters()):
        assert rel_err(a.detach(), b.detach()) < 1e-5, (n, rel_err(a.detach(), b.detach()))


def test_experts_per_expert():
    """A 3-D (n_experts, in, out) Muon parameter is orthogonalised per expert, scaled by its own shape."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(3, 8, 12))
    opt = TitanOptimizer([{"params": [w], "param_names": ["experts.w1"], "optimizer": "muon", "lr": 0.1,
                           "weight_decay": 0.0, "label": "muon"}], ns_dtype=torch.float32)
    w.grad = torch.randn(3, 8, 12)
    before = w.detach().clone()
    opt.step()
    from titan_kernels.reference.newton_schulz import newton_schulz

    # Nesterov on the first step: U = G + mu (B - G) with B = (1 - mu) G.
    mu = 0.95
    u = w.grad * (1 - mu * mu)
    want = before - 0.1 * 0.2 * 12 ** 0.5 * torch.stack([newton_schulz(u[e]) for e in range(3)])
    assert torch.allclose(w.detach(), want, atol=1e-6)


def test_bf16_states_and_state_dict_roundtrip():
    m = _model()
    opt = build_optimizer(m, OptimizerConfig(name="muon", lr=1e-2, state_dtype="bfloat16"))
    x = torch.randint(0, 64, (2, 16))
    for _ in range(2):
        opt.zero_grad()
        m(x).float().square().mean().backward()
        opt.step()
    dtypes = {k: v.dtype for st in opt.state.values() for k, v in st.items() if k != "step"}
    assert dtypes and set(dtypes.values()) == {torch.bfloat16}
    sd = opt.state_dict()
    opt2 = build_optimizer(m, OptimizerConfig(name="muon", lr=1e-2, state_dtype="bfloat16"))
    opt2.load_state_dict(sd)  # torch casts states to the parameter's dtype; ours casts them back
    for p in m.parameters():
        for key, v in opt.state[p].items():
            assert opt2.state[p][key].dtype == v.dtype and torch.equal(opt2.state[p][key], v), key
    groups = param_groups(m, "muon", 1e-2, 0.1, [])
    for g in groups:  # the same groups, the Muon one now AdamW: its momentum would not fit AdamW's states
        g["optimizer"] = "adamw"
    with pytest.raises(ValueError, match="was trained with"):
        TitanOptimizer(groups).load_state_dict(sd)


def test_lr_schedule_scales_every_group():
    m = _model()
    opt = build_optimizer(m, OptimizerConfig(name="muon", lr=1e-2, groups=["embedding: lr_multiplier=0.25"]))
    sched = build_lr_scheduler(opt, LRSchedule(steps=10, warmup_steps=4))
    for step in range(1, 8):
        f = sched.schedule.factor(step)
        for g in opt.param_groups:
            assert g["lr"] == pytest.approx(1e-2 * g["lr_multiplier"] * f)
        opt.step()
        sched.step()


def _train(folder, *extra):
    argv = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", "6",
            "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1", "--job.dump_folder", str(folder),
            "--metrics.enable_color", "false", "--metrics.save_plot", "false", "--optimizer.name", "muon",
            "--optimizer.state_dtype", "bfloat16", "--optimizer.groups",
            "embedding: lr_multiplier=0.5, norm: weight_decay=0.01", *extra]
    assert train.main(parse_args(argv)) == 0
    recs = [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


def test_resume_with_muon_groups_and_bf16_states_is_bit_exact(tmp_path):
    """Six steps in one go equal three, a checkpoint, and three resumed in a fresh run: the same
    losses, bit for bit (Muon momentum, bf16 AdamW states with their stochastic rounding, the groups'
    LR multipliers and weight decays all come back from the checkpoint)."""
    import shutil

    whole = _train(tmp_path / "whole")
    run = tmp_path / "split"
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "3", "--checkpoint.keep_latest_k", "0"]
    first = _train(run, *ckpt)
    assert first == whole
    shutil.rmtree(run / "checkpoint" / "step-6")  # the newest complete checkpoint is now step 3
    (run / "metrics.jsonl").unlink()
    resumed = _train(run, *ckpt)
    assert sorted(resumed) == [4, 5, 6]
    assert [resumed[s] for s in (4, 5, 6)] == [whole[s] for s in (4, 5, 6)]
    assert whole[6] < whole[1]
