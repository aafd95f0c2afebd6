"""Newton-Schulz orthogonalisation: ``torch.ops.titan.newton_schulz`` (Muon's inner iteration).

Math: ``titan_kernels.reference.newton_schulz`` (Jordan et al. 2024; the quintic of
``torch.optim.Muon``): 5 steps X <- a X + (b A + c A^2) X with A = X X^T on G / ||G||_F, on every
matrix of a (..., m, n) batch (MoE experts: one matrix per expert).

Backends (automatic order, fastest first):
  CPU   ``aten``: torch's matmuls (addmm / baddbmm, the iteration dtype), then ``reference``.
  CUDA  ``aten`` (cuBLAS) and ``triton`` (symmetric products: 2/3 of the FLOPs, see
        ``titan_kernels.triton.newton_schulz``), ranked by a one-time measurement per (dtype,
        shape bucket) on the device; then ``reference``.
The reference computes in float32 whatever ``dtype`` asks (the ground truth); the others iterate in
``dtype`` (float32 / bfloat16 / float16) with float32 accumulation.

No autograd: the op is an optimizer step's transform (inputs needing grad are refused). DTensor (the
rule beside the op): leading (batch) dims may be sharded and run locally; the matrix dims
must be whole, so a matrix sharded there is gathered by DTensor first (the distributed Muon in
``trainer.optim`` gathers each matrix on one rank instead).
"""
from __future__ import annotations

import functools
import math
import os
from typing import Optional

import torch

from titan_kernels import backend as _backend
from titan_kernels.ops._common import FLOAT_DTYPES, check_float
from titan_kernels.ops import _common
from titan_kernels.ops._scaffold import Op
from titan_kernels.reference import newton_schulz as _ref

OP = "newton_schulz"
newton_schulz_def = Op(OP)
MEASURE_ENV = "TITAN_KERNELS_MEASURE"  # "0": keep the static order on CUDA (no timing)


def _aten(g, steps, a, b, c, eps, dtype):
    """The iteration with aten's matmuls in ``dtype`` (addmm / baddbmm fuse the axpy epilogues)."""
    if g.numel() == 0:
        return torch.zeros_like(g, memory_format=torch.contiguous_format)
    x, tall = _ref.normalized_wide(g, eps, dtype)
    lead = x.shape[:-2]
    x = x.reshape(-1, *x.shape[-2:])
    for _ in range(steps):
        am = torch.bmm(x, x.mT)
        bm = torch.baddbmm(am, am, am, beta=b, alpha=c)
        x = torch.baddbmm(x, bm, x, beta=a)
    x = x.reshape(*lead, *x.shape[-2:])
    return (x.mT if tall else x).to(g.dtype).contiguous()


def _reference(g, steps, a, b, c, eps, dtype):
    return _ref.newton_schulz(g, steps, a, b, c, eps)


def _triton(g, steps, a, b, c, eps, dtype):
    from titan_kernels.triton import newton_schulz as _tri

    return _tri.newton_schulz(g, steps, a, b, c, eps, dtype)


def _triton_why_not(device: torch.device, case) -> str | None:
    st = _backend.backend_status("triton", device)  # first: where Triton cannot run, triton is not imported
    if not st.available:
        return st.reason
    try:
        import titan_kernels.triton.newton_schulz  # noqa: F401
    except ImportError as e:
        return f"the Triton kernels do not import: {e}"
    return None


def _aten_why_not(device: torch.device, case) -> str | None:
    return None if device.type in ("cpu", "cuda") else f"no aten matmul path for {device.type}"


def _bucket(m: int, n: int) -> tuple[int, int]:
    # Shapes within a factor of 2 share one measurement.
    return (1 << max(0, int(m - 1).bit_length()), 1 << max(0, int(n - 1).bit_length()))


@functools.lru_cache(maxsize=None)
def _measured(cands: tuple[str, ...], index: int | None, dtype: str, m: int, n: int) -> tuple[str, ...]:
    """``cands`` fastest first, timed once per (dtype, shape bucket) on a (m, n) matrix, each through
    the registry; any failure keeps the given order."""
    dev = torch.device("cuda", index) if index is not None else torch.device("cuda")
    dt = getattr(torch, dtype)
    try:
        g = torch.randn(m, n, device=dev, dtype=dt)
        fns = {name: _backend.implementation(OP, name, dev).kernels.forward for name in cands}
        times = {name: _common.time_call(lambda name=name: fns[name](g, 5, *_ref.COEFFICIENTS, _ref.EPS, dt), dev, reps=3)
                 for name in cands}
    except Exception:  # noqa: BLE001 - a failed measurement keeps the static order
        return cands
    return tuple(sorted(cands, key=lambda name: times[name]))


def _rank(device: torch.device, case, names: tuple[str, ...]) -> tuple[str, ...]:
    fast = tuple(x for x in names if x != "reference")
    if (len(fast) > 1 and device.type == "cuda" and os.environ.get(MEASURE_ENV, "1") != "0"
            and not torch.compiler.is_compiling() and not torch._C._len_torch_dispatch_stack()):
        order = _measured(fast, device.index, *case)
        return order + tuple(x for x in names if x not in order)
    return names


newton_schulz_def.register("reference", _reference)
newton_schulz_def.register_native(_aten, name="aten", why_not=_aten_why_not)
newton_schulz_def.register("triton", _triton, why_not=_triton_why_not)
ORDER = {"cpu": ("aten", "reference"), "cuda": ("triton", "aten", "reference")}
newton_schulz_def.set_order(ORDER, rank=_rank)


# ----------------------------------------------------------------------------- validation


def _validate(g, steps, coefficients, eps, dtype) -> None:
    check_float(g, "g", FLOAT_DTYPES + (torch.float64,))
    if g.dim() < 2:
        raise ValueError(f"g: expected at least 2 dims (..., m, n), got shape {tuple(g.shape)}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps: expected an integer >= 0, got {steps!r}")
    if (not isinstance(coefficients, (tuple, list)) or len(coefficients) != 3
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                       for v in coefficients)):
        raise ValueError(f"coefficients: expected three finite numbers (a, b, c), got {coefficients!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"eps: expected a finite value > 0, got {eps!r}")
    if dtype is not None and dtype not in FLOAT_DTYPES + (torch.float64,):
        raise TypeError(f"dtype: expected float32, bfloat16, float16 or float64, got {dtype}")
    if g.requires_grad and torch.is_grad_enabled():
        raise RuntimeError("newton_schulz: g requires grad; the op has no autograd (call it under torch.no_grad())")


# ----------------------------------------------------------------------------- the op


def forward(g: torch.Tensor, steps: int, a: float, b: float, c: float, eps: float,
            dtype: Optional[torch.dtype] = None, backend: Optional[str] = None) -> torch.Tensor:
    """Newton-Schulz of every matrix of g (..., m, n); see ``titan_kernels.newton_schulz``."""
    dt = dtype or g.dtype
    key = (str(dt).replace("torch.", ""), *_bucket(g.shape[-2], g.shape[-1]))
    return newton_schulz_def.kernels(g.device, backend, key).forward(g, steps, a, b, c, eps, dt)


def _sharding(g, *scalars):
    """Each matrix of the batch is orthogonalised on its own: the leading (batch) dims, e.g. MoE
    experts split by expert parallel, shard freely; the two matrix dims must be whole (a matrix split
    there is all-gathered by DTensor; the distributed Muon gathers it on one rank instead)."""
    from torch.distributed.tensor import Replicate, Shard

    flags = [None] * len(scalars)
    return [([p], [p, *flags]) for p in (Replicate(), *map(Shard, range(len(g.shape) - 2)))]


# Not differentiable: an optimizer's step (the public function refuses a g that requires grad).
newton_schulz_def.define(forward, lambda g, *args: torch.empty(g.shape, dtype=g.dtype, device=g.device),
                         sharding=_sharding, differentiable=False)


def newton_schulz(g: torch.Tensor, *, steps: int = _ref.STEPS, coefficients: tuple = _ref.COEFFICIENTS,
                  eps: float = _ref.EPS, dtype: torch.dtype | None = None, backend: str | None = None) -> torch.Tensor:
    """Orthogonalise every matrix of ``g`` by ``steps`` Newton-Schulz iterations (Muon's update).

    Args:
        g: (..., m, n) float32 / bfloat16 / float16 (float64 on the reference and aten paths), any
            strides; leading dims are a batch (e.g. MoE experts (E, in, out): one matrix per expert).
            Zero-size allowed. A DTensor may be sharded on the leading dims only (else DTensor
            gathers the matrices first).
        steps: iterations (5 in Muon).
        coefficients: (a, b, c) of the quintic (default Jordan's 3.4445, -4.7750, 2.0315).
        eps: the floor of the Frobenius norm G is divided by. The result is scale-invariant (the
            same for G and c G, c > 0) for every finite G with ||G||_F >= eps, huge norms included
            (the norm is taken after dividing by a power of two, so its square cannot overflow); a
            matrix with ||G||_F < eps, e.g. zero, is divided by eps instead (zero gives zero, a tiny
            G a tiny result, not an orthogonal one). Non-finite entries give NaN.
        dtype: the dtype the iteration runs in (default g's); bf16 on GPUs is Muon's practice.
            The reference backend always computes in float32.
        backend: "aten", "triton", "reference" (or a family: "cpu", "cuda") or None (automatic).

    Returns:
        (..., m, n) contiguous, g's dtype: approximately U V^T of g's SVD (singular values of the
        result in about [0.7, 1.2] after 5 steps, not exactly 1: Jordan's coefficients trade that
        for speed).

    Raises:
        TypeError: g not a float tensor, a bad ``dtype``.
        ValueError: g with fewer than 2 dims, steps < 0, coefficients not 3 finite numbers, eps <= 0.
        RuntimeError: g requires grad under grad mode (no autograd), or the requested backend
            cannot run here.

    Source: K. Jordan et al., "Muon: An optimizer for hidden layers in neural networks" (2024);
    J. Liu et al., "Muon is Scalable for LLM Training" (arXiv 2502.16982), section 2.
    """
    _validate(g, steps, coefficients, eps, dtype)
    a, b, c = (float(v) for v in coefficients)
    return newton_schulz_def.call(g, steps, a, b, c, float(eps), dtype, backend)
