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

``fp8_grouped_mm`` is this op with float8 kernels: it shares the backend registration, capability
probes and measured order below (``triton_why_not``, ``time_order``, ``register_backends``,
``backend_report``, ``grads_or_empty``, ``fake_grads``, ``case_key``).
"""
from __future__ import annotations

import functools
import importlib

import torch

from titan_kernels import backend as _backend
from titan_kernels.ops._common import (
    check_float, check_same_device, check_tensor, dtype_name, eager_fast_path, refuse_create_graph, replicate_like,
)
from titan_kernels.ops import _common
from titan_kernels.ops._scaffold import Op
from titan_kernels.reference import moe as _ref

OP = "grouped_mm"
grouped_mm_def = Op(OP)
BACKENDS = ("aten", "triton", "reference")
AUTO_ORDER = {"cuda": ("aten", "triton", "reference"), "cpu": ("aten", "reference")}
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


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


# Every implementation: fwd(x, w, offsets) -> y; bwd(dy, x, w, offsets, need_dx, need_dw) -> (dx, dw).
_IMPLS = {
    "aten": _backend.Kernels(_aten_fwd, _aten_bwd),
    "triton": _backend.Kernels(_triton_fwd, _triton_bwd),
    "reference": _backend.Kernels(_ref.grouped_mm_fwd, _ref.grouped_mm_bwd),
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


MEASURE_ENV = "TITAN_KERNELS_GROUPED_MM_MEASURE"  # "0": the static order, no timing


def time_order(cands: tuple[str, ...], device_type: str, index: int | None, dt: torch.dtype, k: int, n: int,
               forward, backward_kernel) -> tuple[str, ...]:
    """``cands`` (backends that take the key) fastest first, each timed (``_common.time_call``) on a synthetic
    MoE problem of the key: 16 experts of 512 rows (a 30B-A3B-like group size), ``forward(x, w,
    offsets, name)`` + ``backward_kernel(dy, x, w, offsets, name)`` (dx and dw). Any failure keeps
    the given order."""
    dev = torch.device(device_type, index) if index is not None else torch.device(device_type)
    try:
        e, rows = 16, 512
        x = torch.randn(e * rows, k, device=dev, dtype=dt)
        w = torch.randn(e, k, n, device=dev, dtype=dt)
        dy = torch.randn(e * rows, n, device=dev, dtype=dt)
        offs = torch.arange(1, e + 1, device=dev, dtype=torch.int32) * rows

        def run(name):
            def call():
                forward(x, w, offs, name)
                backward_kernel(dy, x, w, offs, name)
            return call

        times = {name: _common.time_call(run(name), dev) for name in cands}
    except Exception:  # noqa: BLE001 - a failed measurement must not fail the op: keep the static order
        return cands
    return tuple(sorted(cands, key=lambda name: times[name]))


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


def case_key(x: torch.Tensor, w: torch.Tensor) -> tuple:
    """The case key of a call (dtype, K, N): what the capabilities and the measured order depend on."""
    x, w = getattr(x, "_local_tensor", x), getattr(w, "_local_tensor", w)  # a DTensor runs on its shard
    return x.dtype, int(x.shape[1]), int(w.shape[2])


def backend_report(op: str, x: torch.Tensor, w: torch.Tensor) -> tuple[str, dict[str, str]]:
    """(the backend a call of ``op`` on (x, w) would run, {skipped backend: reason}) under the current request."""
    choice = _backend.choose(op, getattr(x, "_local_tensor", x).device, case_key(x, w))
    return choice.backend, dict(choice.skipped)


def backend_for(x: torch.Tensor, w: torch.Tensor) -> tuple[str, dict[str, str]]:
    """(the backend grouped_mm(x, w, ...) would run, {skipped backend: reason}) under the current request."""
    return backend_report(OP, x, w)


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
        raise TypeError(f"w: expected dtype {dtype_name(x.dtype)} (the dtype of x), got {dtype_name(w.dtype)}")
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"w: expected shape (E, {x.shape[1]}, N) (K = x.shape[1]), got {tuple(w.shape)}")
    if w.shape[0] < 1:
        raise ValueError(f"w: expected at least one expert, got shape {tuple(w.shape)}")
    if offsets.dtype != torch.int32:
        raise TypeError(f"offsets: expected dtype int32 (cumulative group ends), got {dtype_name(offsets.dtype)}")
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


# ----------------------------------------------------------------------------- the op


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


def save_operands(ctx, inputs, output) -> None:
    """What a grouped GEMM's backward needs: x, w and the offsets (shared with fp8_grouped_mm)."""
    ctx.save_for_backward(*inputs[:3])


def _grads(ctx, dy):
    x, w, offsets = ctx.saved_tensors
    refuse_create_graph(OP, dy, x, w)
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dx, dw = grouped_mm_def.backward(dy, x, w, offsets, need_dx, need_dw, ctx.backend)
    return (dx if need_dx else None), (dw if need_dw else None), None


# ----------------------------------------------------------------------------- sharding rules
# y[group e] = x[group e] @ w[e] is a matmul per group: tensor parallel on the experts runs locally.
# Colwise (w1/w3: w split on N) -> y split on its last dim; rowwise (w2: x and w split on K) -> y
# Partial; a Partial x (or w) with the other replicated -> y Partial (linear). The groups are rows of
# x, so the offsets stay replicated; a split token dim would cut groups: DTensor gathers it. Expert
# parallel (w split on E with each rank's own token groups) is not a placement of x: the trainer's
# all-to-all hands each rank local tensors and calls the op on them. Backward: colwise -> dx Partial,
# dw Shard(2); rowwise -> dx Shard(1), dw Shard(1). A gradient not asked for is an empty (T, 0) /
# (E, K, 0) tensor, for which the same placements hold (the rules must not depend on the bool flags,
# the recipe or the backend string, left out of DTensor's cache key). The float8 op (fp8_grouped_mm)
# shards the same way, each rank scaling its own shards: colwise is exact (every scale of the forward
# and of the weight gradient sees the whole K of its column; dgrad's per-token scales are per N
# shard), rowwise takes per-K-shard scales for x and w, equal to the unsharded result to float8
# accuracy. A Partial input is not taken there (``linear`` False): quantizing each summand with its
# own scale loses the sum's precision where summands cancel, so DTensor reduces it first.


def sharding_rules(n_scalars: int, linear: bool) -> list:
    """The forward's rules, for ``n_scalars`` non-tensor arguments after (x, w, offsets)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    rep, flags = Replicate(), [None] * n_scalars
    rules = [
        ([rep], [rep, rep, rep, *flags]),
        ([Shard(1)], [rep, Shard(2), rep, *flags]),
        ([Partial()], [Shard(1), Shard(1), rep, *flags]),
    ]
    if linear:
        rules += [([Partial()], [Partial(), rep, rep, *flags]), ([Partial()], [rep, Partial(), rep, *flags])]
    return rules


def backward_sharding_rules(n_scalars: int) -> list:
    """The backward's rules, for ``n_scalars`` non-tensor arguments after (dy, x, w, offsets)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    rep, flags = Replicate(), [None] * n_scalars
    return [
        ([rep, rep], [rep, rep, rep, rep, *flags]),
        ([Partial(), Shard(2)], [Shard(1), rep, Shard(2), rep, *flags]),
        ([Shard(1), Shard(1)], [rep, Shard(1), Shard(1), rep, *flags]),
    ]


grouped_mm_def.define(forward, lambda x, w, offsets, backend=None: x.new_empty((x.shape[0], w.shape[2])),
                      setup=save_operands, grads=_grads, backward=backward,
                      backward_fake=lambda dy, x, w, offsets, need_dx, need_dw, backend=None: fake_grads(
                          x, w, need_dx, need_dw),
                      sharding=lambda x, w, offsets, *rest: sharding_rules(len(rest), linear=True),
                      backward_sharding=lambda dy, x, w, offsets, *rest: backward_sharding_rules(len(rest)))


def prepare_offsets(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The offsets as a call passes them on: their values checked in plain eager mode (on the CPU,
    where it costs no sync), replicated next to a DTensor x (they are the same on every rank)."""
    if eager_fast_path(x, w, offsets):
        if not x.is_meta:  # meta tensors: the op's fake gives the shape
            _validate_values(x, offsets)
        return offsets
    return replicate_like(x, offsets) if torch.distributed.is_available() else offsets


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
    return grouped_mm_def(x, w, prepare_offsets(x, w, offsets))
