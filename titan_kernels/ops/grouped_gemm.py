"""What the grouped GEMM ops share (``grouped_mm`` and its float8 variant ``fp8_grouped_mm``): the
layout x (T, K) tokens sorted by expert, w (E, K, N), offsets (E,) int32 cumulative group ends, and
everything that depends only on it.

  validation         ``validate_layout`` (ranks, shapes, dtypes, devices), ``prepare_offsets`` (the
                     offsets' values in eager mode on the CPU; replicated beside a DTensor x)
  the choice         ``case_key`` (dtype, K, N), ``triton_why_not``, ``register_backends`` (aten in the
                     cpu and cuda families, triton, reference, through the op's ``Op.register`` and
                     ``Op.set_order``, reordered on CUDA by a measurement per key: ``time_order``),
                     ``backend_report``
  the op             ``save_operands``, ``grads_or_empty``, ``fake_grads``, ``zero_tail`` (aten's
                     uninitialized rows past the last group)
  DTensor            ``sharding_rules``, ``backward_sharding_rules`` (tensor parallel on the experts)

Each op's module keeps its kernels, their capabilities and its bodies.
"""
from __future__ import annotations

import importlib
import os

import torch

from titan_kernels import backend as _backend
from titan_kernels.ops import _common
from titan_kernels.ops._common import check_float, check_same_device, check_tensor, dtype_name, eager_fast_path, replicate_like
from titan_kernels.ops._scaffold import Op

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


def _may_measure(device_type: str) -> bool:
    # Timed on CUDA, where aten and our kernel are close; never while tracing or under a fake/dispatch mode.
    return (device_type == "cuda" and os.environ.get(MEASURE_ENV, "1") != "0"
            and not torch.compiler.is_compiling() and not torch._C._len_torch_dispatch_stack())


def register_backends(op: Op, impls: dict, why_not, order: dict, measured) -> None:
    """``op``'s implementations (``Op.register``): ``impls["aten"]`` in the cpu and cuda families (the
    native kernel of each device), ``impls["triton"]``, ``impls["reference"]``, each asking ``why_not(name, device_type, index, *case)``; the op's ``ORDER``
    ``order`` (``Op.set_order``), the candidates that take a key (the reference aside, the fallback,
    never timed) reordered on CUDA by ``measured(cands, device_type, index, *case)``."""
    def ask(name):
        return lambda device, case: why_not(name, device.type, device.index, *case)

    def rank(device: torch.device, case: tuple, names: tuple[str, ...]) -> tuple[str, ...]:
        fast = tuple(c for c in names if c != "reference")
        if len(fast) > 1 and _may_measure(device.type):
            return measured(fast, device.type, device.index, *case)
        return names

    op.register_native(impls["aten"], name="aten", why_not=ask("aten"))
    op.register("triton", impls["triton"], why_not=ask("triton"))
    op.register("reference", impls["reference"], why_not=ask("reference"))
    op.set_order(order, rank=rank)


def case_key(x: torch.Tensor, w: torch.Tensor) -> tuple:
    """The case key of a call (dtype, K, N): what the capabilities and the measured order depend on."""
    x, w = getattr(x, "_local_tensor", x), getattr(w, "_local_tensor", w)  # a DTensor runs on its shard
    return x.dtype, int(x.shape[1]), int(w.shape[2])


def backend_report(op: str, x: torch.Tensor, w: torch.Tensor) -> tuple[str, dict[str, str]]:
    """(the backend a call of ``op`` on (x, w) would run, {skipped backend: reason}) under the current request."""
    choice = _backend.choose(op, getattr(x, "_local_tensor", x).device, case_key(x, w))
    return choice.backend, dict(choice.skipped)


def validate_layout(x, w, offsets, dtypes: tuple[torch.dtype, ...]) -> None:
    """TypeError / ValueError naming the argument unless x (T, K) and w (E, K, N) are float tensors of one dtype
    of ``dtypes``, E >= 1, offsets (E,) int32, all on one device."""
    check_float(x, "x", dtypes)
    check_float(w, "w", dtypes)
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


def validate_offset_values(x, offsets) -> None:
    """Group ends non-decreasing in [0, T]: checked where it costs no device sync (eager, CPU)."""
    if offsets.device.type != "cpu" or offsets.numel() == 0:
        return
    o = offsets.tolist()
    if o[0] < 0 or any(b < a for a, b in zip(o, o[1:])) or o[-1] > x.shape[0]:
        raise ValueError(f"offsets: expected non-decreasing group ends in [0, {x.shape[0]}] (T), got {o}")


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


def zero_tail(y: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """y with its rows past the last group zeroed, in place (aten's grouped GEMMs leave them
    uninitialized); on the CPU from the host, on CUDA by a kernel (no host sync)."""
    if y.device.type == "cpu":  # a host read of a host tensor: no sync
        y[int(offsets[-1]):].zero_()
        return y
    from titan_kernels.triton.grouped_mm import zero_rows_from

    zero_rows_from(y, offsets)
    return y


def save_operands(ctx, inputs, output) -> None:
    """What a grouped GEMM's backward needs: x, w and the offsets (shared with fp8_grouped_mm)."""
    ctx.save_for_backward(*inputs[:3])


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


def prepare_offsets(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The offsets as a call passes them on: their values checked in plain eager mode (on the CPU,
    where it costs no sync), replicated next to a DTensor x (they are the same on every rank)."""
    if eager_fast_path(x, w, offsets):
        if not x.is_meta:  # meta tensors: the op's fake gives the shape
            validate_offset_values(x, offsets)
        return offsets
    return replicate_like(x, offsets) if torch.distributed.is_available() else offsets
