"""MoE benchmarks: the grouped GEMM over experts (``tk.grouped_mm``, each backend, and its float8
rowwise variant ``tk.fp8_grouped_mm``) against the per-expert loop of matmuls and
``torch._grouped_mm`` itself, and the token permute/unpermute ops against the same index math in plain
torch ops.

Shapes: Qwen3-30B-A3B (dim 2048, expert hidden 768, 128 experts, top-8) on CUDA, with 8192 tokens
(65536 routed slots; the headline stage of bench/run_gpu.sh) and 8 x 4096 tokens (262144 slots; the
--full benchmarks): the gate/up GEMM (K 2048 -> N 768) and the down GEMM (768 -> 2048), bf16. On
the CPU a small MoE (2048 tokens, top-2 of 16 experts, dim 256, hidden 192), float32. Routing is a
random top-k of each token, so groups are uneven (and some experts may get none).

FLOPs: forward 2·S·K·N for S routed slots; forward+backward 3x (dx and dw). Permute/unpermute move
bytes only: the buffer (S·D) written and read plus the tokens (T·D). The float8 rows (``titan-fp8``:
the automatic backend, torch._scaled_grouped_mm on sm_90; ``titan-fp8-triton``: our kernel) take the
same bf16 inputs and include their quantization passes; their FLOP share is of the bf16 ceiling, as
bench_fp8's, and their ratios to _grouped_mm / loop are the float8 speedup over bf16.

Run on a GPU: ``BENCH_OUT=bench/results/local/<name> pytest bench/bench_moe.py`` (part of the benchmarks
stage of bench/run_gpu.sh). ``python -m bench.bench_moe``: ours, torch._grouped_mm and the loop timed
alternately in one process (median of rounds), what to quote from a shared machine.
"""
from __future__ import annotations

import functools
import sys

import pytest
import torch

import titan_kernels as tk
from bench import common
from bench.bench_swiglu import paired
from titan_kernels.ops import grouped_mm as _gmm

DEV = common.device()
if DEV.type == "cuda":
    # (tokens, top_k, experts, K, N)
    SHAPES = {"30B-A3B.w13": (8192, 8, 128, 2048, 768), "30B-A3B.w2": (8192, 8, 128, 768, 2048),
              # a training step's micro-batch, 8 x 4096 tokens (262144 routed slots): the --full benchmarks only
              "30B-A3B-32k.w13": (32768, 8, 128, 2048, 768), "30B-A3B-32k.w2": (32768, 8, 128, 768, 2048)}
    DTYPE = torch.bfloat16
    PERMUTE = (8192, 8, 128, 2048)
else:
    SHAPES = {"small.w13": (2048, 2, 16, 256, 192), "small.w2": (2048, 2, 16, 192, 256)}
    DTYPE = torch.float32
    PERMUTE = (2048, 2, 16, 256)


def _routing(tokens, top_k, experts):
    g = torch.Generator(device="cpu").manual_seed(0)
    idx = torch.rand(tokens, experts, generator=g).topk(top_k, dim=1).indices
    return idx.to(DEV)


@functools.lru_cache(maxsize=None)
def _inputs(name):
    tokens, top_k, experts, k, n = SHAPES[name]
    idx = _routing(tokens, top_k, experts)
    counts = torch.bincount(idx.reshape(-1), minlength=experts)
    offsets = counts.cumsum(0).to(torch.int32)
    s = tokens * top_k
    x = torch.randn(s, k, device=DEV, dtype=DTYPE)
    w = torch.randn(experts, k, n, device=DEV, dtype=DTYPE) * k**-0.5
    dy = torch.randn(s, n, device=DEV, dtype=DTYPE)
    return x, w, offsets, dy


def per_expert_loop(x, w, offsets):
    """The baseline: one matmul per expert over its rows (a host copy of the offsets)."""
    bounds = [0] + offsets.tolist()
    return torch.cat([x[bounds[e]:bounds[e + 1]] @ w[e] for e in range(w.shape[0])])


def _aten(x, w, offsets):
    return torch._grouped_mm(x, w, offs=offsets)


def implementations() -> dict:
    # In the order timed (the headline stage's share may run out): ours, float8, aten, then the rest;
    # the per-expert loop (the slowest) last.
    impls = {"titan": tk.grouped_mm}
    if hasattr(tk, "fp8_grouped_mm"):
        impls["titan-fp8"] = tk.fp8_grouped_mm
    if hasattr(torch, "_grouped_mm"):
        impls["_grouped_mm"] = _aten
    if DEV.type == "cuda" and tk.available_backends(DEV)["triton"].available:
        impls["titan-triton"] = common.with_backend(tk.grouped_mm, "triton")
        if hasattr(tk, "fp8_grouped_mm"):
            impls["titan-fp8-triton"] = common.with_backend(tk.fp8_grouped_mm, "triton")
    if DEV.type == "cpu":  # on CUDA the host loop of the reference is the "loop" baseline already
        impls["titan-reference"] = common.with_backend(tk.grouped_mm, "reference")
    impls["loop"] = per_expert_loop
    return impls


IMPLS = implementations()


def _usable(impl, x, w) -> str | None:
    if impl == "_grouped_mm":
        return _gmm.why_not("aten", DEV.type, DEV.index, DTYPE, x.shape[1], w.shape[2])
    return None


def _call(fn, pass_, x, w, offsets, dy):
    if pass_ == "fwd":
        return lambda: fn(x, w, offsets)
    xx, ww = x.detach().requires_grad_(), w.detach().requires_grad_()
    return lambda: torch.autograd.grad(fn(xx, ww, offsets), (xx, ww), dy)


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("pass_", ["fwd", "fwd+bwd"])
def test_grouped_mm(benchmark, pass_, shape, impl):
    x, w, offsets, dy = _inputs(shape)
    why = _usable(impl, x, w)
    if why:
        pytest.skip(f"{impl}: {why}")
    flops = 2 * x.shape[0] * x.shape[1] * w.shape[2] * (1 if pass_ == "fwd" else 3)
    common.run(benchmark, _call(IMPLS[impl], pass_, x, w, offsets, dy), op=f"grouped_mm.{pass_}", impl=impl,
               shape=f"{shape} {SHAPES[shape]}", dtype=DTYPE, flops=flops, flop_dtype=DTYPE)


# ----------------------------------------------------------------------------- permute / unpermute


def eager_permute_unpermute(x, idx, scores, experts):
    """The same routing in plain torch ops, unfused: sort, gather, weighted sum."""
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    xp = x.repeat_interleave(idx.shape[1], dim=0)[order]
    out = torch.empty_like(xp)
    out[order] = xp
    return (out.view(x.shape[0], idx.shape[1], -1) * scores.unsqueeze(-1)).sum(1)


def titan_permute_unpermute(x, idx, scores, experts):
    xp, routing = tk.moe_permute(x, idx, experts)
    return tk.moe_unpermute(xp, routing, scores)


ROUTE_IMPLS = {"titan": titan_permute_unpermute, "eager": eager_permute_unpermute}


@pytest.mark.parametrize("impl", list(ROUTE_IMPLS))
@pytest.mark.parametrize("pass_", ["fwd", "fwd+bwd"])
def test_moe_permute_unpermute(benchmark, pass_, impl):
    tokens, top_k, experts, d = PERMUTE
    idx = _routing(tokens, top_k, experts)
    x = torch.randn(tokens, d, device=DEV, dtype=DTYPE)
    scores = torch.rand(tokens, top_k, device=DEV)
    fn = ROUTE_IMPLS[impl]
    es = x.element_size()
    moved = (2 * tokens * top_k * d + 2 * tokens * d) * es
    if pass_ == "fwd":
        call = lambda: fn(x, idx, scores, experts)  # noqa: E731
    else:
        xx, ss = x.detach().requires_grad_(), scores.detach().requires_grad_()
        dout = torch.randn(tokens, d, device=DEV, dtype=DTYPE)
        call = lambda: torch.autograd.grad(fn(xx, idx, ss, experts), (xx, ss), dout)  # noqa: E731
        moved *= 2
    common.run(benchmark, call, op=f"moe_permute+unpermute.{pass_}", impl=impl,
               shape=f"T{tokens} k{top_k} E{experts} D{d}", dtype=DTYPE, bytes_moved=moved)


# ----------------------------------------------------------------------------- paired (python -m)


def main(argv) -> None:
    print(f"device {common.environment()['device']}, threads {torch.get_num_threads()}, dtype {DTYPE}")
    print("| pass | shape | ours (ms) | ours fp8 (ms) | _grouped_mm (ms) | loop (ms) | loop / ours | "
          "_grouped_mm / ours | _grouped_mm / fp8 | rel err vs float64: ours, fp8 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in SHAPES:
        x, w, offsets, dy = _inputs(name)
        y64 = per_expert_loop(x.double(), w.double(), offsets)
        errs = [((f(x, w, offsets).double() - y64).norm() / y64.norm()).item() for f in (IMPLS["titan"], IMPLS["titan-fp8"])]
        for pass_ in ("fwd", "fwd+bwd"):
            fns = {k: _call(IMPLS[k], pass_, x, w, offsets, dy) for k in ("titan", "titan-fp8", "_grouped_mm", "loop")}
            t = paired(fns, rounds=7)
            print(f"| {pass_} | {name} {SHAPES[name]} | {t['titan'] * 1e3:.2f} | {t['titan-fp8'] * 1e3:.2f} | "
                  f"{t['_grouped_mm'] * 1e3:.2f} | {t['loop'] * 1e3:.2f} | {t['loop'] / t['titan']:.2f} | "
                  f"{t['_grouped_mm'] / t['titan']:.2f} | {t['_grouped_mm'] / t['titan-fp8']:.2f} | "
                  f"{errs[0]:.1e}, {errs[1]:.1e} |")


if __name__ == "__main__":
    main(sys.argv[1:])
