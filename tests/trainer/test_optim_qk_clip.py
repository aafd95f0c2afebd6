"""QK-clip: the attention's recorded per-head bound is the LSE (>= the true max logit, <= it + log
keys); after a step every head over tau has its logits scaled by exactly min(1, tau / bound),
including GQA heads that share a key head; the others are untouched; errors."""
from __future__ import annotations

import math

import pytest
import torch

import titan_kernels
from trainer.config import Optimizer as OptimizerConfig
from trainer.registry import build_model
from trainer.optim import build_optimizer
from trainer.optim.qk_clip import QKClip
from tests.trainer.helpers import tiny_llama

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"), pytest.mark.usefixtures("one_thread")]
ARGS = tiny_llama(dim=32, vocab_size=64, multiple_of=16, max_seq_len=16)  # 4 heads, 2 kv heads, head_dim 8


def _logits(model, tokens, monkeypatch):
    """Every layer's scaled causal logits (batch, heads, seq, seq) in float64, from the q and k the
    attention hands to flash_attn."""
    seen = []
    real = titan_kernels.flash_attn

    def spy(q, k, v, **kw):
        seen.append((q.detach().double(), k.detach().double(), kw.get("softmax_scale")))
        return real(q, k, v, **kw)

    monkeypatch.setattr(titan_kernels, "flash_attn", spy)
    model(tokens)  # grad mode on: a training forward records the bounds (a no_grad one does not)
    monkeypatch.setattr(titan_kernels, "flash_attn", real)
    out = []
    for q, k, scale in seen:
        rep = q.shape[2] // k.shape[2]
        k = k.repeat_interleave(rep, dim=2)
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) * (scale or q.shape[-1] ** -0.5)
        mask = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
        out.append(s.masked_fill(~mask, -math.inf))
    return out


def _mla():
    from trainer.registry import model_args

    return model_args("deepseek_v3", "debugmodel", 64, 16)


@pytest.mark.parametrize("family", ["gqa", "mla"])
def test_bound_and_clip(monkeypatch, family):
    torch.manual_seed(0)
    model = build_model(ARGS if family == "gqa" else _mla(), device="cpu")
    model.init_weights(0)
    with torch.no_grad():  # large q/k weights: logits well above a small tau
        for layer in model.layers.values():
            for name in ("wq", "wk", "wq_b", "wkv_b"):
                if getattr(layer.attention, name, None) is not None:
                    getattr(layer.attention, name).weight.mul_(8)
    tokens = torch.randint(0, 64, (2, 16))
    clip = QKClip(model, tau=1.0)
    before = _logits(model, tokens, monkeypatch)  # also records max_logit
    bounds = [layer.attention.max_logit.clone() for layer in model.layers.values()]
    for s, b in zip(before, bounds):
        true_max = s.amax(dim=(0, 2, 3))
        assert bool((b.double() >= true_max - 1e-4).all()) and bool((b.double() <= true_max + math.log(16) + 1e-4).all())
    tau = float(bounds[0].median())  # about half of layer 0's heads clipped
    clip.tau = tau
    clip()
    for layer in model.layers.values():
        assert bool(torch.isinf(layer.attention.max_logit).all())  # reset for the next step
    # Layer 0's input (the embedding) is unchanged, so its new logits are the old ones times gamma
    # (later layers see layer 0's changed output).
    s0, s1, b = before[0], _logits(model, tokens, monkeypatch)[0], bounds[0]
    gamma = torch.where(b > tau, tau / b, torch.ones_like(b)).double()
    assert 0 < int((gamma < 1).sum()) < gamma.numel()
    finite = torch.isfinite(s0)
    want = s0 * gamma.view(1, -1, 1, 1)
    assert torch.allclose(s1[finite], want[finite], rtol=1e-5, atol=1e-5 * s0[finite].abs().max())
    assert float(s1.amax()) <= tau * (1 + 1e-5)  # every head's true max is now at most tau (the bound is above it)


def test_optimizer_runs_qk_clip_after_the_step():
    model = build_model(ARGS, device="cpu")
    model.init_weights(0)
    opt = build_optimizer(model, OptimizerConfig(name="muon", lr=1e-2, qk_clip_threshold=0.5))
    model(torch.randint(0, 64, (2, 16))).float().square().mean().backward()
    assert all(torch.isfinite(layer.attention.max_logit).all() for layer in model.layers.values())
    opt.step()
    assert all(torch.isinf(layer.attention.max_logit).all() for layer in model.layers.values())


def test_errors():
    from trainer.registry import build_model as build_any, model_args

    qwen = build_any(model_args("qwen3", "debugmodel", 64, 16), device="meta")
    with pytest.raises(ValueError, match="QK-norm"):
        QKClip(qwen, 100.0)
    with pytest.raises(ValueError, match="no attention module"):
        QKClip(torch.nn.Linear(2, 2), 100.0)


# --------------------------------------------------------------------------- what a run shows (issue 30)


def test_metrics_count_clipped_heads_and_the_max_logit_between_records(monkeypatch):
    # qk_max_logit: the largest bound since the previous record; qk_clipped_heads: heads clipped in
    # those steps, summed; read without a host sync until metrics() is called, then reset.
    model = build_model(ARGS, device="cpu")
    model.init_weights(0)
    clip = QKClip(model, tau=1.0)
    assert clip.metrics() == {"qk_max_logit": None, "qk_clipped_heads": 0}  # nothing ran yet
    layers = [layer.attention for layer in model.layers.values()]
    for bounds in ([[0.5, 2.0, 0.1, 3.0], [0.2, 0.3, 0.4, 0.9]], [[0.5, 0.5, 0.5, 0.5], [1.5, 0.2, 0.2, 0.2]]):
        for attn, b in zip(layers, bounds):
            attn.max_logit.copy_(torch.tensor(b))
        clip()
    assert clip.metrics() == {"qk_max_logit": 3.0, "qk_clipped_heads": 3}  # 2 heads at the first step, 1 at the second
    assert clip.metrics() == {"qk_max_logit": None, "qk_clipped_heads": 0}


def test_startup_log_names_the_optimizer_groups_and_qk_clip(caplog):
    model = build_model(ARGS, device="cpu")
    model.init_weights(0)
    with caplog.at_level("INFO", logger="trainer"):
        build_optimizer(model, OptimizerConfig(name="muon", lr=1e-2, qk_clip_threshold=50.0, state_dtype="bfloat16",
                                               groups=["norm: lr_multiplier=0.5"]))
        build_optimizer(model, OptimizerConfig(lr=1e-3, weight_decay=0.05))
    lines = [r.getMessage() for r in caplog.records]
    n_hidden = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and not n.startswith(("tok_", "output")))
    assert lines[0].startswith("optimizer: AdamW + Muon (TitanOptimizer); AdamW: betas 0.9/0.95, eps 1e-08")
    assert "Muon: momentum 0.95 (Nesterov), 5 Newton-Schulz steps in float32, rms match 0.2; 3 group(s):" in lines[0]
    assert lines[1] == "  adamw[embedding,output]: 2 tensors, 4,096 parameters, peak lr 0.01, weight decay 0.1, states bfloat16"
    assert lines[2] == "  adamw[norm]: 5 tensors, 160 parameters, peak lr 0.005, weight decay 0, states bfloat16"
    assert lines[3] == f"  muon[hidden]: 14 tensors, {n_hidden:,} parameters, peak lr 0.01, weight decay 0.1, momentum bfloat16"
    assert lines[4].startswith("QK-clip (optimizer.qk_clip_threshold): threshold 50 on the max attention logit of 8 "
                               "heads: 2 grouped-query attention layer(s) of 4 heads (layers.0.attention .. "
                               "layers.1.attention)")
    assert lines[5].startswith("optimizer: AdamW (torch.optim.AdamW, fused), betas 0.9/0.95, eps 1e-08, 2 group(s):")
    assert lines[6].startswith("  adamw[2+ dims]: 16 tensors") and "weight decay 0.05, states float32" in lines[6]
    assert lines[7].startswith("  adamw[1-D]: 5 tensors, 160 parameters, peak lr 0.001, weight decay 0,")
    assert len(lines) == 8


def test_a_run_shows_qk_clip_in_its_metrics_and_console(tmp_path, capsys):
    from tests.trainer.helpers import train_records

    recs = train_records(tmp_path, "--training.steps", "2", "--training.seq_len", "16", "--training.local_batch_size", "2",
                         "--optimizer.name", "muon", "--optimizer.qk_clip_threshold", "0.5",
                         "--metrics.enable_color", "false")
    from trainer.registry import model_args

    out = capsys.readouterr().out
    args = model_args("llama3", "debugmodel", 256, 16)
    heads = args.n_layers * args.n_heads
    steps = [r for r in recs if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:  # logits of a fresh debug model are far above 0.5: every head is clipped every step
        assert r["qk_max_logit"] > 0.5 and r["qk_clipped_heads"] == heads
        assert f"qk-clip {heads} head(s) clipped, max logit {r['qk_max_logit']:.1f}" in out
    assert "optimizer: AdamW + Muon (TitanOptimizer)" in out and "  muon[hidden]: " in out
    assert f"QK-clip (optimizer.qk_clip_threshold): threshold 0.5 on the max attention logit of {heads} heads" in out


def test_a_forward_without_grad_records_nothing():
    # A validation runs under no_grad: its logits must not clip the trained weights.
    model = build_model(ARGS, device="cpu")
    model.init_weights(0)
    QKClip(model, tau=1.0)
    with torch.no_grad():
        model(torch.randint(0, 64, (2, 16)))
    assert all(torch.isinf(layer.attention.max_logit).all() for layer in model.layers.values())
    model(torch.randint(0, 64, (2, 16)))
    assert all(torch.isfinite(layer.attention.max_logit).all() for layer in model.layers.values())


def test_console_shows_qk_clip_only_when_it_clipped(tmp_path, capsys):
    from trainer.observe.metrics import MetricsLogger

    m = MetricsLogger(tmp_path, 1, torch.device("cpu"), 1, 2, enable_color=False)
    m.step(1, 10, 0.0, loss=1.0, extra=lambda: {"qk_max_logit": 0.4, "qk_clipped_heads": 0})
    m.step(2, 10, 0.0, loss=1.0, extra=lambda: {"qk_max_logit": 7.25, "qk_clipped_heads": 3})
    m.close()
    first, second = capsys.readouterr().out.splitlines()
    assert "qk-clip" not in first and second.endswith("qk-clip 3 head(s) clipped, max logit 7.2")
