"""The record and helpers of bench/gpu_correctness.py's checks (stage 3 of bench/run_gpu.sh), shared
with its attention part (bench/gpu_correctness_attention.py): the rows of relative errors against
float64 with the team's tolerances, random inputs, the backends that run on a device.

Torch is imported inside the functions: ``--dry-run`` and the report import this module cheaply.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

BF16_TOL, FP32_TOL, E4M3_TOL, E5M2_TOL = 1e-2, 1e-5, 7e-2, 1.2e-1


@dataclass
class Checks:
    prefix: str
    rows: list = field(default_factory=list)
    skipped: list = field(default_factory=list)

    def add(self, op, backend, case, quantity, got, want, tol) -> None:
        err = rel_err(got, want) if not isinstance(got, float) else got
        ok = math.isfinite(err) and err <= tol
        self.rows.append({"op": op, "backend": backend, "case": case, "quantity": quantity, "err": err,
                          "tol": tol, "ok": ok})
        if not ok:
            print(f"  FAIL {op} [{backend}] {case} {quantity}: rel. error {err:.3e} > {tol:.0e}", flush=True)

    def skip(self, what: str) -> None:
        self.skipped.append(what)
        print(f"  not run: {what}", flush=True)

    def save(self) -> None:
        from bench import gpu_report

        gpu_report.update(self.prefix, "correctness", {"rows": self.rows, "skipped": self.skipped})


def rel_err(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    if b.numel() == 0:
        return 0.0
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def tolerance(dtype) -> float:
    import torch

    return FP32_TOL if dtype == torch.float32 else BF16_TOL


def randn_as(*shape, dtype, dev, scale=1.0, shift=0.0):
    import torch

    return (torch.randn(*shape, dtype=torch.float64) * scale + shift).to(dtype).to(dev)


def device_backends(op: str, dev) -> list[str]:
    from titan_kernels import backend

    return [b for b in backend.implemented_backends(op) if backend.backend_status(b, dev).available]


def vjp(y, inputs, g):
    import torch

    return torch.autograd.grad(y, inputs, g)
