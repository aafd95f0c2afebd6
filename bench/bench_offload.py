"""The optimizer step of CPU offload on this host: titan's ``fused_adamw_`` (the native at::vec kernel,
float32 or bfloat16 states) against ``torch.optim.AdamW(fused=True)`` on the same CPU tensors, as
seconds per billion parameters and GB/s (28 bytes per parameter with float32 states, 20 with
bfloat16 ones: ``trainer.estimate.offload.ADAMW_BYTES_PER_PARAM``).

The tensors are one Llama 3 8B block's parameters (wq, wk, wv, wo, w1, w2, w3, two norms: 218M), the
unit FSDP2 offloads and steps; ``--blocks`` scales it. Each implementation keeps its own parameters
and states; they are timed in turn, ``--rounds`` times (median), so a shared machine's load hits them
alike. Prints the machine's load average with the numbers.

    python -m bench.bench_offload [--blocks 1] [--rounds 5] [--threads N] [--out PREFIX]

bench/gpu_offload.py (the offload stage of bench/run_gpu.sh) calls :func:`cpu_adamw` on the GPU
machine's host.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import titan_kernels as tk
from bench import common

BETAS, LR, WD = (0.9, 0.95), 1e-4, 0.1
IMPLS = ("titan", "titan-bf16-states", "torch-fused")
BYTES_PER_PARAM = {"titan": 28, "titan-bf16-states": 20, "torch-fused": 28}


def block_shapes(dim: int = 4096, kv_dim: int = 1024, ffn: int = 14336) -> list[tuple[int, ...]]:
    """One Llama 3 block's parameter shapes (8B by default)."""
    return [(dim, dim), (kv_dim, dim), (kv_dim, dim), (dim, dim), (ffn, dim), (dim, ffn), (ffn, dim), (dim,), (dim,)]


def _case(impl: str, shapes: list[tuple[int, ...]]):
    """A step function of ``impl`` over fresh CPU parameters of ``shapes`` with gradients and states."""
    params = [torch.randn(s) for s in shapes]
    grads = [torch.randn(s) for s in shapes]
    if impl == "torch-fused":
        ps = [torch.nn.Parameter(p) for p in params]
        for p, g in zip(ps, grads):
            p.grad = g
        opt = torch.optim.AdamW(ps, lr=LR, betas=BETAS, weight_decay=WD, fused=True)
        return opt.step
    sdt = torch.bfloat16 if impl == "titan-bf16-states" else torch.float32
    m = [torch.zeros(s, dtype=sdt) for s in shapes]
    v = [torch.zeros(s, dtype=sdt) for s in shapes]
    state = {"step": 0}

    def step():
        state["step"] += 1
        tk.fused_adamw_(params, grads, m, v, lr=LR, beta1=BETAS[0], beta2=BETAS[1], weight_decay=WD,
                        step=state["step"], seed=0)

    return step


def cpu_adamw(shapes: list[tuple[int, ...]], rounds: int = 5, impls=IMPLS) -> dict[str, dict]:
    """{impl: {seconds, params, s_per_billion, gbps}}: each implementation's median step over
    ``rounds`` turns (after one warm-up step each)."""
    n = sum(torch.Size(s).numel() for s in shapes)
    steps = {impl: _case(impl, shapes) for impl in impls}
    for fn in steps.values():
        fn()
    times = {impl: [] for impl in impls}
    for _ in range(rounds):
        for impl, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            times[impl].append(time.perf_counter() - t0)
    out = {}
    for impl in impls:
        t = statistics.median(times[impl])
        out[impl] = {"seconds": t, "params": n, "s_per_billion": t / n * 1e9,
                     "gbps": BYTES_PER_PARAM[impl] * n / t / 1e9}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="CPU AdamW step: titan fused_adamw_ vs torch fused, per billion params")
    ap.add_argument("--blocks", type=float, default=1.0, help="Llama 3 8B blocks' worth of parameters (default 1)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default=None, help="write PREFIX.json/.md (a folder: <date>-<cpu|gpu>)")
    ns = ap.parse_args(argv)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    shapes = block_shapes()
    if ns.blocks != 1.0:  # scale the FFN width: the same kinds of tensors, fewer or more parameters
        shapes = block_shapes(ffn=max(128, int(14336 * ns.blocks)), dim=4096)
    load = common.load_average()
    res = cpu_adamw(shapes, ns.rounds)
    print(f"host: {common._cpu_name()}, {torch.get_num_threads()} threads, load average "
          f"{load} before / {common.load_average()} after; {res['titan']['params'] / 1e6:.1f}M parameters per step")
    rows = []
    for impl, r in res.items():
        ratio = res["torch-fused"]["seconds"] / r["seconds"]
        print(f"  {impl:18s} {r['seconds'] * 1e3:8.1f} ms  {r['s_per_billion']:6.3f} s per billion params  "
              f"{r['gbps']:5.1f} GB/s  torch-fused / this {ratio:.2f}x")
        rows.append(common.Row("cpu_adamw_step", f"{r['params'] / 1e6:.1f}M", "float32", impl, r["seconds"],
                               bytes=BYTES_PER_PARAM[impl] * r["params"], gbps=r["gbps"],
                               ratios={"torch-fused": ratio}))
    if ns.out:
        print("wrote", common.save(ns.out, rows))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("BENCH_DEVICE", "cpu")
    sys.exit(main())
