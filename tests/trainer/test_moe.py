"""The MoE layer (trainer/models/common/moe.py) against a float64 per-expert loop: routing (softmax/sigmoid,
top-k renormalisation, route scale, the load-balancing bias steering the choice only), routed and
shared SwiGLU experts, gradients of the input and every weight; empty experts; the token counts,
the aux-loss-free bias update and the load metric; the sequence-wise auxiliary loss and its gradient;
no counting in evaluation or in an activation-checkpoint recomputation."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from trainer.models.common.moe import MoE, load_metrics, sequence_balance_loss, update_load_balance
from trainer.models.common.moe_args import MoEArgs
from tests.trainer.helpers import assert_matches_float64


def _moe(dim=12, **kw) -> MoE:
    torch.manual_seed(0)
    args = MoEArgs(**{"num_experts": 5, "top_k": 2, "hidden_dim": 7, **kw})
    m = MoE(dim, args)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    m.reset_buffers()
    return m


def _reference(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """The MoE of float64 copies of m's weights, token by token and expert by expert."""
    a = m.args
    d = lambda t: t.detach().double()  # noqa: E731
    tokens = x.reshape(-1, x.shape[-1])
    logits = tokens @ d(m.router.gate.weight).t()
    scores = logits.softmax(-1) if a.score_func == "softmax" else logits.sigmoid()
    idx = (scores + d(m.expert_bias)).topk(a.top_k, -1).indices
    out = torch.zeros_like(tokens)
    w1, w2, w3 = d(m.experts.w1), d(m.experts.w2), d(m.experts.w3)
    for t in range(tokens.shape[0]):
        w = scores[t, idx[t]]
        if a.route_norm and a.top_k > 1:
            w = w / w.sum()
        w = w * a.route_scale
        for j, e in enumerate(idx[t].tolist()):
            h = F.silu(tokens[t] @ w1[e]) * (tokens[t] @ w3[e])
            out[t] += w[j] * (h @ w2[e])
    if m.shared_experts is not None:
        s = m.shared_experts
        out = out + F.linear(F.silu(F.linear(tokens, d(s.w1.weight))) * F.linear(tokens, d(s.w3.weight)), d(s.w2.weight))
    return out.view_as(x)


def _rel(a, b):
    a, b = a.detach(), b.detach()
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("kw", [
    {},  # Qwen3: softmax, top-k renormalised
    {"score_func": "sigmoid", "route_norm": True, "route_scale": 2.5, "num_shared_experts": 1},  # DeepSeek-V3 style
    {"score_func": "sigmoid", "route_norm": False, "top_k": 1},
    {"num_experts": 16, "top_k": 3},  # more experts than tokens: empty groups
])
def test_forward_and_gradients_match_a_float64_loop(kw):
    m = _moe(**kw)
    x = torch.randn(3, 7, 12, requires_grad=True)  # 21 tokens
    x64 = x.detach().double().requires_grad_()
    params64 = {n: p.detach().double().requires_grad_() for n, p in m.named_parameters()}
    out = m(x)
    assert out.shape == x.shape and out.dtype == torch.float32
    # float64 reference with float64 weights that take gradients
    m64 = _moe(**kw)
    m64.double()
    with torch.no_grad():
        for n, p in m64.named_parameters():
            p.copy_(params64[n])
    ref = _reference_with_grad(m64, x64)
    assert_matches_float64(m, x, out, x64, ref, dict(m64.named_parameters()))


def _reference_with_grad(m64: MoE, x64: torch.Tensor) -> torch.Tensor:
    """``_reference`` but differentiable in m64's (float64) parameters."""
    a = m64.args
    tokens = x64.reshape(-1, x64.shape[-1])
    logits = tokens @ m64.router.gate.weight.t()
    scores = logits.softmax(-1) if a.score_func == "softmax" else logits.sigmoid()
    idx = (scores.detach() + m64.expert_bias.double()).topk(a.top_k, -1).indices
    rows = []
    for t in range(tokens.shape[0]):
        w = scores[t, idx[t]]
        if a.route_norm and a.top_k > 1:
            w = w / w.sum()
        w = w * a.route_scale
        acc = 0
        for j, e in enumerate(idx[t].tolist()):
            h = F.silu(tokens[t] @ m64.experts.w1[e]) * (tokens[t] @ m64.experts.w3[e])
            acc = acc + w[j] * (h @ m64.experts.w2[e])
        rows.append(acc)
    out = torch.stack(rows)
    if m64.shared_experts is not None:
        sh = m64.shared_experts
        out = out + sh.w2(F.silu(sh.w1(tokens)) * sh.w3(tokens))
    return out.view_as(x64)


def test_bias_steers_the_choice_but_not_the_weights():
    m = _moe(route_norm=False, top_k=1)
    with torch.no_grad():
        m.expert_bias[3] = 100.0
    x = torch.randn(2, 5, 12)
    _, idx, weights = m.router(x.view(-1, 12), m.expert_bias)
    assert (idx == 3).all()
    scores = (x.view(-1, 12) @ m.router.gate.weight.detach().t()).softmax(-1)
    torch.testing.assert_close(weights[:, 0], scores[:, 3])
    assert _rel(m(x), _reference(m, x.double())) < 1e-5


def test_counts_bias_update_and_load_metric():
    m = _moe()
    x = torch.randn(4, 6, 12)
    m(x)
    m(x)
    counts = m.tokens_per_expert.clone()
    assert counts.sum() == 2 * 24 * 2  # two forwards of 24 tokens, top-2
    load = update_load_balance([("layers.0.feed_forward", m)])
    mean = counts.mean()
    torch.testing.assert_close(m.expert_bias, 1e-3 * torch.sign(mean - counts))
    torch.testing.assert_close(load, (counts.max() / mean).view(1))
    assert m.tokens_per_expert.sum() == 0
    metrics = load_metrics([("layers.0.feed_forward", m)], load)
    assert metrics == {"moe_max_load": pytest.approx(float(counts.max() / mean)),
                       "moe_load/layers.0": pytest.approx(float(counts.max() / mean))}
    # aux_loss / none layers keep a zero bias
    m2 = _moe(load_balance="none")
    m2(x)
    update_load_balance([("l", m2)])
    assert (m2.expert_bias == 0).all()


def test_no_counting_in_evaluation_or_in_an_activation_checkpoint_recompute():
    m = _moe()
    x = torch.randn(2, 5, 12, requires_grad=True)
    with torch.no_grad():
        m(x)
    m.eval()
    m(x)
    m.train()
    assert m.tokens_per_expert.sum() == 0
    checkpoint(m, x, use_reentrant=False).sum().backward()  # the backward re-runs the forward
    assert m.tokens_per_expert.sum() == 10 * 2


def test_compiled_moe_equals_eager_and_counts():
    # fullgraph compile (aot_eager: Dynamo + AOT autograd, no code generation) traces the layer,
    # counting included; output, gradients and counts equal eager.
    x = torch.randn(2, 5, 12)
    outs = {}
    for mode in ("eager", "compiled"):
        m = _moe()
        f = torch.compile(m, fullgraph=True, backend="aot_eager") if mode == "compiled" else m
        xi = x.clone().requires_grad_()
        y = f(xi)
        y.square().sum().backward()
        outs[mode] = (y, xi.grad, m.experts.w1.grad, m.tokens_per_expert.clone())
    for a, b in zip(outs["eager"], outs["compiled"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert outs["compiled"][3].sum() == 10 * 2


def test_sequence_balance_loss_and_its_gradient():
    torch.manual_seed(1)
    batch, seq, e, k = 3, 5, 4, 2
    scores = torch.rand(batch * seq, e, dtype=torch.float64).softmax(-1)
    idx = scores.topk(k, -1).indices
    s = scores.view(batch, seq, e)
    expected = 0.0
    for b in range(batch):
        f = torch.zeros(e, dtype=torch.float64)
        for i in idx.view(batch, seq, k)[b].flatten().tolist():
            f[i] += e / (k * seq)
        p = (s[b] / s[b].sum(-1, keepdim=True)).mean(0)
        expected += float((f * p).sum()) / batch
    assert float(sequence_balance_loss(scores, idx, batch, k)) == pytest.approx(expected, rel=1e-12)

    m = _moe(load_balance="aux_loss", aux_loss_coeff=0.1)
    x = torch.randn(batch, seq, 12)
    m(x).sum().backward()
    got = m.router.gate.weight.grad.clone()
    m.zero_grad()
    # The same gradient by hand: the output's plus alpha * the balance loss's.
    m.args = m.args.replace(load_balance="none")
    m.router.args = m.args
    out = m(x)
    sc, ix, _ = m.router(x.view(-1, 12), None)
    (out.sum() + 0.1 * sequence_balance_loss(sc, ix, batch, k)).backward()
    torch.testing.assert_close(got, m.router.gate.weight.grad)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="MoEArgs.top_k: expected at most num_experts=4"):
        MoEArgs(num_experts=4, top_k=5)
    with pytest.raises(ValueError, match="MoEArgs.score_func"):
        MoEArgs(score_func="relu")
    with pytest.raises(ValueError, match="MoEArgs.load_balance"):
        MoEArgs(load_balance="loss")
