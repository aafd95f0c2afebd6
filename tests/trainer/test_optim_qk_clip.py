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
    with torch.no_grad():
        model(tokens)
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
