"""Optimizer benchmarks: the AdamW step (titan's fused_adamw_ through TitanOptimizer, float32 and
bfloat16 states, against torch.optim.AdamW fused and foreach), the Muon step (TitanOptimizer against
torch.optim.Muon), and Newton-Schulz (titan's backends against torch.optim.Muon's iteration) as
TFLOP/s and a share of the matmul rate measured in the same run.

Roofline of the AdamW step: it reads g, p, m, v and writes p, m, v: 28 bytes per parameter with
float32 states, 20 with bfloat16 states; the ceiling is the measured copy bandwidth. Newton-Schulz:
``titan_kernels.reference.newton_schulz.flops`` (4 r^2 c + 2 r^3 per step, r <= c: the standard
products; the Triton backend does 2/3 of them on a square matrix) against the measured matmul rate.

Shapes. CUDA: AdamW and Muon on one Llama 3 8B FFN weight (4096 x 14336); Newton-Schulz at 4096 x
4096 and 8192 x 28672 (70B's FFN) in bfloat16. CPU (``SLOW`` ones with ``pytest -m slow`` and in
``python -m bench.bench_optim``; the default test run times the small ones as a smoke test): AdamW at
the same 8B shape and over the debugmodel's parameter list; Muon at 512 x 1792; Newton-Schulz at
1024 x 1024 and 1024 x 3584 (the GPU shapes / 4 and / 8 per side, the same aspect ratios: minutes
otherwise) in float32; torch.optim.Muon's bf16 iteration not at the largest CPU shape.

``python -m bench.bench_optim [--out PREFIX]`` times the implementations alternately in one process
(median of rounds), which is what to quote from a shared machine, with the step time per billion
parameters and the ratios.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys

import pytest
import torch

import titan_kernels as tk
from bench import common
from titan_kernels.reference.newton_schulz import COEFFICIENTS, EPS, flops as ns_flops

DEV = common.device()
CUDA = DEV.type == "cuda"
# name -> parameter shapes (None: the debugmodel's parameter list). On the CPU the 8B shape has its own
# name (the GPU stage's filter then falls back to the first, small case) and is slow (pytest -m slow;
# ``python -m bench.bench_optim`` always times it).
SMALL_LIST = [(96, 64), (64,), (64, 176), (176, 64)] * 8  # the default test run's smoke case: 32 small tensors
ADAMW_SHAPES = ({"8B.ffn": [(4096, 14336)]} if CUDA else
                {"small-list": SMALL_LIST, "debugmodel": None, "8B.ffn-cpu": [(4096, 14336)]})
MUON_SHAPES = [(4096, 14336)] if CUDA else [(256, 896), (512, 1792)]
NS_SHAPES = [(4096, 4096), (8192, 28672)] if CUDA else [(256, 256), (1024, 1024), (1024, 3584)]
# Seconds per call on 2 CPU cores: out of the default test run; ``python -m bench.bench_optim`` times them.
SLOW = {"debugmodel", "8B.ffn-cpu", (512, 1792), (1024, 1024), (1024, 3584)}
MAIN_CASES = {"adamw": ["8B.ffn", "debugmodel", "8B.ffn-cpu"], "ns": [(4096, 4096), (8192, 28672), (1024, 1024),
                                                                    (1024, 3584)]}
NS_DTYPE = torch.bfloat16 if CUDA else torch.float32
ADAMW_IMPLS = ("titan", "titan-bf16-states", "torch-fused", "torch-foreach")
NS_IMPLS = ("titan", "titan-aten", "titan-triton", "torch-muon") if CUDA else ("titan", "titan-bf16", "torch-muon")
BETAS, LR, WD = (0.9, 0.95), 1e-4, 0.1


def _shapes(name: str) -> list[tuple[int, ...]]:
    if ADAMW_SHAPES[name] is not None:
        return ADAMW_SHAPES[name]
    from trainer.registry import build_model, model_args

    return [tuple(p.shape) for p in build_model(model_args("llama3", "debugmodel", 2048, 2048)).parameters()]


def _optimizer(impl: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if impl.startswith("torch"):
        kind = {"torch-fused": {"fused": True}, "torch-foreach": {"foreach": True}}[impl]
        return torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WD, **kind)
    from trainer.optim import TitanOptimizer

    return TitanOptimizer([{"params": params, "param_names": [f"p{i}" for i in range(len(params))],
                            "optimizer": "adamw", "lr": LR, "weight_decay": WD, "label": "adamw"}],
                          betas=BETAS, state_dtype="bfloat16" if impl == "titan-bf16-states" else "float32")


@functools.lru_cache(maxsize=1)
def _adamw_case(shape_name: str, impl: str):
    """(optimizer, parameter count) with gradients set and states created (one warm step)."""
    params = [torch.nn.Parameter(torch.randn(s, device=DEV)) for s in _shapes(shape_name)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = _optimizer(impl, params)
    opt.step()
    return opt, sum(p.numel() for p in params)


def _adamw_bytes(impl: str, n: int) -> float:
    return (20 if impl == "titan-bf16-states" else 28) * n


def _params(values, ids=None) -> list:
    return [pytest.param(v, marks=[pytest.mark.slow] if v in SLOW else [], id=ids(v) if ids else str(v))
            for v in values]


@pytest.mark.parametrize("impl", ADAMW_IMPLS)
@pytest.mark.parametrize("shape", _params(ADAMW_SHAPES))
def test_adamw_step(benchmark, shape, impl):
    opt, n = _adamw_case(shape, impl)
    common.run(benchmark, opt.step, op="adamw_step", impl=impl, shape=f"{shape} ({n / 1e6:.1f}M)",
               dtype="float32", bytes_moved=_adamw_bytes(impl, n))


@functools.lru_cache(maxsize=1)
def _muon_case(shape: tuple[int, int], impl: str):
    p = torch.nn.Parameter(torch.randn(shape, device=DEV))
    p.grad = torch.randn_like(p)
    if impl == "torch-muon":
        opt = torch.optim.Muon([p], lr=LR, weight_decay=WD, adjust_lr_fn="match_rms_adamw")
    else:
        from trainer.optim import TitanOptimizer

        opt = TitanOptimizer([{"params": [p], "param_names": ["w"], "optimizer": "muon", "lr": LR,
                               "weight_decay": WD, "label": "muon"}])
    opt.step()
    return opt


@pytest.mark.parametrize("impl", ("titan", "torch-muon"))
@pytest.mark.parametrize("shape", _params(MUON_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}"))
def test_muon_step(benchmark, shape, impl):
    """One Muon step of one matrix (momentum, Newton-Schulz, update): ours iterates in bf16 on GPUs
    and float32 on the CPU; torch.optim.Muon always in bf16."""
    opt = _muon_case(shape, impl)
    common.run(benchmark, opt.step, op="muon_step", impl=impl, shape=f"{shape[0]}x{shape[1]}", dtype="float32",
               flops=ns_flops(*shape), flop_dtype=NS_DTYPE)


def _ns_fn(impl: str):
    if impl == "torch-muon":
        from torch.optim._muon import _zeropower_via_newtonschulz

        return lambda g: _zeropower_via_newtonschulz(g, COEFFICIENTS, 5, EPS)
    if impl == "titan-bf16":
        return lambda g: tk.newton_schulz(g, dtype=torch.bfloat16)
    backend = {"titan": None, "titan-aten": "aten", "titan-triton": "triton"}[impl]
    return lambda g: tk.newton_schulz(g, dtype=NS_DTYPE, backend=backend)


def _ns_dtype(impl: str) -> torch.dtype:
    return torch.bfloat16 if impl in ("torch-muon", "titan-bf16") else NS_DTYPE


@pytest.mark.parametrize("impl", NS_IMPLS)
@pytest.mark.parametrize("shape", _params(NS_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}"))
def test_newton_schulz(benchmark, shape, impl):
    if impl in ("torch-muon", "titan-bf16") and not CUDA and shape == NS_SHAPES[-1]:
        pytest.skip("torch.optim.Muon iterates in bf16: minutes on a CPU without bf16 units")
    if impl == "titan-triton" and not tk.available_backends(DEV)["triton"].available:
        pytest.skip("triton unavailable")
    g = torch.randn(shape, device=DEV, dtype=NS_DTYPE)
    fn = _ns_fn(impl)
    dt = _ns_dtype(impl)
    common.run(benchmark, lambda: fn(g), op="newton_schulz", impl=impl, shape=f"{shape[0]}x{shape[1]}",
               dtype=str(dt).replace("torch.", ""), flops=ns_flops(*shape), flop_dtype=dt)


# ----------------------------------------------------------------------------- same-process comparison


def _alternate(fns: dict, rounds: int) -> dict:
    """Median seconds of each callable, timed in turn, ``rounds`` times each (common.measure per turn;
    one call per turn for a callable slower than half a second)."""
    import time

    slow = {}
    for k, fn in fns.items():
        t0 = time.perf_counter()
        fn()
        common.sync()
        slow[k] = time.perf_counter() - t0 > 0.5

    def once(fn):
        t0 = time.perf_counter()
        fn()
        common.sync()
        return time.perf_counter() - t0

    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            times[k].append(once(fn) if slow[k] else common.measure(fn))
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="AdamW / Muon step and Newton-Schulz, timed alternately in one process")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None, help="write PREFIX.json/.md (a folder: <date>-<cpu|gpu>)")
    ap.add_argument("--only", choices=("adamw", "ns"), default=None, help="time only the AdamW step or Newton-Schulz")
    ns = ap.parse_args(argv)
    rows = []
    for shape in [s for s in ADAMW_SHAPES if s in MAIN_CASES["adamw"] and ns.only != "ns"]:
        cases = {}
        for impl in ADAMW_IMPLS:
            params = [torch.nn.Parameter(torch.randn(s, device=DEV)) for s in _shapes(shape)]
            for p in params:
                p.grad = torch.randn_like(p)
            opt = _optimizer(impl, params)
            opt.step()
            cases[impl] = (opt, sum(p.numel() for p in params))
        t = _alternate({k: v[0].step for k, v in cases.items()}, ns.rounds)
        n = cases["titan"][1]
        for impl in ADAMW_IMPLS:
            row = common.Row("adamw_step", f"{shape} ({n / 1e6:.1f}M)", "float32", impl, t[impl],
                             bytes=_adamw_bytes(impl, n), gbps=_adamw_bytes(impl, n) / t[impl] / 1e9,
                             bw_share=_adamw_bytes(impl, n) / t[impl] / common.copy_bandwidth())
            rows.append(row)
            print(f"adamw_step {shape} {impl}: {t[impl] * 1e3:.2f} ms = {t[impl] / n * 1e9:.3f} s per billion params, "
                  f"{row.gbps:.1f} GB/s ({common.share_cell(row.bw_share, '%')} of copy); torch-fused / this "
                  f"{t['torch-fused'] / t[impl]:.2f}x, torch-foreach / this {t['torch-foreach'] / t[impl]:.2f}x",
                  flush=True)
        del cases
    for shape in [s for s in NS_SHAPES if s in MAIN_CASES["ns"] and ns.only != "adamw"]:
        # The ceiling, timed in the same rounds: the iteration's largest product X X^T (r x c times c x r)
        # in each dtype, so a loaded machine slows both alike.
        r, c = min(shape), max(shape)
        impls = [i for i in NS_IMPLS if not (i in ("torch-muon", "titan-bf16") and not CUDA and shape == NS_SHAPES[-1])]
        dts = sorted({_ns_dtype(i) for i in impls}, key=str)
        xs = {dt: torch.randn(r, c, device=DEV, dtype=dt) for dt in dts}
        g = torch.randn(shape, device=DEV, dtype=NS_DTYPE)
        fns = {i: (lambda fn=_ns_fn(i): fn(g)) for i in impls}
        fns.update({f"matmul-{dt}": (lambda x=xs[dt]: x @ x.T) for dt in dts})
        t = _alternate(fns, ns.rounds)
        f = ns_flops(*shape)
        for impl in impls:
            peak = 2 * r * r * c / t[f"matmul-{_ns_dtype(impl)}"]
            rows.append(common.Row("newton_schulz", f"{shape[0]}x{shape[1]}", str(_ns_dtype(impl)).replace("torch.", ""),
                                   impl, t[impl], flops=f, tflops=f / t[impl] / 1e12, flop_share=f / t[impl] / peak))
            print(f"newton_schulz {shape} {impl} ({_ns_dtype(impl)}): {t[impl] * 1e3:.1f} ms, {f / t[impl] / 1e12:.3f} "
                  f"TFLOP/s = {common.share_cell(f / t[impl] / peak, '%')} of the X X^T matmul measured alongside "
                  f"({peak / 1e12:.3f} TFLOP/s)", flush=True)
    print(common.ceilings_line())
    print(common.table(rows))
    if ns.out:
        print("wrote", common.save(ns.out, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
