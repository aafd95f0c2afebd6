"""RMSNorm benchmarks: forward, backward and forward+backward against eager PyTorch, torch.compile and
Liger-Kernel (when installed), plus the eager per-call overhead on tiny inputs.

Roofline: the op must at least read x and write y (forward: 2·M·N·bytes), and read dy, x and write
dx (backward: 3·M·N·bytes); weight and rstd are negligible at Llama sizes. FLOPs are negligible, so
the ceiling is the measured copy bandwidth.

CPU: small shapes as a smoke test (default test run). CUDA: Llama shapes, 4k-64k tokens x 4096/8192.
Run on a GPU: ``BENCH_OUT=bench/results/local/<name> pytest bench/bench_rms_norm.py``.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import titan_kernels as tk
from bench import common

DEV = common.device()
if DEV.type == "cuda":
    SHAPES = [(4096, 4096), (16384, 4096), (65536, 4096), (16384, 8192), (65536, 8192)]
    DTYPES = [torch.bfloat16]
else:
    SHAPES = [(2048, 1024)]
    DTYPES = [torch.float32]


def _liger():
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except ImportError:
        return None
    return lambda x, w, eps: LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", False)


def eager(x, w, eps):
    return F.rms_norm(x, (x.shape[-1],), w, eps)


IMPLS = common.implementations(tk.rms_norm, eager, liger=_liger)


@functools.lru_cache(maxsize=None)
def _inputs(m, n, dtype):
    x = torch.randn(m, n, device=DEV, dtype=dtype)
    w = torch.rand(n, device=DEV, dtype=dtype) + 0.5
    g = torch.randn(m, n, device=DEV, dtype=dtype)
    return x, w, g


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("pass_", ["fwd", "bwd", "fwd+bwd"])
def test_rms_norm(benchmark, pass_, shape, dtype, impl):
    m, n = shape
    x, w, g = _inputs(m, n, dtype)
    fn = IMPLS[impl]
    b = x.element_size()
    if pass_ == "fwd":
        call = lambda: fn(x, w, 1e-6)  # noqa: E731
        moved = 2 * m * n * b
    else:
        xg = x.detach().requires_grad_()
        wg = w.detach().requires_grad_()
        if pass_ == "bwd":
            y = fn(xg, wg, 1e-6)
            call = lambda: torch.autograd.grad(y, (xg, wg), g, retain_graph=True)  # noqa: E731
            moved = 3 * m * n * b
        else:
            call = lambda: torch.autograd.grad(fn(xg, wg, 1e-6), (xg, wg), g)  # noqa: E731
            moved = 5 * m * n * b
    common.run(benchmark, call, op=f"rms_norm.{pass_}", impl=impl, shape=shape, dtype=dtype, bytes_moved=moved)


@pytest.mark.skipif(DEV.type != "cpu", reason="the eager-overhead target is defined on the CPU")
@pytest.mark.parametrize("impl", ["titan", "eager"])
@pytest.mark.parametrize("grad", [False, True], ids=["nograd", "grad"])
def test_rms_norm_call_overhead(benchmark, impl, grad):
    """Per-call cost on a tiny (4, 64) input: the eager fast path against F.rms_norm."""
    x = torch.randn(4, 64, requires_grad=grad)
    w = torch.randn(64, requires_grad=grad)
    fn = IMPLS[impl]
    common.run(benchmark, lambda: fn(x, w, 1e-6), op="rms_norm.overhead", impl=impl, shape=(4, 64),
               dtype=f"float32,{'grad' if grad else 'nograd'}")
