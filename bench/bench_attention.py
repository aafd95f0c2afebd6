"""Attention benchmarks: forward and backward TFLOP/s of titan flash_attn against every SDPA backend
and FlashAttention 3 / 2 when installed.

FLOPs (FlashAttention's convention): forward 4 * batch * n_heads * seq_q * seq_k * head_dim (the two
matmuls), backward 2.5x the forward, both halved when causal. Ceiling: the measured bf16 matmul rate.

Implementations: ``titan`` (the dispatcher's automatic choice; the row's name says which backend
ran), ``titan-triton`` (our Triton kernel, forced), ``sdpa-cudnn``, ``sdpa-flash``,
``sdpa-efficient``, ``sdpa-math`` (``torch.nn.functional.scaled_dot_product_attention`` under one
backend, with ``enable_gqa``), ``fa3`` (``flash_attn_interface.flash_attn_func``) and ``fa2``
(``flash_attn.flash_attn_func``). An implementation that cannot run a shape is left out of the table
(reason printed). The backward is timed alone (``autograd.grad`` of a retained forward graph).

CUDA: bf16, head_dim 64 and 128, 16k tokens per batch (batch = 16384 / seq), n_heads = 2048 /
head_dim, seq 1k-16k, causal and not; sdpa-math only up to 2k (it materializes the scores).
CPU: one small float32 shape as a smoke test (default test run).
Run on a GPU: ``BENCH_OUT=bench/results/local/<name> pytest bench/bench_attention.py`` (bench/run_gpu.sh
does, in its own stage). ``test_dispatch_choice_report`` prints, per shape, how far the dispatcher's
choice is from the fastest implementation timed (target: within 5%).
"""
from __future__ import annotations

import functools
import importlib

import pytest
import torch
import torch.nn.functional as F

import titan_kernels as tk
from bench import common

DEV = common.device()
if DEV.type == "cuda":
    # (seq, head_dim, causal) with batch * seq = 16k tokens and n_heads * head_dim = 2048
    SHAPES = [(s, d, c) for d in (128, 64) for c in (True, False) for s in (1024, 2048, 4096, 8192, 16384)]
    DTYPE = torch.bfloat16
    TOKENS, WIDTH = 16384, 2048
else:
    SHAPES = [(128, 64, True)]
    DTYPE = torch.float32
    TOKENS, WIDTH = 256, 256
N_KV_DIV = 1  # MHA, as FlashAttention's published benchmarks; GQA runs through the same kernels


def dims(seq: int, head_dim: int) -> tuple[int, int, int, int]:
    """(batch, seq, n_heads, head_dim) of a benchmark shape."""
    return max(1, TOKENS // seq), seq, WIDTH // head_dim, head_dim


def attention_flops(batch, seq, n_heads, head_dim, causal, pass_) -> float:
    fwd = 4.0 * batch * n_heads * seq * seq * head_dim
    if causal:
        fwd /= 2
    return fwd if pass_ == "fwd" else 2.5 * fwd


def _sdpa(kind: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, kind)

    def f(q, k, v, causal):
        with sdpa_kernel([backend]):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=causal, enable_gqa=q.shape[2] != k.shape[2])
        return o.transpose(1, 2)

    return f


def _flash(modname: str, fn: str):
    try:
        mod = importlib.import_module(modname)
    except Exception:  # not installed, or a build that does not load
        return None
    func = getattr(mod, fn)

    def f(q, k, v, causal):
        out = func(q, k, v, causal=causal)
        return out[0] if isinstance(out, tuple) else out

    return f


def _titan(backend: str | None = None):
    def f(q, k, v, causal):
        return tk.flash_attn(q, k, v, causal=causal, backend=backend)

    return f


def implementations() -> dict:
    impls = {"titan": _titan()}
    if DEV.type == "cuda":
        impls["titan-triton"] = _titan("triton")
        for name, kind in (("sdpa-cudnn", "CUDNN_ATTENTION"), ("sdpa-flash", "FLASH_ATTENTION"),
                           ("sdpa-efficient", "EFFICIENT_ATTENTION"), ("sdpa-math", "MATH")):
            impls[name] = _sdpa(kind)
        for name, mod, fn in (("fa3", "flash_attn_interface", "flash_attn_func"), ("fa2", "flash_attn", "flash_attn_func")):
            f = _flash(mod, fn)
            if f is not None:
                impls[name] = f
    else:
        impls["sdpa-flash"] = _sdpa("FLASH_ATTENTION")  # aten's CPU kernel
        impls["sdpa-math"] = _sdpa("MATH")
    return impls


IMPLS = implementations()


@functools.lru_cache(maxsize=2)
def _inputs(seq, head_dim):
    b, s, h, d = dims(seq, head_dim)
    q = torch.randn(b, s, h, d, device=DEV, dtype=DTYPE)
    k = torch.randn(b, s, h // N_KV_DIV, d, device=DEV, dtype=DTYPE)
    v = torch.randn(b, s, h // N_KV_DIV, d, device=DEV, dtype=DTYPE)
    return q, k, v, torch.randn_like(q)


def _label(seq, head_dim, causal):
    b, s, h, d = dims(seq, head_dim)
    return f"b{b} s{s} h{h} d{d} {'causal' if causal else 'full'}"


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"s{s[0]}-d{s[1]}-{'causal' if s[2] else 'full'}")
@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
def test_attention(benchmark, pass_, shape, impl):
    seq, head_dim, causal = shape
    if impl == "sdpa-math" and DEV.type == "cuda" and seq > 2048:
        pytest.skip("sdpa-math materializes the (seq x seq) scores: timed up to seq 2048 only")
    q, k, v, dout = _inputs(seq, head_dim)
    fn = IMPLS[impl]
    try:
        if pass_ == "fwd":
            fn(q, k, v, causal)
            call = lambda: fn(q, k, v, causal)  # noqa: E731
        else:
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            out = fn(qg, kg, vg, causal)
            call = lambda: torch.autograd.grad(out, (qg, kg, vg), dout, retain_graph=True)  # noqa: E731
            call()
    except RuntimeError as e:  # e.g. an SDPA backend that does not take this shape
        pytest.skip(f"{impl} cannot run {_label(*shape)}: {str(e).splitlines()[0][:200]}")
    name = impl
    if impl == "titan":
        name = f"titan({tk.attention_backend(q, k, v, causal=causal, backward=pass_ == 'bwd').backend})"
    b, s, h, d = dims(seq, head_dim)
    common.run(benchmark, call, op=f"attention.{pass_}", impl=name, shape=_label(*shape), dtype=DTYPE,
               flops=attention_flops(b, s, h, d, causal, pass_), flop_dtype=torch.bfloat16)


def test_attention_matches_sdpa_math():
    """The timed implementations compute the same thing, so the table compares like with like."""
    seq, head_dim, causal = SHAPES[0]
    q, k, v, _ = _inputs(seq, head_dim)
    q, k, v = q[:1, :512], k[:1, :512], v[:1, :512]
    ref = _sdpa("MATH")(q.float(), k.float(), v.float(), causal)
    tol = 1e-5 if DTYPE == torch.float32 else 2e-2
    for name, fn in IMPLS.items():
        try:
            out = fn(q, k, v, causal)
        except RuntimeError:
            continue  # cannot run this shape: not timed either
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < tol, (name, err)


def test_dispatch_choice_report():
    """Per shape and pass: the dispatcher's time against the fastest implementation timed."""
    groups: dict[tuple, dict[str, float]] = {}
    for r in common.ROWS:
        if r.op.startswith("attention."):
            groups.setdefault((r.op, r.shape), {})[r.impl] = r.time_s
    for (op, shape), times in sorted(groups.items()):
        ours = {k: t for k, t in times.items() if k.startswith("titan(")}
        if not ours:
            continue
        (name, t), = ours.items()
        best = min(times, key=times.get)
        print(f"{op} {shape}: {name} {t * 1e3:.3f} ms, fastest {best} {times[best] * 1e3:.3f} ms, "
              f"{'within 5%' if t <= 1.05 * times[best] else f'{t / times[best]:.2f}x slower'}")
