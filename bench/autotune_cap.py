"""Cap Triton autotuning to the first configs of every kernel, for a time-boxed GPU run.

On a fresh machine every autotuned kernel compiles and times each of its configs at its first call
(our FlashAttention has 5 + 6 + 4, the fp8 GEMM 6 per kernel: about a minute of compiles). With
``BENCH_AUTOTUNE_CONFIGS=N`` (bench/run_gpu.sh sets 3; ``0`` or unset: no cap), :func:`install`
replaces ``triton.autotune`` by a wrapper that keeps the first N configs; by our convention the
first config of each list is its default and the next ones the likeliest winners. It must run before
the kernel modules are imported (they build their autotuners at import, the Hopper attention kernel
at its first call, all through ``triton.autotune``), so the drivers call it first thing.

What is capped is printed once, so a result is never mistaken for a full autotuning run.
"""
from __future__ import annotations

import functools
import os
import sys

ENV = "BENCH_AUTOTUNE_CONFIGS"
_installed = False


def limit() -> int:
    raw = os.environ.get(ENV, "0").strip() or "0"
    try:
        n = int(raw)
    except ValueError:
        raise SystemExit(f"{ENV}: expected an integer >= 0 (0 = no cap), got {raw!r}") from None
    if n < 0:
        raise SystemExit(f"{ENV}: expected an integer >= 0 (0 = no cap), got {n}")
    return n


def install() -> int:
    """Install the cap from ``BENCH_AUTOTUNE_CONFIGS``; returns it (0: nothing installed)."""
    global _installed
    n = limit()
    if n == 0 or _installed:
        return n
    try:
        import triton
    except ImportError:
        return 0
    if any(m.startswith("titan_kernels.triton.") for m in sys.modules):
        raise RuntimeError("bench.autotune_cap.install() must run before titan_kernels' Triton kernels are imported")
    original = triton.autotune

    @functools.wraps(original)
    def capped(configs=None, *args, **kwargs):
        configs = list(configs if configs is not None else kwargs.pop("configs"))
        return original(configs[:n], *args, **kwargs)

    triton.autotune = capped
    _installed = True
    print(f"[autotune cap] Triton autotuning limited to the first {n} config(s) of each kernel ({ENV})",
          flush=True)
    return n
