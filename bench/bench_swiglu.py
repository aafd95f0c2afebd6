"""SwiGLU benchmarks: forward, backward and forward+backward of ``tk.swiglu`` against eager
``F.silu(g) * u``, torch.compile of it and Liger-Kernel's (when installed); GPT-OSS's clamped variant
(``test_swiglu_clamped``: alpha 1.702, limit 7, up_offset 1, gate and up the interleaved columns of
one gate_up tensor as the model has them) against the eager torch composition Hugging Face's
GptOssExperts runs and torch.compile of it; plus the feed-forward question of one fused w1/w3 matmul
(``w13``) against two.

Roofline: the forward must read gate and up and write y (3·M·N·bytes); the backward reads dy, gate
and up and writes dgate and dup (5·M·N·bytes); forward+backward 8·M·N·bytes. FLOPs are negligible,
so the ceiling is the measured copy bandwidth.

CPU: the debugmodel's FFN (8·256 tokens x 768; default test run) and a quarter of Llama 3 8B's
(4096 x 14336/4; ``-m slow``), float32 and bfloat16. CUDA: Llama 3 8B's FFN hidden 14336 at 8k and 16k tokens;
the clamped variant at GPT-OSS's expert width 2880 for 16384 tokens x top-4 (65536 rows).
Run on a GPU: ``BENCH_OUT=bench/results/local/<name> pytest bench/bench_swiglu.py``.

``python -m bench.bench_swiglu`` times ours and eager alternately in one process (median of
rounds), which is what to quote from a shared machine, the clamped variant against its eager
composition, and the w13 variants the same way.
"""
from __future__ import annotations

import functools
import statistics
import sys
import time

import pytest
import torch
import torch.nn.functional as F

import titan_kernels as tk
from bench import common

DEV = common.device()
if DEV.type == "cuda":
    SHAPES = [(8192, 14336), (16384, 14336)]
    DTYPES = [torch.bfloat16]
    SLOW_SHAPES = []
else:
    SHAPES = [(8 * 256, 768), (4096, 14336 // 4)]
    DTYPES = [torch.float32, torch.bfloat16]
    SLOW_SHAPES = [(4096, 14336 // 4)]  # pytest -m slow: too long for the default run's smoke test


def eager(g, u):
    return F.silu(g) * u


GPT_OSS = {"alpha": 1.702, "limit": 7.0, "up_offset": 1.0}
if DEV.type == "cuda":
    CLAMPED_SHAPES = [(65536, 2880)]
else:
    CLAMPED_SHAPES = [(8 * 256, 768)]


def eager_clamped(g, u):
    """GPT-OSS's gate as Hugging Face's GptOssExperts._apply_gate computes it, in eager torch ops."""
    g = g.clamp(min=None, max=7.0)
    u = u.clamp(min=-7.0, max=7.0)
    return (u + 1) * (g * torch.sigmoid(g * 1.702))


def titan_clamped(g, u):
    return tk.swiglu(g, u, **GPT_OSS)


def _liger():
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except ImportError:
        return None
    return LigerSiLUMulFunction.apply


IMPLS = common.implementations(tk.swiglu, eager, backends=("triton", "cpu"), liger=_liger)
CLAMPED_IMPLS = common.implementations(titan_clamped, eager_clamped, backends=("triton", "cpu"))


@functools.lru_cache(maxsize=None)
def _inputs(m, n, dtype):
    g = torch.randn(m, n, device=DEV, dtype=dtype)
    u = torch.randn(m, n, device=DEV, dtype=dtype)
    dy = torch.randn(m, n, device=DEV, dtype=dtype)
    return g, u, dy


def _call(fn, pass_, g, u, dy):
    """(the callable to time, bytes it must move) for one pass."""
    elems_bytes = g.numel() * g.element_size()
    if pass_ == "fwd":
        return (lambda: fn(g, u)), 3 * elems_bytes
    gg = g.detach().requires_grad_()
    uu = u.detach().requires_grad_()
    if pass_ == "bwd":
        y = fn(gg, uu)
        return (lambda: torch.autograd.grad(y, (gg, uu), dy, retain_graph=True)), 5 * elems_bytes
    return (lambda: torch.autograd.grad(fn(gg, uu), (gg, uu), dy)), 8 * elems_bytes


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [pytest.param(s, marks=[pytest.mark.slow] if s in SLOW_SHAPES else [],
                                                id=f"{s[0]}x{s[1]}") for s in SHAPES])
@pytest.mark.parametrize("pass_", ["fwd", "bwd", "fwd+bwd"])
def test_swiglu(benchmark, pass_, shape, dtype, impl):
    g, u, dy = _inputs(*shape, dtype)
    call, moved = _call(IMPLS[impl], pass_, g, u, dy)
    common.run(benchmark, call, op=f"swiglu.{pass_}", impl=impl, shape=shape, dtype=dtype, bytes_moved=moved)


@functools.lru_cache(maxsize=None)
def _gate_up(m, n, dtype):
    """GPT-OSS's layout: (m, 2n) with gate the even and up the odd columns; about a quarter of the values
    beyond +-7, so both sides of each clamp are timed."""
    gu = (torch.randn(m, 2 * n, device=DEV) * 6).to(dtype)
    return gu[:, ::2], gu[:, 1::2], torch.randn(m, n, device=DEV, dtype=dtype)


def _slow_on_cpu(values, keep) -> list:
    """``values`` as pytest params, those not in ``keep`` marked slow on the CPU: the default run's smoke
    test times float32 fwd+bwd of ours and eager only; ``-m slow`` the rest (torch.compile's C++ builds,
    bf16 without bf16 units: seconds each)."""
    return [pytest.param(v, marks=[pytest.mark.slow] if DEV.type == "cpu" and v not in keep else [], id=str(v))
            for v in values]


@pytest.mark.parametrize("impl", _slow_on_cpu(list(CLAMPED_IMPLS), keep={"titan", "eager"}))
@pytest.mark.parametrize("dtype", _slow_on_cpu(DTYPES, keep={torch.float32}))
@pytest.mark.parametrize("shape", [pytest.param(s, id=f"{s[0]}x{s[1]}") for s in CLAMPED_SHAPES])
@pytest.mark.parametrize("pass_", _slow_on_cpu(["fwd", "bwd", "fwd+bwd"], keep={"fwd+bwd"}))
def test_swiglu_clamped(benchmark, pass_, shape, dtype, impl):
    g, u, dy = _gate_up(*shape, dtype)
    call, moved = _call(CLAMPED_IMPLS[impl], pass_, g, u, dy)
    common.run(benchmark, call, op=f"swiglu_clamped.{pass_}", impl=impl, shape=shape, dtype=dtype, bytes_moved=moved)


# ----------------------------------------------------------------------------- w1/w3 fused (w13)


def ffn_variants(tokens: int, dim: int, hidden: int, dtype=torch.float32, device=DEV) -> tuple[dict, list]:
    """Feed-forward fwd+bwd step functions: two matmuls (w1, w3) as the model has them, one matmul
    with a fused (2·hidden, dim) parameter, and one matmul on ``cat(w1, w3)`` made every step (keeps
    the w1/w3 checkpoint names). Returns ({name: step}, params)."""
    torch.manual_seed(0)
    x = torch.randn(tokens, dim, device=device, dtype=dtype, requires_grad=True)
    w1, w3 = ((torch.randn(hidden, dim, device=device, dtype=dtype) * dim**-0.5).requires_grad_() for _ in range(2))
    w2 = (torch.randn(dim, hidden, device=device, dtype=dtype) * hidden**-0.5).requires_grad_()
    w13 = torch.cat([w1, w3]).detach().requires_grad_()
    dy = torch.randn(tokens, dim, device=device, dtype=dtype)
    params = [x, w1, w2, w3, w13]

    def two():
        return F.linear(tk.swiglu(F.linear(x, w1), F.linear(x, w3)), w2)

    def fused():
        g, u = F.linear(x, w13).split(hidden, dim=-1)  # backward: one cat of dgate, dup
        return F.linear(tk.swiglu(g, u), w2)

    def cat_each_step():
        g, u = F.linear(x, torch.cat([w1, w3])).split(hidden, dim=-1)
        return F.linear(tk.swiglu(g, u), w2)

    def stepper(f):
        def step():
            f().backward(dy)
            for p in params:
                p.grad = None
        return step

    return {"w1,w3": stepper(two), "w13": stepper(fused), "cat(w1,w3)": stepper(cat_each_step)}, params


@pytest.mark.skipif(DEV.type != "cpu", reason="the w13 question is measured at the CPU debugmodel shape")
@pytest.mark.parametrize("variant", ["w1,w3", "w13", "cat(w1,w3)"])
def test_ffn_w13(benchmark, variant):
    steps, _ = ffn_variants(2048, 256, 768)
    flops = 3 * 2 * 2048 * 256 * 768 * 3  # three matmuls, forward + 2x backward
    common.run(benchmark, steps[variant], op="ffn.fwd+bwd", impl=variant, shape=(2048, 256, 768),
               dtype=torch.float32, flops=flops, flop_dtype=torch.float32)


# ----------------------------------------------------------------------------- paired (python -m)


def _median_time(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        common.sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def paired(fns: dict, rounds: int = 9, reps: int = 3) -> dict:
    """Median seconds per call of each function, timed alternately round after round (so a load
    change on a shared machine hits every function alike)."""
    for f in fns.values():
        f()
        f()
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            times[k].append(_median_time(f, reps))
    return {k: statistics.median(v) for k, v in times.items()}


def _table(shapes, inputs, ours_fn, eager_fn, bw: float) -> None:
    """One Markdown table: each pass of ``ours_fn`` against ``eager_fn`` at each shape and dtype
    (``inputs(m, n, dtype)`` gives gate, up, dy), timed alternately, with the bandwidth ours reaches."""
    print("| pass | shape | dtype | ours (us) | eager (us) | eager / ours | ours GB/s | % copy BW |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in shapes:
        for dtype in DTYPES:
            g, u, dy = inputs(*shape, dtype)
            for pass_ in ("fwd", "bwd", "fwd+bwd"):
                ours, moved = _call(ours_fn, pass_, g, u, dy)
                base, _ = _call(eager_fn, pass_, g, u, dy)
                t = paired({"ours": ours, "eager": base})
                print(f"| {pass_} | {shape[0]}x{shape[1]} | {str(dtype)[6:]} | {t['ours'] * 1e6:.0f} | "
                      f"{t['eager'] * 1e6:.0f} | {t['eager'] / t['ours']:.2f} | {moved / t['ours'] / 1e9:.1f} | "
                      f"{100 * moved / t['ours'] / bw:.0f} |")


def main(argv) -> None:
    bw = common.copy_bandwidth()
    print(f"device {common.environment()['device']}, threads {torch.get_num_threads()}, copy bandwidth "
          f"{bw / 1e9:.1f} GB/s")
    _table(SHAPES, _inputs, tk.swiglu, eager, bw)
    print("\nGPT-OSS's clamped SwiGLU (gate, up: the interleaved columns of one (M, 2N) tensor) against its"
          " eager torch composition:")
    _table(CLAMPED_SHAPES, _gate_up, titan_clamped, eager_clamped, bw)
    if DEV.type == "cpu" or "--w13" in argv:
        steps, _ = ffn_variants(2048, 256, 768)
        t = paired(steps, rounds=11)
        print("\nFFN fwd+bwd, tokens 2048, dim 256, hidden 768, float32:")
        for k, v in t.items():
            print(f"  {k:12s} {v * 1e3:8.2f} ms   / w1,w3: {v / t['w1,w3']:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
