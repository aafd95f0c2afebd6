"""flash_attn's variants (sliding windows, sinks, soft-capping, chunked attention, and their
combinations with GQA, varlen, bottom-right causal, seq_q != seq_k, the LSE gradient and v's own
head_dim) on every backend that claims them, against float64 (tests/kernels/attention_ref.py),
forward and backward (q, k, v and sinks), at awkward shapes: sequences off the tile size, a window
longer than the sequence, window 0, rows that see only the sink, zero-size.

Backends here: reference, sdpa_flash (aten's CPU kernel: windows and chunks by decomposition; it
refuses soft-capping, checked), blockwise, and triton under the interpreter. Default run: about
20 s; ``-m slow`` adds a sweep of window sizes and offsets.
"""
from __future__ import annotations

import pytest
import torch

import titan_kernels as tk
from tests.kernels.attention_ref import (
    assert_compiled_equals_eager, assert_lse, attention64, dense64, doc_mask, grads, rand, rel,
)
from tests.kernels.test_attention import KERNEL_BACKENDS, _default_tiles, _packed, op_args  # noqa: F401

VARIANT_BACKENDS = KERNEL_BACKENDS + [pytest.param("blockwise", id="blockwise")]




# (batch, seq_q, seq_k, n_heads, n_kv_heads, head_dim, head_dim_v, causal, window, chunk, softcap, sinks)
CASES = [
    (1, 70, 70, 4, 2, 16, 16, True, (9, 0), None, 0.0, True),       # sliding window 10 + sinks (GPT-OSS), GQA
    (1, 33, 33, 2, 1, 8, 8, True, (0, 0), None, 0.0, False),        # window 0: each query sees only itself
    (1, 21, 40, 2, 2, 16, 8, False, (5, 3), None, 0.0, False),      # two-sided window, seq_q < seq_k, own dv
    (2, 19, 19, 2, 1, 16, 16, True, (100, 0), None, 0.0, True),     # window longer than the sequence
    (1, 50, 50, 4, 2, 16, 16, True, (-1, -1), 16, 0.0, False),      # chunks of 16 over 50 (the last partial)
    (1, 40, 25, 2, 2, 16, 16, True, (6, 0), 8, 0.0, True),          # seq_q > seq_k: 15 rows see only the sink
    (1, 45, 45, 4, 2, 24, 16, True, (-1, -1), None, 2.0, False),    # soft-capping, own dv
    (1, 30, 37, 4, 1, 16, 24, False, (7, 2), 12, 3.0, True),        # everything at once, MQA
    (1, 200, 200, 2, 1, 8, 8, True, (10, 0), None, 0.0, False),     # blocks of one geometry (batched views)
    (2, 130, 130, 2, 2, 8, 8, True, (-1, -1), 32, 0.0, False),      # chunks of 32, batch 2 (gathered)
]


def _ids(c):
    w = "" if c[8] == (-1, -1) else f"_w{c[8][0]}_{c[8][1]}"
    return (f"q{c[1]}_k{c[2]}_h{c[3]}_{c[4]}_d{c[5]}_{c[6]}" + ("_causal" if c[7] else "") + w
            + (f"_chunk{c[9]}" if c[9] else "") + (f"_cap{c[10]:g}" if c[10] else "") + ("_sinks" if c[11] else ""))


def _check(backend, fn, fn64, inputs, douts):
    """fn's outputs and gradients (q, k, v, sinks...) against fn64's in float64 (float32 tolerances)."""
    (out, lse), g = grads(fn, inputs, douts)
    (out64, lse64), _ = grads(fn64, inputs, (douts[0].double(), None))
    assert out.shape == out64.shape and out.is_contiguous() and lse.is_contiguous()
    assert rel(out, out64) < 1e-5, (backend, rel(out, out64))
    assert_lse(lse, lse64, 1e-4)
    # A row with no visible key and no sink has lse = -inf, a constant: its LSE gradient is dropped.
    dlse = douts[1].double().masked_fill(torch.isinf(lse64), 0.0)
    _, g64 = grads(fn64, inputs, (douts[0].double(), dlse))
    for i, (a, e) in enumerate(zip(g, g64)):
        assert a.shape == e.shape and rel(a, e) < 1e-5, (backend, "grad", i, rel(a, e))


# Every (backend, case) a backend claims: aten's kernel has no soft-capping (refused: test_refusals).
DENSE = [pytest.param(b.values[0], c, id=f"{b.id}-{_ids(c)}", marks=b.marks) for b in VARIANT_BACKENDS for c in CASES
         if not (b.values[0] == "sdpa_flash" and c[10])]


@pytest.mark.parametrize("backend,case", DENSE)
def test_dense_vs_float64(backend, case):
    b, sq, sk, h, hkv, d, dv, causal, window, chunk, softcap, with_sinks = case
    q, k, v = rand(b, sq, h, d), rand(b, sk, hkv, d), rand(b, sk, hkv, dv)
    sinks = rand(h) if with_sinks else None
    scale = 1.0 if softcap else 0.5
    kw = dict(causal=causal, window_size=window, chunk_size=chunk, softcap=softcap, softmax_scale=scale)
    inputs = (q, k, v) + ((sinks,) if with_sinks else ())

    def fn(q, k, v, s=None):
        return tk.flash_attn(q, k, v, sinks=s, return_lse=True, backend=backend, **kw)

    def fn64(q, k, v, s=None):
        return dense64(q, k, v, causal, scale, window=window, chunk=chunk, sinks=s, softcap=softcap)

    _check(backend, fn, fn64, inputs, (rand(b, sq, h, dv), rand(b, h, sq)))


@pytest.mark.parametrize("backend", VARIANT_BACKENDS)
def test_bfloat16_vs_float64(backend):
    # A sliding window with sinks (and soft-capping where taken) in bf16: 1e-2 relative.
    softcap = 0.0 if backend == "sdpa_flash" else 5.0
    q, k, v = (rand(1, 90, 4, 32, dtype=torch.bfloat16) for _ in range(3))
    k, v = k[:, :, :2], v[:, :, :2]
    sinks, dout = rand(4), rand(1, 90, 4, 32, dtype=torch.bfloat16)
    fn = lambda q, k, v, s: tk.flash_attn(q, k, v, window_size=(20, 0), sinks=s, softcap=softcap,  # noqa: E731
                                          backend=backend)
    out, g = grads(fn, (q, k, v, sinks), (dout,))
    out64, g64 = grads(lambda q, k, v, s: dense64(q, k, v, True, 32 ** -0.5, window=(20, 0), sinks=s,
                                                  softcap=softcap)[0], (q, k, v, sinks), (dout.double(),))
    assert out[0].dtype == torch.bfloat16 and rel(out[0], out64[0]) < 1e-2
    for a, e in zip(g, g64):
        assert rel(a, e) < 2e-2, rel(a, e)


@pytest.mark.parametrize("backend", VARIANT_BACKENDS)
def test_varlen_vs_float64(backend):
    # Empty documents, seq_q != seq_k per document, a window, chunks, sinks (and soft-capping where taken).
    docs = [(0, 0), (17, 17), (0, 3), (30, 22), (5, 0), (9, 13)]
    softcap = 0.0 if backend == "sdpa_flash" else 2.5
    q, k, _, cu_q, cu_k, mq, mk, lq, lk = _packed(docs, 4, 2, 16)
    v = rand(k.shape[0], 2, 8)
    window, chunk = (4, 0), 10
    mask = doc_mask(lq, lk, True, window, chunk)

    def fn(q, k, v, s):
        return tk.flash_attn_varlen(q, k, v, cu_q, cu_k, mq, mk, window_size=window, chunk_size=chunk, sinks=s,
                                    softcap=softcap, softmax_scale=0.8, return_lse=True, backend=backend)

    _check(backend, fn, lambda q, k, v, s: attention64(q, k, v, mask, 0.8, s, softcap), (q, k, v, rand(4)),
           (rand(q.shape[0], 4, 8), rand(4, q.shape[0])))


@pytest.mark.parametrize("backend", VARIANT_BACKENDS)
def test_zero_size_with_sinks(backend):
    # No key: out = 0 and lse = the sink; the sink's gradient is then the LSE's (p = 1, out = 0).
    q, k, v, sinks = rand(2, 5, 4, 16), rand(2, 0, 2, 16), rand(2, 0, 2, 16), rand(4)
    (out, lse), g = grads(lambda q, s: tk.flash_attn(q, k, v, sinks=s, window_size=(3, 0), return_lse=True,
                                                       backend=backend), (q, sinks),
                          (rand(2, 5, 4, 16), torch.ones(2, 4, 5)))
    assert torch.count_nonzero(out) == 0 and torch.equal(lse, sinks[None, :, None].expand(2, 4, 5))
    assert torch.count_nonzero(g[0]) == 0 and torch.allclose(g[1], torch.full((4,), 10.0))


def test_refusals():
    # Each backend that cannot take a variant skips with the reason, and the automatic choice moves on.
    q = rand(1, 8, 2, 16)
    choice = tk.attention_backend(q, q, q, softcap=5.0)
    assert choice.backend == "blockwise" and "soft-capping" in dict(choice.skipped)["sdpa_flash"]
    assert tk.attention_backend(q, q, q, window_size=(3, 0)).backend == "sdpa_flash"  # by decomposition
    with pytest.raises(RuntimeError, match="sdpa_flash.*soft-capping"):
        tk.flash_attn(q, q, q, softcap=5.0, backend="sdpa_flash")


@pytest.mark.parametrize("backend", VARIANT_BACKENDS)
def test_opcheck(backend):
    if backend == "sdpa_flash":
        softcap = 0.0
    else:
        softcap = 4.0
    q, k, v, sinks = rand(2, 9, 4, 16), rand(2, 11, 2, 16), rand(2, 11, 2, 8), rand(4)
    args = op_args(0.5, return_lse=True, left=3, softcap=softcap, chunk=6)
    out, lse = torch.ops.titan.flash_attn(q, k, v, None, None, sinks, *args, backend)
    torch.library.opcheck(torch.ops.titan.flash_attn.default,
                          (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), None, None,
                           sinks.requires_grad_(), *args, backend))
    torch.library.opcheck(torch.ops.titan.flash_attn_backward.default,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, torch.randn_like(lse),
                           None, None, sinks.detach(), *args, backend))


def test_compile_fullgraph_matches_eager():
    q, k, v, sinks = rand(2, 20, 4, 16), rand(2, 20, 2, 16), rand(2, 20, 2, 8), rand(4)
    qv, kv, vv, cu_q, cu_k, mq, mk, _, _ = _packed([(9, 9), (0, 0), (15, 15)], 4, 2, 16)

    def f(q, k, v, s, qv, kv, vv):
        a, lse = tk.flash_attn(q, k, v, window_size=(5, 0), sinks=s, softcap=3.0, return_lse=True)
        b = tk.flash_attn_varlen(qv, kv, vv, cu_q, cu_k, mq, mk, window_size=(3, 0), chunk_size=4, sinks=s)
        return (a * a).sum() + lse.sum() + (b * b).sum()

    inputs = [t.requires_grad_() for t in (q, k, v, sinks, qv, kv, vv)]
    assert_compiled_equals_eager(f, inputs)


def test_bad_arguments():
    q = rand(1, 8, 2, 16)
    with pytest.raises(TypeError, match="window_size: expected a pair of ints"):
        tk.flash_attn(q, q, q, window_size=128)
    with pytest.raises(ValueError, match="window_size: expected ints >= -1"):
        tk.flash_attn(q, q, q, window_size=(-2, 0))
    with pytest.raises(ValueError, match="window_size: right = 4 contradicts causal=True"):
        tk.flash_attn(q, q, q, window_size=(4, 4))
    with pytest.raises(ValueError, match="softcap: expected a finite value >= 0"):
        tk.flash_attn(q, q, q, softcap=-1.0)
    with pytest.raises(TypeError, match="softcap: expected a float"):
        tk.flash_attn(q, q, q, softcap="5")
    with pytest.raises(ValueError, match="chunk_size: expected None or an int >= 1"):
        tk.flash_attn(q, q, q, chunk_size=-8)
    with pytest.raises(ValueError, match="sinks: expected shape \\(n_heads,\\) = \\(2,\\)"):
        tk.flash_attn(q, q, q, sinks=rand(3))
    with pytest.raises(TypeError, match="sinks: expected dtype"):
        tk.flash_attn(q, q, q, sinks=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="sinks: expected device"):
        tk.flash_attn(q, q, q, sinks=torch.zeros(2, device="meta"))


def test_window_as_long_as_the_sequence_is_causal():
    # A bound that cuts nothing is normalized away: the call is plain causal (one kernel call).
    q = rand(1, 64, 2, 16)
    choice = tk.attention_backend(q, q, q, window_size=(63, 0))
    assert choice.backend == "sdpa_flash"
    assert rel(tk.flash_attn(q, q, q, window_size=(63, 0)), tk.flash_attn(q, q, q)) == 0


@pytest.mark.slow
@pytest.mark.parametrize("backend", VARIANT_BACKENDS)
@pytest.mark.parametrize("sq,sk", [(1, 1), (63, 63), (65, 130), (130, 65), (129, 129)])
@pytest.mark.parametrize("window", [(0, 0), (1, 0), (31, 0), (64, 0), (17, 5)])
def test_window_sweep(backend, sq, sk, window):
    causal = window[1] == 0
    q, k, v = rand(1, sq, 4, 16), rand(1, sk, 2, 16), rand(1, sk, 2, 16)
    _check(backend, lambda q, k, v: tk.flash_attn(q, k, v, causal=causal, window_size=window, return_lse=True,
                                                  backend=backend),
           lambda q, k, v: dense64(q, k, v, causal, 0.25, window=window), (q, k, v),
           (rand(1, sq, 4, 16), rand(1, 4, sq)))


@pytest.mark.parametrize("varlen", [False, True])
def test_sm90_forward_kernel_variants(varlen):
    # The Hopper kernel (chosen on sm_90 only) with a window, chunks and soft-capping, interpreted.
    from titan_kernels import backend as _backend
    from titan_kernels.attention_mask import AttentionArgs
    from titan_kernels.triton import flash_attn as T

    if not _backend.backend_status("triton", "cpu").available:
        pytest.skip("Triton cannot run on CPU tensors without TRITON_INTERPRET=1")
    a = AttentionArgs(0.3, 20, 0, 4.0, 24, 70, 70)
    if varlen:
        q, k, v, cu_q, cu_k, mq, mk, lq, lk = _packed([(40, 40), (0, 3), (70, 50)], 2, 1, 64)
        out, lse = torch.zeros_like(q), torch.full((2, q.shape[0]), float("-inf"))
        out64, lse64 = attention64(q, k, v, doc_mask(lq, lk, True, (20, 0), 24), 0.3, None, 4.0)
    else:
        q, k, v, cu_q, cu_k, mq, mk = rand(1, 70, 2, 64), rand(1, 70, 1, 64), rand(1, 70, 1, 64), None, None, 70, 70
        out, lse = torch.empty_like(q), torch.empty(1, 2, 70)
        out64, lse64 = dense64(q, k, v, True, 0.3, window=(20, 0), chunk=24, softcap=4.0)
    T._launch_fwd_sm90(q, k, v, out, lse, cu_q, cu_k, T._dims(q, k, cu_q, mq, mk), a, tiles=(16, 16))
    assert rel(out, out64) < 1e-5
    assert_lse(lse, lse64, 1e-4)


# --------------------------------------------------------------------------- infinite sinks (issue 30)
# Sinks of -inf (no sink for that head) and +inf (the sink takes every row) are limits of the
# definition: rows that see no key (seq_q > seq_k with a chunk or a window) output 0 with lse = the
# sink, nothing is NaN, and every finite head equals float64.
INF_SINKS = (float("-inf"), 0.7, float("inf"), -0.3)


def _sinks64(attend, s):
    """float64 attention with per-head sinks that may be infinite: ``attend(sinks)`` -> (out, lse)
    with out (.., heads, dv) and lse (.., heads, rows); finite heads as ``attend``; -inf heads
    without a sink; +inf heads out 0, lse +inf."""
    fin = torch.isfinite(s)
    out_a, lse_a = attend(torch.where(fin, s, torch.zeros_like(s)))
    out_b, lse_b = attend(None)
    neg = torch.isneginf(s)
    oh = lambda m: m.view(*([1] * (out_a.dim() - 2)), -1, 1)  # noqa: E731 - heads on dim -2 of out
    lh = lambda m: m.view(*([1] * (lse_a.dim() - 2)), -1, 1)  # noqa: E731 - heads on dim -2 of lse
    out = torch.where(oh(fin), out_a, torch.where(oh(neg), out_b, torch.zeros_like(out_a)))
    lse = torch.where(lh(fin), lse_a, torch.where(lh(neg), lse_b, torch.full_like(lse_a, float("inf"))))
    return out, lse


def _check_inf_sinks(fn, fn64, inputs, douts):
    (out, lse), g = grads(fn, inputs, douts)
    out64, lse64 = fn64(*[t.double() for t in inputs])
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    assert rel(out, out64) < 1e-5
    assert torch.equal(torch.isinf(lse), torch.isinf(lse64)) and torch.equal(lse[torch.isinf(lse)],
                                                                             lse64[torch.isinf(lse64)].float())
    fin = torch.isfinite(lse64)
    assert (lse.double()[fin] - lse64[fin]).abs().max().item() < 1e-4
    dlse = None if douts[1] is None else douts[1].masked_fill(~torch.isfinite(lse64), 0.0)  # inf: a constant
    (_, _), g = grads(fn, inputs, (douts[0], dlse))
    _, g64 = grads(lambda *t: fn64(*t), [t.double() for t in inputs],
                   (douts[0].double(), None if dlse is None else dlse.double()))
    for i, (a, e) in enumerate(zip(g, g64)):
        assert torch.isfinite(a).all(), i
        assert rel(a, e) < 1e-5, (i, rel(a, e))


@pytest.mark.parametrize("backend", VARIANT_BACKENDS)
@pytest.mark.parametrize("kw", [dict(chunk_size=4), dict(window_size=(2, 0))], ids=["chunk4", "window3"])
def test_infinite_sinks_and_rows_with_no_key(backend, kw):
    # 13 queries over 9 keys: the first 4 rows sit at negative positions and see no key.
    q, k, v = rand(2, 13, 4, 16), rand(2, 9, 2, 16), rand(2, 9, 2, 8)
    sinks = torch.tensor(INF_SINKS, device=q.device)

    def fn(q, k, v, s):
        return tk.flash_attn(q, k, v, sinks=s, softmax_scale=0.5, return_lse=True, backend=backend, **kw)

    def fn64(q, k, v, s):
        return _sinks64(lambda s2: dense64(q, k, v, True, 0.5, window=kw.get("window_size", (-1, -1)),
                                           chunk=kw.get("chunk_size"), sinks=s2), s)

    out, lse = fn(q, k, v, sinks)
    assert torch.count_nonzero(out[:, :4]) == 0  # the rows with no key: the sinks' softmax alone
    assert torch.equal(lse[:, :, :4], sinks[None, :, None].expand(2, 4, 4))
    _check_inf_sinks(fn, fn64, (q, k, v, sinks), (rand(2, 13, 4, 8), rand(2, 4, 13)))


@pytest.mark.parametrize("backend", VARIANT_BACKENDS)
def test_infinite_sinks_varlen(backend):
    docs = [(6, 2), (0, 3), (9, 9), (4, 0)]  # rows with no key in documents 1 and 4
    q, k, _, cu_q, cu_k, mq, mk, lq, lk = _packed(docs, 4, 2, 16)
    v = rand(k.shape[0], 2, 8)
    mask = doc_mask(lq, lk, True, (3, 0), 4)

    def fn(q, k, v, s):
        return tk.flash_attn_varlen(q, k, v, cu_q, cu_k, mq, mk, window_size=(3, 0), chunk_size=4, sinks=s,
                                    return_lse=True, backend=backend)

    def fn64(q, k, v, s):
        return _sinks64(lambda s2: attention64(q, k, v, mask, 16 ** -0.5, s2), s)

    _check_inf_sinks(fn, fn64, (q, k, v, torch.tensor(INF_SINKS, device=q.device)),
                     (rand(q.shape[0], 4, 8), rand(4, q.shape[0])))


def test_infinite_sinks_in_the_ring_epilogue():
    # Ring attention applies the sinks once to its merged (out, lse) (trainer.parallel.context_parallel):
    # the same epilogue, here on one rank of a ring of one, against float64.
    from trainer.parallel.context_parallel import _RingAttention
    from titan_kernels.attention_mask import AttentionArgs

    class _Ring:  # what _RingAttention reads of a ContextParallel: one rank, nothing to send
        size, rank = 1, 0

        def _p2p(self, sends, recvs):
            return []

    q, k, v = rand(2, 16, 4, 16), rand(2, 16, 2, 16), rand(2, 16, 2, 8)
    a = AttentionArgs(0.5, 2, 0, 0.0, 4)

    def fn(q, k, v, s):
        out = _RingAttention.apply(q, k, v, s, a, _Ring())
        return out, torch.zeros(2, 4, 16, device=q.device)  # the ring returns no LSE

    def fn64(q, k, v, s):
        out, _ = _sinks64(lambda s2: dense64(q, k, v, True, 0.5, window=(2, 0), chunk=4, sinks=s2), s)
        return out, torch.zeros(2, 4, 16, dtype=torch.float64, device=q.device)

    _check_inf_sinks(fn, fn64, (q, k, v, torch.tensor(INF_SINKS, device=q.device)), (rand(2, 16, 4, 8), None))
