"""Grouped GEMM over experts: ``torch.ops.titan.grouped_mm`` and its backward
``torch.ops.titan.grouped_mm_backward``.

x (T, K) holds tokens sorted by expert, w (E, K, N) one weight per expert, offsets (E,) int32 the
cumulative group ends: group e is rows [offsets[e-1], offsets[e]) (offsets[-1] = 0 before it), and
y[group e] = x[group e] @ w[e]. Rows past offsets[E-1] belong to no group and come out zero (padding
a caller keeps for alignment). Math and backward: ``titan_kernels.reference.moe``.

Backends (``BACKENDS``), the choice made once per (device, dtype, K, N) key and cached:
  aten       ``torch._grouped_mm`` (CPU in torch >= 2.11: fp32/bf16/fp16; CUDA: bf16 on sm_90). It
             refuses row strides that are not a multiple of 16 bytes (K and N here), float64 and,
             on CUDA, other dtypes and architectures; whether it takes a key is asked once, by a
             tiny call of every form the op needs (forward, dx, dw), and the refusal is kept as the
             reason. The backward is aten too: dx = grouped_mm(dy, w^T) and dw with the 2-D x 2-D
             -> 3-D "offs" form. aten leaves the rows past offsets[-1] of y and dx uninitialized
             (by design, pytorch #154557; recycled memory there has poisoned MoE gradients with
             NaN, #193633): we zero them on the device, no host sync. T = 0 never reaches aten
             (its dw form rejects an empty contraction dim, pytorch PR #192497).
  triton     ours (``titan_kernels.triton.grouped_mm``): persistent, one tile queue over every group,
             TMA descriptors on sm_90; every float dtype but float64, any K/N. CPU only under
             TRITON_INTERPRET=1 (tests).
  reference  float32 PyTorch math, one matmul per group (a host loop over the offsets).
Automatic choice: CPU aten > reference (aten measured 3x faster than the per-expert loop at
(4096, 256) x 16 x (256, 192) fp32, bench/bench_moe.py). CUDA: measured - when aten and triton both
take a key, the first call of that key times both (forward, dx and dw: training's three GEMMs) on a
synthetic 16-expert problem of its K, N and dtype, and the faster one runs from then on
(``measured_order``, cached per key; ``TITAN_KERNELS_GROUPED_MM_MEASURE=0`` keeps the static order
aten > triton > reference; nothing is timed while tracing: then the static order). bench/bench_moe.py
times every backend at Qwen3-30B-A3B shapes on the GPU stage of bench/run_gpu.sh. Overrides: ``use_backend`` /
``TITAN_KERNELS_BACKEND`` with "reference", "triton", or "cpu"/"cuda" (aten's native kernel of that
device); a requested backend that cannot take the case raises RuntimeError with the reason.

Built by the op scaffold (``titan_kernels.ops._scaffold``): one autograd definition for the op path
and the eager fast path, the forward's request handed to the backward (the same key picks the same
implementation). Double backward is refused with a RuntimeError naming the op.

``fp8_grouped_mm`` is this op with float8 kernels: what depends only on the layout (validation, the
case key, the backend registration with its measured order, the fakes, the sharding rules) lives in
``titan_kernels.ops.grouped_gemm``, which both use.
"""
from __future__ import annotations

import functools

import torch

from titan_kernels import backend as _backend
from titan_kernels.ops._common import dtype_name, refuse_create_graph
from titan_kernels.ops._scaffold import Op
from titan_kernels.ops.grouped_gemm import (
    backend_report, backward_sharding_rules, case_key, fake_grads, grads_or_empty, prepare_offsets, register_backends,
    save_operands, sharding_rules, time_order, triton_why_not, validate_layout, zero_tail,
)
from titan_kernels.reference import moe as _ref

OP = "grouped_mm"
grouped_mm_def = Op(OP)
BACKENDS = ("aten", "triton", "reference")
ORDER = {"cuda": ("aten", "triton", "reference"), "cpu": ("aten", "reference")}
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# ----------------------------------------------------------------------------- backends


def _aten_b(w: torch.Tensor) -> torch.Tensor:
    # aten takes each expert's matrix row- or column-major with 16-byte strides.
    if w.stride(-1) == 1 or w.stride(-2) == 1:
        return w
    return w.contiguous()


def _aten_fwd(x, w, offsets):
    if x.shape[0] == 0:
        return x.new_empty((0, w.shape[2]))
    y = torch._grouped_mm(x.contiguous(), _aten_b(w), offs=offsets)
    return zero_tail(y, offsets)


def _aten_bwd(dy, x, w, offsets, need_dx, need_dw):
    dy = dy.contiguous()
    dx = dw = None
    if need_dx:
        if x.shape[0] == 0:
            dx = x.new_empty(x.shape)
        else:
            dx = zero_tail(torch._grouped_mm(dy, _aten_b(w).transpose(-2, -1), offs=offsets), offsets)
    if need_dw:
        if x.shape[0] == 0:
            dw = w.new_zeros(w.shape)
        else:
            # (K, T) x (T, N) -> (E, K, N), the groups cut along T; rows past the last group ignored.
            dw = torch._grouped_mm(x.contiguous().t(), dy, offs=offsets).to(w.dtype)
    return dx, dw


def _triton_fwd(x, w, offsets):
    from titan_kernels.triton import grouped_mm as _tri

    return _tri.grouped_mm_fwd(x, w, offsets)


def _triton_bwd(dy, x, w, offsets, need_dx, need_dw):
    from titan_kernels.triton import grouped_mm as _tri

    return _tri.grouped_mm_bwd(dy, x, w, offsets, need_dx, need_dw)


# Every implementation: fwd(x, w, offsets) -> y; bwd(dy, x, w, offsets, need_dx, need_dw) -> (dx, dw).
_IMPLS = {
    "aten": _backend.Kernels(_aten_fwd, _aten_bwd),
    "triton": _backend.Kernels(_triton_fwd, _triton_bwd),
    "reference": _backend.Kernels(_ref.grouped_mm_fwd, _ref.grouped_mm_bwd),
}


# ----------------------------------------------------------------------------- capabilities (cached per key)


@functools.lru_cache(maxsize=None)
def why_not(name: str, device_type: str, index: int | None, dt: torch.dtype, k: int, n: int) -> str | None:
    """None when backend ``name`` takes grouped_mm for this key, else the reason (asked once per key)."""
    if name == "reference":
        return None
    if name == "triton":
        return triton_why_not(device_type, "titan_kernels.triton.grouped_mm",
                              "takes float32/bfloat16/float16, not float64" if dt == torch.float64 else None)
    assert name == "aten", name
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if device_type not in ("cpu", "cuda"):
        return f"runs on cpu/cuda tensors, not {device_type}"
    es = dt.itemsize
    for dim, size in (("K", k), ("N", n)):
        if size * es % 16:
            return f"{dim} = {size} ({dtype_name(dt)}) is not a multiple of 16 bytes, as torch._grouped_mm's strides must be"
    # The forms the op runs, on tiny tensors of this key (torch's own checks answer: dtype, arch, ...).
    dev = torch.device(device_type, index) if index is not None else torch.device(device_type)
    try:
        x = torch.zeros(4, k, dtype=dt, device=dev)
        w = torch.zeros(2, k, n, dtype=dt, device=dev)
        offs = torch.tensor([1, 3], dtype=torch.int32, device=dev)
        torch._grouped_mm(x, w, offs=offs)
        dy = torch.zeros(4, n, dtype=dt, device=dev)
        torch._grouped_mm(dy, w.transpose(-2, -1), offs=offs)
        torch._grouped_mm(x.t(), dy, offs=offs)
    except (RuntimeError, NotImplementedError, TypeError) as e:
        return f"torch._grouped_mm refuses it: {str(e).splitlines()[0]}"
    return None


@functools.lru_cache(maxsize=None)
def measured_order(cands: tuple[str, ...], device_type: str, index: int | None, dt: torch.dtype, k: int,
                   n: int) -> tuple[str, ...]:
    """``cands`` fastest first, timed once per key by ``time_order`` (forward, dx and dw), each
    through the registry (what ``replace_impl`` installs is what is timed)."""
    def kernels(name):
        return _backend.implementation(OP, name, device_type).kernels

    return time_order(cands, device_type, index, dt, k, n,
                      lambda x, w, offs, name: kernels(name).forward(x, w, offs),
                      lambda dy, x, w, offs, name: kernels(name).backward(dy, x, w, offs, True, True))


register_backends(grouped_mm_def, _IMPLS, why_not, ORDER, measured_order)


def backend_for(x: torch.Tensor, w: torch.Tensor) -> tuple[str, dict[str, str]]:
    """(the backend grouped_mm(x, w, ...) would run, {skipped backend: reason}) under the current request."""
    return backend_report(OP, x, w)


# ----------------------------------------------------------------------------- validation


# ----------------------------------------------------------------------------- the op


def forward(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """y (T, N) in x.dtype: y[group e] = x[group e] @ w[e], rows past offsets[-1] zero. x (T, K), w
    (E, K, N) of one float dtype, offsets (E,) int32 cumulative group ends. ``backend``: the request
    (None: the one in force). See ``titan_kernels.grouped_mm``."""
    return grouped_mm_def.kernels(x.device, backend, case_key(x, w)).forward(x, w, offsets)


def backward(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, need_dx: bool,
             need_dw: bool, backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of titan::grouped_mm: dx (T, K) = dy[group e] @ w[e]^T per group (rows past the last
    group zero) and dw (E, K, N) = x[group e]^T @ dy[group e] (zero for an empty group), float32
    accumulation. A gradient not asked for comes back as an empty (T, 0) / (E, K, 0) tensor.
    ``backend``: the forward's request (the same key picks the same implementation)."""
    k = grouped_mm_def.kernels(x.device, backend, case_key(x, w))
    return grads_or_empty(*k.backward(dy, x, w, offsets, need_dx, need_dw), x, w)


def _grads(ctx, dy):
    x, w, offsets = ctx.saved_tensors
    refuse_create_graph(OP, dy, x, w)
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dx, dw = grouped_mm_def.backward(dy, x, w, offsets, need_dx, need_dw, ctx.backend)
    return (dx if need_dx else None), (dw if need_dw else None), None


grouped_mm_def.define(forward, lambda x, w, offsets, backend=None: x.new_empty((x.shape[0], w.shape[2])),
                      setup=save_operands, grads=_grads, backward=backward,
                      backward_fake=lambda dy, x, w, offsets, need_dx, need_dw, backend=None: fake_grads(
                          x, w, need_dx, need_dw),
                      sharding=lambda x, w, offsets, *rest: sharding_rules(len(rest), linear=True),
                      backward_sharding=lambda dy, x, w, offsets, *rest: backward_sharding_rules(len(rest)))


# ----------------------------------------------------------------------------- public API


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Grouped GEMM over experts: ``y[group e] = x[group e] @ w[e]``, one launch for all groups.

    Same result as ``torch._grouped_mm(x, w, offs=offsets)`` (whose layout it takes), computed with
    float32 accumulation, on any K/N/dtype (cases aten refuses run on our Triton kernel or the
    reference), with zeros in rows past the last group and the gradients of x and w.

    Args:
        x: (T, K) tokens sorted by expert, float32/bfloat16/float16 (float64: reference only); T = 0 allowed.
        w: (E, K, N) expert weights of x's dtype, row- or column-major per expert.
        offsets: (E,) int32 cumulative group ends: group e is rows [offsets[e-1], offsets[e]) with
            offsets[-1] = 0 before the first; non-decreasing, offsets[E-1] <= T; empty groups allowed.

    Returns:
        (T, N) in x.dtype; rows >= offsets[E-1] are zero.

    Raises:
        TypeError: x/w not float tensors or of different dtypes, offsets not int32.
        ValueError: wrong ranks or shapes, no experts, mixed devices, offsets not non-decreasing
            in [0, T] (checked in eager mode on CPU, where it costs no device sync).
        RuntimeError: a requested backend cannot take the case (the reason is given), or
            create_graph=True through the backward (double backward is not implemented).

    Gradients: dx[group e] = dy[group e] @ w[e]^T, dw[e] = x[group e]^T @ dy[group e].
    Source: the grouped GEMM of MoE training (torchtitan's ``torch._grouped_mm`` experts; Gale et
    al. 2022, "MegaBlocks", block-sparse grouped matmul).
    """
    validate_layout(x, w, offsets, DTYPES)
    return grouped_mm_def(x, w, prepare_offsets(x, w, offsets))
