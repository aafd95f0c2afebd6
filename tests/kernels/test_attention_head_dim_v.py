"""flash_attn with v's head_dim different from q/k's (multi-head latent attention: DeepSeek-V3's q/k
192, v 128), on every backend that runs here, against float64; and which backends take it where.

Backends run here: reference, triton (interpreted) and sdpa_flash (aten's CPU kernel, by zero-padding:
its only way). The CUDA rules (FlashAttention-3 forward natively, its backward and FlashAttention-2 and
aten's CUDA flash kernel not) are checked on synthetic cases; FlashAttention's adapter runs against a
stand-in module (tests/kernels/test_attention_dispatch.py). About 10 s.
"""
from __future__ import annotations

import pytest
import torch

import titan_kernels as tk
from titan_kernels.attention_mask import AttentionArgs
from titan_kernels.ops.attention import dispatch as A
from tests.kernels.attention_ref import (
    assert_compiled_equals_eager, assert_lse, attention64, dense64, doc_mask, grads, rand, rel,
)
from tests.kernels.test_attention import KERNEL_BACKENDS, _default_tiles, _packed, op_args

_ = _default_tiles  # the autouse fixture, re-exported for this module

# (batch, seq_q, seq_k, n_heads, n_kv_heads, head_dim, head_dim_v, causal)
CASES = [
    (2, 70, 70, 4, 2, 48, 32, True),     # GQA, v narrower; several interpreter tiles
    (1, 23, 61, 4, 1, 24, 40, True),     # MQA, v wider, seq_q < seq_k: bottom-right causal
    (1, 45, 20, 2, 2, 16, 8, True),      # seq_q > seq_k: the first 25 rows see no key
    (1, 17, 17, 2, 1, 192, 128, False),  # DeepSeek-V3's head dims
]


def _ids(c):
    return "b{}_q{}_k{}_h{}_{}_d{}_dv{}_{}".format(*c[:7], "causal" if c[7] else "full")


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_dense_vs_float64(backend, case):
    b, sq, sk, h, hkv, d, dv, causal = case
    q, k, v = rand(b, sq, h, d), rand(b, sk, hkv, d), rand(b, sk, hkv, dv)
    scale = 0.7 / d ** 0.5
    dout, dlse = rand(b, sq, h, dv), rand(b, h, sq)
    fn = lambda q, k, v: tk.flash_attn(q, k, v, causal=causal, softmax_scale=scale, return_lse=True,  # noqa: E731
                                       backend=backend)
    (out, lse), g = grads(fn, (q, k, v), (dout, dlse))
    (out64, lse64), _ = grads(lambda q, k, v: dense64(q, k, v, causal, scale), (q, k, v), (dout.double(), None))
    assert out.shape == (b, sq, h, dv) and out.is_contiguous() and lse.shape == (b, h, sq)
    assert rel(out, out64) < 1e-5, rel(out, out64)
    assert_lse(lse, lse64, 1e-4)
    # The LSE gradient of rows with no visible key is dropped (their lse is -inf, a constant).
    _, g64 = grads(lambda q, k, v: dense64(q, k, v, causal, scale), (q, k, v),
                   (dout.double(), dlse.double().masked_fill(torch.isinf(lse64), 0.0)))
    for name, a, e in zip("qkv", g, g64):
        assert a.shape == e.shape and rel(a, e) < 1e-5, (name, rel(a, e))


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_varlen_vs_float64(backend):
    docs = [(0, 0), (9, 9), (40, 31), (0, 3), (5, 0), (12, 12)]  # empty documents, seq_q != seq_k
    q, k, _, cu_q, cu_k, mq, mk, lq, lk = _packed(docs, 4, 2, 40)
    v = rand(k.shape[0], 2, 24)
    dout = rand(q.shape[0], 4, 24)
    fn = lambda q, k, v: tk.flash_attn_varlen(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=0.2,  # noqa: E731
                                              backend=backend)
    out, g = grads(fn, (q, k, v), (dout,))
    mask = doc_mask(lq, lk, True)
    (out64, _), g64 = grads(lambda q, k, v: attention64(q, k, v, mask, 0.2), (q, k, v), (dout.double(), None))
    assert out[0].shape == (q.shape[0], 4, 24) and rel(out[0], out64) < 1e-5
    for a, e in zip(g, g64):
        assert rel(a, e) < 1e-5


# The fake is one for every backend; Triton's op path is checked in test_attention_variants.test_opcheck.
@pytest.mark.parametrize("backend", ["reference", "sdpa_flash"])
def test_opcheck(backend):
    q, k, v = rand(2, 9, 4, 24), rand(2, 7, 2, 24), rand(2, 7, 2, 16)
    args = op_args(0.25, return_lse=True)
    out, lse = torch.ops.titan.flash_attn(q, k, v, None, None, None, *args, backend)
    assert out.shape == (2, 9, 4, 16)
    torch.library.opcheck(torch.ops.titan.flash_attn.default,
                          (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), None, None, None, *args, backend))
    torch.library.opcheck(torch.ops.titan.flash_attn_backward.default,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, torch.randn_like(lse),
                           None, None, None, *args, backend))


def test_compile_fullgraph_matches_eager():
    q, k, v = rand(2, 12, 4, 24), rand(2, 12, 2, 24), rand(2, 12, 2, 8)

    def f(q, k, v):
        out, lse = tk.flash_attn(q, k, v, return_lse=True)
        return (out * out).sum() + lse.sum()

    inputs = [t.requires_grad_() for t in (q, k, v)]
    assert_compiled_equals_eager(f, inputs)


def test_meta_shapes():
    q = torch.empty(2, 5, 4, 192, device="meta", requires_grad=True)
    k, v = torch.empty(2, 5, 4, 192, device="meta"), torch.empty(2, 5, 4, 128, device="meta")
    out = tk.flash_attn(q, k, v)
    assert out.shape == (2, 5, 4, 128)


def test_bad_head_dims():
    q = rand(1, 4, 2, 16)
    with pytest.raises(ValueError, match="k: expected head_dim 16 \\(the head_dim of q\\), got 24"):
        tk.flash_attn(q, rand(1, 4, 2, 24), rand(1, 4, 2, 16))
    with pytest.raises(ValueError, match="v: head_dim must be in \\[1, 256\\]"):
        tk.flash_attn(q, rand(1, 4, 2, 16), rand(1, 4, 2, 264))
    with pytest.raises(ValueError, match="v: expected shape \\(1, 4, 2, 'head_dim_v'\\)"):
        tk.flash_attn(q, rand(1, 4, 2, 16), rand(1, 5, 2, 8))
    with pytest.raises(ValueError, match="v: expected shape"):
        tk.flash_attn_varlen(q[0], q[0], rand(4, 1, 8), *(torch.tensor([0, 4], dtype=torch.int32),) * 2, 4, 4)


def _cuda(backward=False, d=192, dv=128, dtype=torch.bfloat16):
    return A.AttentionCase(torch.device("cuda", 0), dtype, 2, 64, 64, 8, 8, d, True, False, backward=backward,
                           head_dim_v=dv)


def test_cuda_rules(monkeypatch):
    # FlashAttention-3's forward takes q/k 192 with v 128 natively (its backward does not); FA2 and
    # aten's CUDA flash kernel take equal head dims only; cuDNN and efficient ask torch's own checks.
    A.clear_caches()
    monkeypatch.setattr(A, "flash_lib", lambda kind: (object(), ""))
    monkeypatch.setattr(A, "_cuda_capability", lambda device: (9, 0))
    try:
        assert A._why_not_flash_lib("fa3", _cuda()) is None
        assert "backward takes equal head dims" in A._why_not_flash_lib("fa3", _cuda(backward=True))
        assert "(128, 192]" in A._why_not_flash_lib("fa3", _cuda(d=128, dv=64))
        assert A._why_not_flash_lib("fa3", _cuda(d=64, dv=256)) is None
        assert "FlashAttention-2 takes equal head dims" in A._why_not_flash_lib("fa2", _cuda())
        monkeypatch.setattr(A, "_sdpa_can_use", lambda name, case: True)
        assert "equal ones only" in A._why_not_aten("sdpa_flash", _cuda())
        assert A._why_not_aten("sdpa_cudnn", _cuda()) is None and A._why_not_aten("sdpa_efficient", _cuda()) is None
        assert _cuda().key() != _cuda(dv=192).key()  # capability answers are cached per head-dim pair
    finally:
        A._answers.clear()


def test_fa3_adapter_passes_head_dim_v(monkeypatch):
    # The adapter against a stand-in with FlashAttention-3's signature (computing with the reference).
    import sys

    from tests.kernels.test_attention_dispatch import make_fa3

    calls: list = []
    monkeypatch.setitem(sys.modules, "flash_attn_interface", make_fa3(calls))
    A.clear_caches()
    try:
        q, k, v = rand(1, 20, 4, 192), rand(1, 20, 2, 192), rand(1, 20, 2, 128)
        out, lse = A.impl("fa3", "cuda")[0](q, k, v, None, None, AttentionArgs(0.1, right=0))
        out64, lse64 = dense64(q, k, v, True, 0.1)
        assert calls == [("fa3.fwd", False)] and out.shape == (1, 20, 4, 128) and rel(out, out64) < 1e-5
    finally:
        A.clear_caches()


def test_sm90_forward_kernel_head_dim_v():
    # The Hopper kernel's separate V descriptor, run by the interpreter (q/k 128, v 64).
    from titan_kernels import backend as _backend
    from titan_kernels.triton import flash_attn as T

    if not _backend.backend_status("triton", "cpu").available:
        pytest.skip("Triton cannot run on CPU tensors without TRITON_INTERPRET=1")
    q, k, v = rand(1, 40, 2, 128), rand(1, 40, 1, 128), rand(1, 40, 1, 64)
    out, lse = torch.empty(1, 40, 2, 64), torch.empty(1, 2, 40)
    T._launch_fwd_sm90(q, k, v, out, lse, None, None, T._dims(q, k, None, 40, 40), AttentionArgs(0.1, right=0),
                       tiles=(32, 16))
    out64, lse64 = dense64(q, k, v, True, 0.1)
    assert rel(out, out64) < 1e-5
    assert_lse(lse, lse64, 1e-4)
