"""Llama 3 model: flavor sizes, the forward against a float64 reference, document masking, init, HF map."""
import math

import pytest
import torch
import torch.nn.functional as F

from trainer.models.llama3.args import LLAMA3_FLAVORS
from trainer.models.llama3.args import Llama3Args as ModelArgs
from trainer.registry import build_model
from trainer.models.common.losses import cross_entropy_loss
from trainer.hf import from_hf_state_dict
from trainer.models.common.losses import linear_cross_entropy_loss
from tests.trainer.helpers import llama_model_args as model_args
from trainer.hf import to_hf_state_dict
from tests.kernels.helpers import llama31_scaled_freqs64
from tests.trainer.helpers import tiny_llama

# A small model with every feature switched on: GQA, an FFN multiplier, odd sizes, Llama 3.1 scaling.
TINY = tiny_llama(dim=64, vocab_size=101, multiple_of=32, max_seq_len=32, ffn_dim_multiplier=1.3)


def _tiny_model(args=TINY, seed=1):
    m = build_model(args, device="meta")
    m.to_empty(device="cpu")
    m.init_weights(seed)
    return m


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# --------------------------------------------------------------------------------------------
# float64 reference, written from the papers (not from our code)


def _ref_inv_freq(head_dim, theta, scaling):
    """RoPE frequencies (RoFormer eq. 15) with Llama 3.1's smooth long-wavelength scaling."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is None:
        return inv
    return torch.tensor(llama31_scaled_freqs64(inv.tolist(), scaling), dtype=torch.float64)


def _rotate(x, pos, inv_freq, layout):
    """x (b, s, h, d) float64 rotated by angle pos * inv_freq; layout 'pairs' (2i, 2i+1) or 'halves' (i, i+d/2)."""
    ang = pos[..., None].double() * inv_freq  # (b, s, d/2)
    cos, sin = ang.cos()[:, :, None, :], ang.sin()[:, :, None, :]
    d = x.shape[-1]
    if layout == "pairs":
        a, b = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
        return out
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def _ref_logits(w, args, tokens, pos=None, layout="pairs", hf=False):
    """Llama 3 forward in float64 from a state dict ``w`` (our names, or Hugging Face's if ``hf``)."""
    k = (lambda ours, theirs: w[theirs].double()) if hf else (lambda ours, theirs: w[ours].double())
    b, s = tokens.shape
    hd, nh, nkv = args.head_dim, args.n_heads, args.kv_heads
    if pos is None:
        pos = torch.arange(s).expand(b, s)
    doc = torch.cumsum(pos == 0, dim=1)
    allowed = (doc[:, :, None] == doc[:, None, :]) & torch.ones(s, s, dtype=torch.bool).tril()
    inv = _ref_inv_freq(hd, args.rope_theta, args.rope_scaling)

    def norm(x, wt):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + args.norm_eps) * wt

    h = k("tok_embeddings.weight", "model.embed_tokens.weight")[tokens]
    for i in range(args.n_layers):
        P = (lambda o, t: k(f"layers.{i}.{o}", f"model.layers.{i}.{t}"))  # noqa: E731
        x = norm(h, P("attention_norm.weight", "input_layernorm.weight"))
        q = (x @ P("attention.wq.weight", "self_attn.q_proj.weight").T).view(b, s, nh, hd)
        kk = (x @ P("attention.wk.weight", "self_attn.k_proj.weight").T).view(b, s, nkv, hd)
        v = (x @ P("attention.wv.weight", "self_attn.v_proj.weight").T).view(b, s, nkv, hd)
        q, kk = _rotate(q, pos, inv, layout), _rotate(kk, pos, inv, layout)
        kk, v = kk.repeat_interleave(nh // nkv, dim=2), v.repeat_interleave(nh // nkv, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, kk) / math.sqrt(hd)
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        att = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(b, s, nh * hd)
        h = h + att @ P("attention.wo.weight", "self_attn.o_proj.weight").T
        x = norm(h, P("ffn_norm.weight", "post_attention_layernorm.weight"))
        g = x @ P("feed_forward.w1.weight", "mlp.gate_proj.weight").T
        u = x @ P("feed_forward.w3.weight", "mlp.up_proj.weight").T
        h = h + (g * torch.sigmoid(g) * u) @ P("feed_forward.w2.weight", "mlp.down_proj.weight").T
    h = norm(h, k("norm.weight", "model.norm.weight"))
    out_w = k("tok_embeddings.weight", "model.embed_tokens.weight") if args.tie_word_embeddings and not hf \
        else k("output.weight", "lm_head.weight")
    return h @ out_w.T


# --------------------------------------------------------------------------------------------
# sizes


@pytest.mark.parametrize("flavor,expected", [
    ("8B", 8.03e9), ("70B", 70.55e9), ("405B", 405.85e9), ("1B", 1.24e9), ("3B", 3.21e9),
])
def test_flavor_param_counts_on_meta(flavor, expected):
    args = model_args(flavor, vocab_size=128256, max_seq_len=8192)
    model = build_model(args, device="meta")
    n = sum(p.numel() for p in model.parameters())
    assert round(n / 1e9, 2) == pytest.approx(expected / 1e9)
    assert n == args.num_params()
    assert all(p.device.type == "meta" for p in model.parameters())


def test_debugmodel_takes_vocab_from_tokenizer():
    args = model_args("debugmodel", vocab_size=258, max_seq_len=256)
    assert (args.dim, args.n_layers, args.n_heads, args.kv_heads, args.vocab_size) == (256, 6, 16, 16, 258)
    n = sum(p.numel() for p in build_model(args).parameters())
    assert n == args.num_params() == 6 * (4 * 256 * 256 + 3 * 256 * 768 + 2 * 256) + 2 * 258 * 256 + 256


def test_official_hyperparameters():
    hidden = {f: a.ffn_hidden_dim for f, a in LLAMA3_FLAVORS.items()}
    assert hidden == {"debugmodel": 768, "1B": 8192, "3B": 8192, "8B": 14336, "70B": 28672, "405B": 53248}
    assert all(a.rope_theta == 500000 for a in LLAMA3_FLAVORS.values())
    assert LLAMA3_FLAVORS["8B"].rope_scaling["factor"] == 8 and LLAMA3_FLAVORS["1B"].rope_scaling["factor"] == 32
    assert LLAMA3_FLAVORS["1B"].tie_word_embeddings and not LLAMA3_FLAVORS["70B"].tie_word_embeddings


def test_flops_per_token_formula():
    # 6 N (without the embedding lookup) + attention per computed score entry: causal over s tokens is
    # s (s + 1) / 2 entries, each 6 * n_heads * 2 * head_dim FLOPs (torchtitan counts s^2 entries).
    a = model_args("8B", 128256, 8192)
    n_non_emb = a.num_params() - a.vocab_size * a.dim
    entries_per_token = (8192 + 1) / 2
    assert a.flops_per_token(8192) == 6 * n_non_emb + 32 * 6 * 32 * 2 * 128 * entries_per_token


# --------------------------------------------------------------------------------------------
# numerics


@pytest.mark.parametrize("batch,seq", [(3, 17), (1, 32), (2, 1)])
def test_forward_matches_float64_reference(batch, seq):
    model = _tiny_model()
    tokens = torch.randint(0, TINY.vocab_size, (batch, seq))
    ref = _ref_logits(model.state_dict(), TINY, tokens)
    out = model(tokens)
    assert out.shape == (batch, seq, TINY.vocab_size) and out.dtype == torch.float32
    assert _rel(out, ref) < 1e-5


def test_gradients_match_float64_reference():
    model = _tiny_model()
    tokens = torch.randint(0, TINY.vocab_size, (2, 13))
    labels = torch.randint(0, TINY.vocab_size, (2, 13))
    loss = cross_entropy_loss(model(tokens), labels) / labels.numel()
    loss.backward()
    w64 = {k: v.detach().double().requires_grad_(True) for k, v in model.state_dict().items()}
    ref = F.cross_entropy(_ref_logits(w64, TINY, tokens).flatten(0, 1), labels.flatten())
    ref.backward()
    assert abs(loss.item() - ref.item()) / ref.item() < 1e-6
    for name, p in model.named_parameters():
        assert _rel(p.grad, w64[name].grad) < 1e-5, name


def test_bfloat16_forward_within_tolerance():
    model = _tiny_model()
    tokens = torch.randint(0, TINY.vocab_size, (2, 11))
    ref = _ref_logits(model.state_dict(), TINY, tokens)
    out = model.to(torch.bfloat16)(tokens)
    assert out.dtype == torch.bfloat16
    assert _rel(out, ref) < 3e-2  # two layers of bf16 matmuls and norms


def test_document_masking_isolates_documents():
    model = _tiny_model()
    a, b = torch.randint(0, 101, (1, 9)), torch.randint(0, 101, (1, 6))
    packed = torch.cat([a, b], dim=1)
    pos = torch.cat([torch.arange(9), torch.arange(6)])[None]
    out = model(packed, pos)
    assert _rel(out[:, :9], model(a)) < 1e-5
    assert _rel(out[:, 9:], model(b)) < 1e-5
    assert _rel(out, _ref_logits(model.state_dict(), TINY, packed, pos)) < 1e-5


def test_tied_embeddings_share_one_parameter():
    args = TINY.replace(tie_word_embeddings=True)
    model = _tiny_model(args)
    names = [n for n, _ in model.named_parameters()]
    assert "output.weight" not in names and "tok_embeddings.weight" in names
    assert args.num_params() == sum(p.numel() for p in model.parameters())
    tokens = torch.randint(0, 101, (2, 7))
    assert _rel(model(tokens), _ref_logits(model.state_dict(), args, tokens)) < 1e-5


def test_cross_entropy_loss_is_a_float32_sum_skipping_ignored():
    logits = torch.randn(2, 5, 11, dtype=torch.bfloat16)
    labels = torch.randint(0, 11, (2, 5))
    labels[0, 1] = -100
    got = cross_entropy_loss(logits, labels)
    keep = labels.flatten() != -100
    ref = F.cross_entropy(logits.double().flatten(0, 1)[keep], labels.flatten()[keep], reduction="sum")
    assert got.dtype == torch.float32
    assert abs(got.item() - ref.item()) / ref.item() < 1e-5


@pytest.mark.parametrize("tied", [False, True])
def test_fused_loss_on_hidden_states_equals_the_logits_loss(tied):
    # return_hidden: forward stops at the final norm; the fused loss applies the output weight (or
    # the tied embedding) and gives the loss and every parameter gradient of the logits path.
    args = TINY.replace(tie_word_embeddings=tied)
    tokens, labels = torch.randint(0, 101, (2, 9)), torch.randint(0, 101, (2, 9))
    labels[1, :4] = -100
    unfused, fused = _tiny_model(args), _tiny_model(args)
    loss_ref = cross_entropy_loss(unfused(tokens), labels)
    loss_ref.backward()
    fused.return_hidden = True
    hidden = fused(tokens)
    assert hidden.shape == (2, 9, args.dim)
    loss = linear_cross_entropy_loss(fused, hidden, labels)
    loss.backward()
    assert loss.dtype == torch.float32 and abs(loss.item() - loss_ref.item()) <= 1e-5 * loss_ref.item()
    ref_grads = dict(unfused.named_parameters())
    for name, p in fused.named_parameters():
        assert _rel(p.grad, ref_grads[name].grad) < 1e-5, name
    assert fused.output_weight() is (fused.tok_embeddings.weight if tied else fused.output.weight)


# --------------------------------------------------------------------------------------------
# initialization


def test_init_statistics_and_depth_scaling():
    args = model_args("debugmodel", 258, 64)
    model = _tiny_model(args, seed=3)
    sd = model.state_dict()
    trunc = 0.98658  # std of a normal truncated at +-3 sigma, in units of sigma
    assert sd["layers.0.attention.wq.weight"].std().item() == pytest.approx(0.02 * trunc, rel=0.03)
    assert sd["tok_embeddings.weight"].std().item() == pytest.approx(0.02 * trunc, rel=0.03)
    for i in (0, 5):
        for name in ("attention.wo", "feed_forward.w2"):
            std = sd[f"layers.{i}.{name}.weight"].std().item()
            assert std == pytest.approx(0.02 / math.sqrt(2 * (i + 1)) * trunc, rel=0.03), (i, name)
    assert sd["layers.2.attention.wq.weight"].abs().max().item() <= 3 * 0.02 + 1e-7
    assert torch.equal(sd["norm.weight"], torch.ones(256))
    assert torch.equal(sd["layers.3.ffn_norm.weight"], torch.ones(256))


def test_init_depends_only_on_seed_and_name():
    a, b, c = _tiny_model(seed=5), _tiny_model(seed=5), _tiny_model(seed=6)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k])
        if not k.endswith("norm.weight"):
            assert not torch.equal(v, c.state_dict()[k]), k
    # Different tensors of the same shape get different values.
    assert not torch.equal(a.state_dict()["layers.0.attention.wq.weight"], a.state_dict()["layers.1.attention.wq.weight"])


def test_init_on_meta_raises():
    model = build_model(TINY, device="meta")
    with pytest.raises(RuntimeError, match="meta"):
        model.init_weights(0)


# --------------------------------------------------------------------------------------------
# Hugging Face state dict


def test_hf_state_dict_round_trip_and_names():
    model = _tiny_model()
    sd = model.state_dict()
    hf = to_hf_state_dict(sd, TINY)
    assert "model.layers.1.self_attn.q_proj.weight" in hf and "lm_head.weight" in hf
    assert len(hf) == len(sd)
    assert not torch.equal(hf["model.layers.0.self_attn.q_proj.weight"], sd["layers.0.attention.wq.weight"])
    back = from_hf_state_dict(hf, TINY)
    assert back.keys() == sd.keys()
    assert all(torch.equal(back[k], sd[k]) for k in sd)


def test_hf_state_dict_gives_same_logits_with_rotate_half():
    """Hugging Face Llama rotates halves of each head; the converted weights must give the same model."""
    model = _tiny_model()
    tokens = torch.randint(0, 101, (2, 15))
    hf = to_hf_state_dict(model.state_dict(), TINY)
    ref_hf = _ref_logits(hf, TINY, tokens, layout="halves", hf=True)
    assert _rel(model(tokens), ref_hf) < 1e-5
    # and without the permutation it would not be the same model
    naive = {**hf}
    for i in range(TINY.n_layers):
        naive[f"model.layers.{i}.self_attn.q_proj.weight"] = model.state_dict()[f"layers.{i}.attention.wq.weight"]
        naive[f"model.layers.{i}.self_attn.k_proj.weight"] = model.state_dict()[f"layers.{i}.attention.wk.weight"]
    assert _rel(_ref_logits(naive, TINY, tokens, layout="halves", hf=True), ref_hf) > 1e-3


def test_hf_tied_model_exports_lm_head():
    args = TINY.replace(tie_word_embeddings=True)
    sd = _tiny_model(args).state_dict()
    hf = to_hf_state_dict(sd, args)
    assert torch.equal(hf["lm_head.weight"], hf["model.embed_tokens.weight"])
    assert from_hf_state_dict(hf, args).keys() == sd.keys()


def test_hf_unknown_key_raises():
    with pytest.raises(KeyError, match="no Hugging Face"):
        to_hf_state_dict({"layers.0.attention.bias": torch.zeros(1)}, TINY)


# --------------------------------------------------------------------------------------------
# errors


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="flavor.*'9B'"):
        model_args("9B", 258, 64)
    with pytest.raises(ValueError, match="vocab_size.*130000"):
        model_args("8B", 130000, 64)
    with pytest.raises(ValueError, match="n_kv_heads"):
        ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="dim"):
        ModelArgs(dim=66, n_layers=1, n_heads=4)
    model = _tiny_model()
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match="tokens"):
        model(torch.zeros(33, dtype=torch.long))
