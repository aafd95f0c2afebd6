"""Rotary embedding benchmarks: forward, backward and forward+backward of apply_rotary_emb against
the eager rotate-half formula (as Hugging Face writes it), the same formula under torch.compile and
Liger-Kernel's RoPE (when installed).

Roofline: the op must at least read q and k and write their rotated copies (2 * (n_heads +
n_kv_heads) * head_dim * bytes per token), plus one float32 cos and sin row per distinct position;
the backward moves the same bytes. FLOPs are negligible, so the ceiling is the measured copy
bandwidth.

Implementations: ``titan`` (automatic backend, Hugging Face layout, like the baselines),
``titan-meta`` (the same in the interleaved layout), ``titan-<backend>`` for each available native or
Triton backend (not the Triton interpreter), ``eager``, ``compile`` and ``liger``.

CPU: one small shape as a smoke test (default test run). CUDA: bf16, head_dim 128, 4k-64k tokens
with 32/8 and 64/8 heads. Run on a GPU: ``BENCH_OUT=bench/results/local/<name> pytest bench/bench_rotary.py``.
"""
from __future__ import annotations

import functools

import pytest
import torch

import titan_kernels as tk
from bench import common

DEV = common.device()
HEAD_DIM = 128 if DEV.type == "cuda" else 64
if DEV.type == "cuda":
    # (batch, seq, n_heads, n_kv_heads): 4k, 16k and 64k tokens; Llama 3 8B (32/8) and 70B (64/8) heads
    SHAPES = [(1, 4096, 32, 8), (4, 4096, 32, 8), (8, 8192, 32, 8), (4, 4096, 64, 8), (8, 8192, 64, 8)]
    DTYPES = [torch.bfloat16]
else:
    SHAPES = [(2, 256, 8, 2)]
    DTYPES = [torch.float32]


def eager_rope(q, k, cos, sin, interleaved=False):
    """The rotate-half formula as Hugging Face writes it (in the input dtype), for (B, S, H, D)."""
    seq = q.shape[1]
    c = torch.cat((cos[:seq], cos[:seq]), -1).to(q.dtype)[None, :, None, :]
    s = torch.cat((sin[:seq], sin[:seq]), -1).to(q.dtype)[None, :, None, :]

    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s


def _liger():
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
    except ImportError:
        return None

    def liger(q, k, cos, sin, interleaved=False):
        # Liger takes (B, H, S, D) and full-width (1, S, D) tables; a transposed view costs no copy.
        seq = q.shape[1]
        c = torch.cat((cos[:seq], cos[:seq]), -1).to(q.dtype)[None]
        s = torch.cat((sin[:seq], sin[:seq]), -1).to(q.dtype)[None]
        qo, ko = LigerRopeFunction.apply(q.transpose(1, 2), k.transpose(1, 2), c, s)
        return qo.transpose(1, 2), ko.transpose(1, 2)

    return liger


def _titan(interleaved: bool = False):
    def f(q, k, cos, sin):
        return tk.apply_rotary_emb(q, k, cos, sin, interleaved=interleaved)

    return f


IMPLS = common.implementations(_titan(), eager_rope, liger=_liger, extra={"titan-meta": _titan(interleaved=True)})


@functools.lru_cache(maxsize=None)
def _inputs(batch, seq, n_heads, n_kv_heads, dtype):
    q = torch.randn(batch, seq, n_heads, HEAD_DIM, device=DEV, dtype=dtype)
    k = torch.randn(batch, seq, n_kv_heads, HEAD_DIM, device=DEV, dtype=dtype)
    cos, sin = tk.rope_cos_sin(HEAD_DIM, seq, 500000.0, device=DEV)
    return q, k, cos, sin, torch.randn_like(q), torch.randn_like(k)


def _bytes(batch, seq, n_heads, n_kv_heads, dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    qk = 2 * batch * seq * (n_heads + n_kv_heads) * HEAD_DIM * elem  # read q, k; write the outputs
    tables = 2 * seq * (HEAD_DIM // 2) * 4  # one cos and one sin row per distinct position
    return qk + tables


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("pass_", ["fwd", "bwd", "fwd+bwd"])
def test_rotary(benchmark, pass_, shape, dtype, impl):
    q, k, cos, sin, gq, gk = _inputs(*shape, dtype)
    fn = IMPLS[impl]
    moved = _bytes(*shape, dtype)
    if pass_ == "fwd":
        call = lambda: fn(q, k, cos, sin)  # noqa: E731
    else:
        qg, kg = q.detach().requires_grad_(), k.detach().requires_grad_()
        if pass_ == "bwd":
            out = fn(qg, kg, cos, sin)
            call = lambda: torch.autograd.grad(out, (qg, kg), (gq, gk), retain_graph=True)  # noqa: E731
        else:
            call = lambda: torch.autograd.grad(fn(qg, kg, cos, sin), (qg, kg), (gq, gk))  # noqa: E731
            moved *= 2
    label = f"b{shape[0]} s{shape[1]} h{shape[2]}/{shape[3]} d{HEAD_DIM}"
    common.run(benchmark, call, op=f"rotary.{pass_}", impl=impl, shape=label, dtype=dtype, bytes_moved=moved)


def test_rotary_matches_eager_baseline():
    """The timed implementations compute the same thing (HF layout), so the table compares like with like."""
    shape = SHAPES[0]
    q, k, cos, sin, _, _ = _inputs(*shape, DTYPES[0])
    ref_q, ref_k = eager_rope(q.float(), k.float(), cos, sin)
    tol = 1e-5 if DTYPES[0] == torch.float32 else 2e-2
    for name, fn in IMPLS.items():
        if name == "titan-meta":
            continue  # another layout
        qo, ko = fn(q.clone(), k.clone(), cos, sin)  # clones: Liger rotates in place
        torch.testing.assert_close(qo.float(), ref_q, rtol=tol, atol=tol, msg=name)
        torch.testing.assert_close(ko.float(), ref_k, rtol=tol, atol=tol, msg=name)
