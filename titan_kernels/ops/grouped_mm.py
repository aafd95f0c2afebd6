"""Grouped GEMM over experts: ``torch.ops.titan.grouped_mm`` and its backward
``torch.ops.titan.grouped_mm_backward``.

x (T, K) holds tokens sorted by expert, w (E, K, N) one weight per expert, offsets (E,) int32 the
cumulative group ends: group e is rows [offsets[e-1], offsets[e]) (offsets[-1] = 0 before it), and
y[group e] = x[group e] @ w[e]. Rows past offsets[E-1] belong to no group and come out zero (padding
a caller keeps for alignment). Math and backward: ``titan_kernels.reference.moe``.

Backends (``BACKENDS``), the choice made once per (device, dtype, K, N, with-backward) key and cached:
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
take a key, the first call of that key times both (forward, plus dx and dw when a gradient is
needed) on a synthetic 16-expert problem of its K, N and dtype, and the faster one runs from then on
(``measured_order``, cached per key; ``TITAN_KERNELS_GROUPED_MM_MEASURE=0`` keeps the static order
aten > triton > reference; nothing is timed while tracing: then the static order). bench/bench_moe.py
times every backend at Qwen3-30B-A3B shapes on the GPU stage of bench/run_gpu.sh. Overrides: ``use_backend`` /
``TITAN_KERNELS_BACKEND`` with "reference", "triton", or "cpu"/"cuda" (aten's native kernel of that
device); a requested backend that cannot take the case raises RuntimeError with the reason.

One autograd definition: the eager fast path (``_FastPath``) and the op's ``register_autograd``
call the same ``_forward``, ``_setup`` and ``_grads``; the forward's backend is handed to the
backward op (its ``backend`` argument). Double backward is refused with a RuntimeError naming the op.

``fp8_grouped_mm`` is this op with float8 kernels: it shares the pieces below that take its own
functions or name (``triton_why_not``, ``time_order``, ``register_backends``, ``choose``,
``choose_for``, ``backend_report``, ``grads_or_empty``, ``fake_grads``, ``saved_grads``, ``call``).
"""
from __future__ import annotations

import functools
import importlib

import torch

from titan_kernels import backend as _backend
from titan_kernels.ops._common import (
    check_float, check_same_device, check_tensor, eager_fast_path, needs_grad, no_setup, refuse_create_graph,
    refuse_double_backward, replicate_like,
)
from titan_kernels.reference import moe as _ref

OP = "grouped_mm"
BACKENDS = ("aten", "triton", "reference")
AUTO_ORDER = {"cuda": ("aten", "triton", "reference"), "cpu": ("aten", "reference")}
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _dt(dtype) -> str:
    return str(dtype).replace("torch.", "")


# ----------------------------------------------------------------------------- backends


def _zero_tail(y: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows past the last group: zero (aten leaves them uninitialized)."""
    if y.device.type == "cpu":  # a host read of a host tensor: no sync
        y[int(offsets[-1]):].zero_()
        return y
    from titan_kernels.triton.grouped_mm import zero_rows_from

    zero_rows_from(y, offsets)
    return y


def _aten_b(w: torch.Tensor) -> torch.Tensor:
    # aten takes each expert's matrix row- or column-major with 16-byte strides.
    if w.stride(-1) == 1 or w.stride(-2) == 1:
        return w
    return w.contiguous()


def _aten_fwd(x, w, offsets):
    if x.shape[0] == 0:
        return x.new_empty((0, w.shape[2]))
    y = torch._grouped_mm(x.contiguous(), _aten_b(w), offs=offsets)
    return _zero_tail(y, offsets)


def _aten_bwd(dy, x, w, offsets, need_dx, need_dw):
    dy = dy.contiguous()
    dx = dw = None
    if need_dx:
        if x.shape[0] == 0:
            dx = x.new_empty(x.shape)
        else:
            dx = _zero_tail(torch._grouped_mm(dy, _aten_b(w).transpose(-2, -1), offs=offsets), offsets)
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


_IMPLS = {
    "aten": (_aten_fwd, _aten_bwd),
    "triton": (_triton_fwd, _triton_bwd),
    "reference": (_ref.grouped_mm_fwd, _ref.grouped_mm_bwd),
}


# ----------------------------------------------------------------------------- capabilities (cached per key)


def triton_why_not(device_type: str, module: str, refusal: str | None = None) -> str | None:
    """None when Triton runs on this device and the kernel module ``module`` imports, else the reason;
    ``refusal``, when given, is the reason once Triton runs (a case the kernel does not take)."""
    st = _backend.backend_status("triton", device_type)
    if not st.available:
        return st.reason
    if refusal is not None:
        return refusal
    try:
        importlib.import_module(module)
    except ImportError as e:
        return f"the Triton kernel does not import: {e}"
    return None


@functools.lru_cache(maxsize=None)
def why_not(name: str, device_type: str, index: int | None, dtype: str, k: int, n: int, backward: bool) -> str | None:
    """None when backend ``name`` takes grouped_mm for this key, else the reason (asked once per key)."""
    dt = getattr(torch, dtype)
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
            return f"{dim} = {size} ({_dt(dt)}) is not a multiple of 16 bytes, as torch._grouped_mm's strides must be"
    # The forms the op runs, on tiny tensors of this key (torch's own checks answer: dtype, arch, ...).
    dev = torch.device(device_type, index) if index is not None else torch.device(device_type)
    try:
        x = torch.zeros(4, k, dtype=dt, device=dev)
        w = torch.zeros(2, k, n, dtype=dt, device=dev)
        offs = torch.tensor([1, 3], dtype=torch.int32, device=dev)
        torch._grouped_mm(x, w, offs=offs)
        if backward:
            dy = torch.zeros(4, n, dtype=dt, device=dev)
            torch._grouped_mm(dy, w.transpose(-2, -1), offs=offs)
            torch._grouped_mm(x.t(), dy, offs=offs)
    except (RuntimeError, NotImplementedError, TypeError) as e:
        return f"torch._grouped_mm refuses it: {str(e).splitlines()[0]}"
    return None


MEASURE_ENV = "TITAN_KERNELS_GROUPED_MM_MEASURE"  # "0": the static order, no timing


def _time_call(fn, device: torch.device, reps: int = 10) -> float:
    """Median seconds of ``fn()`` on ``device`` (CUDA events; wall clock elsewhere)."""
    import statistics
    import time

    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_order(cands: tuple[str, ...], device_type: str, index: int | None, dtype: str, k: int, n: int,
               backward: bool, forward, backward_kernel) -> tuple[str, ...]:
    """``cands`` (backends that take the key) fastest first, each timed (``_time_call``) on a synthetic
    MoE problem of the key: 16 experts of 512 rows (a 30B-A3B-like group size), ``forward(x, w,
    offsets, name)`` (+ ``backward_kernel(dy, x, w, offsets, name)``, dx and dw, with ``backward``).
    Any failure keeps the given order."""
    dev = torch.device(device_type, index) if index is not None else torch.device(device_type)
    dt = getattr(torch, dtype)
    try:
        e, rows = 16, 512
        x = torch.randn(e * rows, k, device=dev, dtype=dt)
        w = torch.randn(e, k, n, device=dev, dtype=dt)
        dy = torch.randn(e * rows, n, device=dev, dtype=dt)
        offs = torch.arange(1, e + 1, device=dev, dtype=torch.int32) * rows

        def run(name):
            def call():
                forward(x, w, offs, name)
                if backward:
                    backward_kernel(dy, x, w, offs, name)
            return call

        times = {name: _time_call(run(name), dev) for name in cands}
    except Exception:  # noqa: BLE001 - a failed measurement must not fail the op: keep the static order
        return cands
    return tuple(sorted(cands, key=lambda name: times[name]))


@functools.lru_cache(maxsize=None)
def measured_order(cands: tuple[str, ...], device_type: str, index: int | None, dtype: str, k: int, n: int,
                   backward: bool) -> tuple[str, ...]:
    """``cands`` fastest first, timed once per key by ``time_order`` (forward, + dx and dw with
    ``backward``)."""
    return time_order(cands, device_type, index, dtype, k, n, backward,
                      lambda x, w, offs, name: _IMPLS[name][0](x, w, offs),
                      lambda dy, x, w, offs, name: _IMPLS[name][1](dy, x, w, offs, True, True))


def _may_measure(device_type: str) -> bool:
    # Timed on CUDA, where aten and our kernel are close; never while tracing or under a fake/dispatch mode.
    import os

    return (device_type == "cuda" and os.environ.get(MEASURE_ENV, "1") != "0"
            and not torch.compiler.is_compiling() and not torch._C._len_torch_dispatch_stack())


def register_backends(op: str, impls: dict, why_not, order: dict, measured) -> None:
    """``op``'s implementations in ``titan_kernels.backend``: ``impls["aten"]`` in the cpu and cuda
    families (the native kernel of each device), ``impls["triton"]``, ``impls["reference"]``, each
    asking ``why_not(name, device_type, index, *case)``; automatic order ``order``, the candidates
    that take a key (the reference aside, the fallback, never timed) reordered on CUDA by
    ``measured(cands, device_type, index, *case)`` (a ``measured_order``)."""
    def ask(name):
        return lambda device, case: why_not(name, device.type, device.index, *case)

    def rank(device: torch.device, case: tuple, names: tuple[str, ...]) -> tuple[str, ...]:
        fast = tuple(c for c in names if c != "reference")
        if len(fast) > 1 and _may_measure(device.type):
            return measured(fast, device.type, device.index, *case)
        return names

    for fam in ("cpu", "cuda"):
        _backend.register_impl(op, fam, impls["aten"], name="aten", why_not=ask("aten"))
    _backend.register_impl(op, "triton", impls["triton"], why_not=ask("triton"))
    _backend.register_impl(op, "reference", impls["reference"], why_not=ask("reference"))
    _backend.set_order(op, order, rank=rank)


register_backends(OP, _IMPLS, why_not, AUTO_ORDER, measured_order)


@torch.compiler.assume_constant_result
def choose(device_type: str, index: int, dtype: str, k: int, n: int, backward: bool, op: str = OP) -> str:
    """The backend of a call of ``op`` (grouped_mm or fp8_grouped_mm; one of its ``BACKENDS``), chosen
    by ``titan_kernels.backend``: the request (use_backend / TITAN_KERNELS_BACKEND; "cpu"/"cuda" mean
    aten) or the first of the automatic order that takes the key (measured on CUDA). Under
    torch.compile it is decided once, when the graph is traced. ``index`` -1: no device index. Raises
    RuntimeError (with the reason) when a requested backend cannot take the key."""
    dev = torch.device(device_type, index) if index >= 0 else torch.device(device_type)
    return _backend.choose(op, dev, (dtype, k, n, backward)).backend


def _local(t: torch.Tensor) -> torch.Tensor:
    # A DTensor's kernel runs on its local shard: capabilities (16-byte rows) are those of the shard.
    return getattr(t, "_local_tensor", t)


def _case(x: torch.Tensor, w: torch.Tensor, backward: bool) -> tuple[torch.device, tuple]:
    """(device, case key (dtype, K, N, with-backward)) of a call, from the local shards."""
    x, w = _local(x), _local(w)
    return x.device, (_dt(x.dtype), int(x.shape[1]), int(w.shape[2]), backward)


def choose_for(op: str, x: torch.Tensor, w: torch.Tensor, backward: bool) -> str:
    """``choose`` for a call of ``op`` on (x, w)."""
    d, case = _case(x, w, backward)
    return choose(d.type, -1 if d.index is None else d.index, *case, op=op)


def _choose_for(x: torch.Tensor, w: torch.Tensor, backward: bool) -> str:
    return choose_for(OP, x, w, backward)


def backend_report(op: str, x: torch.Tensor, w: torch.Tensor, backward: bool) -> tuple[str, dict[str, str]]:
    """(the backend a call of ``op`` on (x, w) would run, {skipped backend: reason}) under the current request."""
    choice = _backend.choose(op, *_case(x, w, backward))
    return choice.backend, dict(choice.skipped)


def backend_for(x: torch.Tensor, w: torch.Tensor, backward: bool = True) -> tuple[str, dict[str, str]]:
    """(the backend grouped_mm(x, w, ...) would run, {skipped backend: reason}) under the current request."""
    return backend_report(OP, x, w, backward)


# ----------------------------------------------------------------------------- validation


def _validate(x, w, offsets) -> None:
    check_float(x, "x", DTYPES)
    check_float(w, "w", DTYPES)
    check_tensor(offsets, "offsets")
    if x.dim() != 2:
        raise ValueError(f"x: expected 2 dims (tokens T, K), got shape {tuple(x.shape)}")
    if w.dim() != 3:
        raise ValueError(f"w: expected 3 dims (experts E, K, N), got shape {tuple(w.shape)}")
    if w.dtype != x.dtype:
        raise TypeError(f"w: expected dtype {_dt(x.dtype)} (the dtype of x), got {_dt(w.dtype)}")
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"w: expected shape (E, {x.shape[1]}, N) (K = x.shape[1]), got {tuple(w.shape)}")
    if w.shape[0] < 1:
        raise ValueError(f"w: expected at least one expert, got shape {tuple(w.shape)}")
    if offsets.dtype != torch.int32:
        raise TypeError(f"offsets: expected dtype int32 (cumulative group ends), got {_dt(offsets.dtype)}")
    if offsets.dim() != 1 or offsets.shape[0] != w.shape[0]:
        raise ValueError(f"offsets: expected shape ({w.shape[0]},) (one end per expert), got {tuple(offsets.shape)}")
    check_same_device({"x": x, "w": w, "offsets": offsets})


def _validate_values(x, offsets) -> None:
    """Group ends non-decreasing in [0, T]: checked where it costs no device sync (eager, CPU)."""
    if offsets.device.type != "cpu" or offsets.numel() == 0:
        return
    o = offsets.tolist()
    if o[0] < 0 or any(b < a for a, b in zip(o, o[1:])) or o[-1] > x.shape[0]:
        raise ValueError(f"offsets: expected non-decreasing group ends in [0, {x.shape[0]}] (T), got {o}")


# ----------------------------------------------------------------------------- forward / backward functions
# The only functions that run kernels; the ops and the eager fast path call them.


def _forward(x, w, offsets, backend: str) -> torch.Tensor:
    return _IMPLS[backend][0](x, w, offsets)


def _backward_kernel(dy, x, w, offsets, need_dx, need_dw, backend: str):
    return _IMPLS[backend][1](dy, x, w, offsets, need_dx, need_dw)


def grads_or_empty(dx, dw, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw) as a backward op returns them: a gradient not asked for (None) as an empty (T, 0) /
    (E, K, 0) tensor."""
    if dx is None:
        dx = x.new_empty((x.shape[0], 0))
    if dw is None:
        dw = w.new_empty((w.shape[0], w.shape[1], 0))
    return dx, dw


def fake_grads(x: torch.Tensor, w: torch.Tensor, need_dx: bool, need_dw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The fake (dx, dw) of a backward op: (T, K) / (E, K, N), or empty where not asked for."""
    return (
        x.new_empty((x.shape[0], x.shape[1] if need_dx else 0)),
        w.new_empty((w.shape[0], w.shape[1], w.shape[2] if need_dw else 0)),
    )


# ----------------------------------------------------------------------------- ops


@torch.library.custom_op("titan::grouped_mm", mutates_args=())
def grouped_mm_op(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """y (T, N) in x.dtype: y[group e] = x[group e] @ w[e], rows past offsets[-1] zero. x (T, K), w
    (E, K, N) of one float dtype, offsets (E,) int32 cumulative group ends. ``backend``: one of
    BACKENDS (None: the automatic choice). See ``titan_kernels.grouped_mm``."""
    if backend is None:
        backend = _choose_for(x, w, False)
    return _forward(x, w, offsets, backend)


@grouped_mm_op.register_fake
def _(x, w, offsets, backend=None):
    return x.new_empty((x.shape[0], w.shape[2]))


@torch.library.custom_op("titan::grouped_mm_backward", mutates_args=())
def grouped_mm_backward_op(
    dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
    need_dx: bool, need_dw: bool, backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of titan::grouped_mm: dx (T, K) = dy[group e] @ w[e]^T per group (rows past the last
    group zero) and dw (E, K, N) = x[group e]^T @ dy[group e] (zero for an empty group), float32
    accumulation. A gradient not asked for comes back as an empty (T, 0) / (E, K, 0) tensor.
    ``backend``: the forward's (None: the automatic choice)."""
    if backend is None:
        backend = _choose_for(x, w, True)
    return grads_or_empty(*_backward_kernel(dy, x, w, offsets, need_dx, need_dw, backend), x, w)


@grouped_mm_backward_op.register_fake
def _(dy, x, w, offsets, need_dx, need_dw, backend=None):
    return fake_grads(x, w, need_dx, need_dw)


# ----------------------------------------------------------------------------- autograd (one definition)


def _setup(ctx, inputs, output):
    x, w, offsets, backend = inputs
    ctx.save_for_backward(x, w, offsets)
    # The forward's choice, handed to the backward (a direct op call with None resolves it here).
    ctx.backend = backend if backend is not None else _choose_for(x, w, True)


def saved_grads(ctx, dy, name: str, run, *args, why: str = ""):
    """(dx, dw) of a grouped GEMM's backward from ``ctx`` (x, w, offsets saved, ``ctx.backend``), None
    where no gradient is needed: ``run(dy, x, w, offsets, *args, need_dx, need_dw, backend)`` (the
    backward kernel or the backward op). Double backward is refused naming ``name`` (+ ``why``)."""
    x, w, offsets = ctx.saved_tensors
    refuse_create_graph(name, dy, x, w, why=why)
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dx, dw = run(dy, x, w, offsets, *args, need_dx, need_dw, ctx.backend)
    return (dx if need_dx else None), (dw if need_dw else None)


def _grads(ctx, dy, fast: bool):
    return saved_grads(ctx, dy, OP, _backward_kernel if fast else torch.ops.titan.grouped_mm_backward)


def _backward(ctx, dy):
    dx, dw = _grads(ctx, dy, fast=False)
    return dx, dw, None, None


grouped_mm_op.register_autograd(_backward, setup_context=_setup)
grouped_mm_backward_op.register_autograd(refuse_double_backward("grouped_mm_backward", of=OP), setup_context=no_setup)


class _FastPath(torch.autograd.Function):
    """The eager fast path of titan::grouped_mm and titan::fp8_grouped_mm: the op's own ``_forward``,
    ``_setup`` and ``_grads`` (``fns``), without the dispatcher. ``args``: the op's arguments after
    the offsets, the backend last."""

    @staticmethod
    def forward(ctx, x, w, offsets, fns, *args):
        forward, setup, ctx.grads = fns
        y = forward(x, w, offsets, args[-1])
        setup(ctx, (x, w, offsets, *args), y)
        ctx.n_args = len(args)
        return y

    @staticmethod
    def backward(ctx, dy):
        dx, dw = ctx.grads(ctx, dy, fast=True)
        return (dx, dw, None, None) + (None,) * ctx.n_args


def call(op: str, op_fn, fns: tuple, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, *args) -> torch.Tensor:
    """A validated call of ``op`` (grouped_mm or fp8_grouped_mm): its backend chosen (with the backward
    when a gradient is needed), then in plain eager mode the offsets' values checked and ``fns`` (the
    op's ``_forward``, ``_setup``, ``_grads``) run through ``_FastPath`` (``_forward`` alone without a
    gradient); otherwise ``op_fn`` (the registered op) on (x, w, offsets, *args, backend), the
    offsets replicated next to a DTensor x."""
    grad = needs_grad(x, w)
    backend = choose_for(op, x, w, grad)
    if eager_fast_path(x, w, offsets) and not x.is_meta:  # meta tensors: the op's fake gives the shape
        _validate_values(x, offsets)
        if grad:
            return _FastPath.apply(x, w, offsets, fns, *args, backend)
        return fns[0](x, w, offsets, backend)
    if torch.distributed.is_available():
        offsets = replicate_like(x, offsets)
    return op_fn(x, w, offsets, *args, backend)


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
    _validate(x, w, offsets)
    return call(OP, torch.ops.titan.grouped_mm, (_forward, _setup, _grads), x, w, offsets)
