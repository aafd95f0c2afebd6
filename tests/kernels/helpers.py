"""Helpers shared by the kernel tests: the backends that run here, the relative error, Llama 3.1's
RoPE frequency scaling in float64, and the operands, float64 loop and contract checks of the two
grouped GEMMs (grouped_mm, fp8_grouped_mm)."""
from __future__ import annotations

import contextlib
import math

import pytest
import torch

from tests.conftest import TEST_DEVICE

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def backends_here(op: str | None = None, names: tuple[str, ...] = ("reference", "triton", TEST_DEVICE)) -> list:
    """Each backend of ``names`` as a pytest param, skipped with its reason when it cannot run on the
    test device (or, given ``op``, does not implement it)."""
    from titan_kernels import backend

    out = []
    for name in names:
        st = backend.backend_status(name, TEST_DEVICE)
        why = None
        if not st.available:
            why = f"{name} backend unavailable: {st.reason}"
        elif op is not None and name not in backend.implemented_backends(op):
            why = f"{name} backend has no {op} kernel"
        marks = [pytest.mark.skip(reason=why)] if why else []
        out.append(pytest.param(name, marks=marks, id=name))
    return out


def cpu_capabilities() -> list[str]:
    """The instruction-set builds of the native cpu kernels this CPU runs ("default", "avx2",
    "avx512"), best last; empty when the native backend is not built."""
    from titan_kernels import backend

    if not backend.backend_status("cpu", "cpu").available:
        return []
    from titan_kernels import _C

    out = []
    for cap in ("default", "avx2", "avx512"):
        try:
            _C.set_cpu_capability(cap)
        except ValueError:  # this CPU cannot run it
            continue
        out.append(cap)
    _C.set_cpu_capability("auto")
    return out


def cpu_capability_params() -> list:
    """:func:`cpu_capabilities` as pytest params; one skipped with the reason when none is built."""
    caps = cpu_capabilities()
    return caps or [pytest.param("none", marks=pytest.mark.skip(reason="native cpu backend unavailable"))]


@contextlib.contextmanager
def cpu_capability(cap: str):
    """The native cpu kernels of the ``cap`` build inside the block; the automatic choice after."""
    from titan_kernels import _C

    _C.set_cpu_capability(cap)
    try:
        yield
    finally:
        _C.set_cpu_capability("auto")


def llama31_scaled_freqs64(freqs: list[float], scaling: dict) -> list[float]:
    """RoPE inverse frequencies after Llama 3.1's ``apply_scaling`` (smooth long-wavelength scaling),
    as a per-frequency Python loop in float64, written from Meta's reference (not from our code).
    Shared by the rotary table tests and the model's float64 forward (tests/trainer/test_model.py)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(f)
        elif wavelen > old / low:
            out.append(f / factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (0 for empty tensors)."""
    a, b = a.double(), b.double()
    if b.numel() == 0:
        return 0.0
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------- grouped GEMMs over experts
# Shared by tests/kernels/test_grouped_mm.py and test_fp8_grouped_mm.py (the same layout and contract).

DEV = torch.device(TEST_DEVICE)

# (sizes per group, K, N): empty groups first, in the middle and last; odd sizes; T = 0; one expert.
GROUPED_CASES = [
    ([3, 0, 5, 1], 8, 12),
    ([0, 7, 0, 9, 2, 0], 16, 24),
    ([5, 11, 1], 7, 5),        # K/N not 16-byte multiples: grouped_mm's aten refuses, fp8's pads
    ([0, 0, 0], 8, 8),         # T = 0
    ([37], 24, 40),
    ([17, 0, 33, 3], 40, 20),  # groups not a multiple of any tile
]


def case_id(case) -> str:
    sizes, k, n = case
    return f"{sizes}-K{k}-N{n}"


def backend_ctx(backend: str):
    """The context of a test backend: "auto" (no request), "aten" (the device's native family), or a name."""
    import contextlib

    import titan_kernels as tk

    if backend == "auto":
        return contextlib.nullcontext()
    return tk.use_backend({"aten": DEV.type}.get(backend, backend))


def make_offsets(sizes, device=DEV) -> torch.Tensor:
    """int32 cumulative group ends of these group sizes."""
    return torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)


def loop64(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The float64 per-expert loop: y[group e] = x[group e] @ w[e], rows past the last group 0."""
    b = [0] + offsets.tolist()
    y = torch.zeros(x.shape[0], w.shape[2], dtype=torch.float64, device=x.device)
    for e in range(w.shape[0]):
        y[b[e]:b[e + 1]] = x[b[e]:b[e + 1]].double() @ w[e].double()
    return y


def loop64_grads(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, dy: torch.Tensor):
    """(y, dx, dw) of ``loop64`` in float64 on x and w's values, the gradients of dy."""
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = loop64(x64, w64, offsets)
    dx64, dw64 = torch.autograd.grad(y64, (x64, w64), dy.double())
    return y64, dx64, dw64


def grouped_grads(backend: str, op, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor):
    """(y, dy, dx, dw): ``op(x, w, offsets)`` under ``backend_ctx(backend)`` and its gradients of a
    random dy."""
    with backend_ctx(backend):
        y = op(x, w, offsets)
        dy = torch.randn_like(y)
        dx, dw = torch.autograd.grad(y, (x, w), dy)
    return y, dy, dx, dw


def noncontiguous_operands(dtype: torch.dtype = torch.float32):
    """(x column-major tokens, [w column-major experts, w strided columns], offsets): groups [6, 0, 9], K 16, N 12."""
    sizes, k, n = [6, 0, 9], 16, 12
    x = torch.randn(k, sum(sizes), device=DEV).to(dtype).t()
    w = torch.randn(3, n, k, device=DEV).to(dtype).transpose(1, 2)
    w2 = torch.randn(3, k, 2 * n, device=DEV).to(dtype)[:, :, ::2]
    return x, [w, w2], make_offsets(sizes)


@contextlib.contextmanager
def spied_kernels(op: str, calls: list, forward: str = "forward", backward: str = "backward"):
    """Every implementation of ``op``, through ``backend.replace_impl``, with its ``forward`` and
    ``backward`` entry points recording ("fwd" or "bwd", the implementation's name) in ``calls``."""
    from titan_kernels import backend

    def spy(fn, tag, name):
        return lambda *a: (calls.append((tag, name)), fn(*a))[1]

    with contextlib.ExitStack() as stack:
        for impl in backend.implementations(op):
            k = impl.kernels
            spied = k._replace(**{forward: spy(getattr(k, forward), "fwd", impl.name),
                                  backward: spy(getattr(k, backward), "bwd", impl.name)})
            stack.enter_context(backend.replace_impl(op, impl.name, spied, impl.family))
        yield calls


def check_one_backend(calls: list, fast, op) -> None:
    """``fast(x, w, offsets)`` (the public call) and ``op(x, w, offsets)`` (the registered op) under
    use_backend("reference"), the backward outside the context: each records exactly [("fwd",
    "reference"), ("bwd", "reference")] in ``calls`` (the test's instrumented kernels)."""
    import titan_kernels as tk

    x = torch.randn(10, 16, device=DEV, requires_grad=True)
    w = torch.randn(2, 16, 8, device=DEV, requires_grad=True)
    offsets = make_offsets([4, 6])
    for path, run in (("fast", fast), ("op", op)):
        calls.clear()
        with tk.use_backend("reference"):
            y = run(x, w, offsets)
        y.sum().backward()  # outside the context: the backward still runs the forward's backend
        assert calls == [("fwd", "reference"), ("bwd", "reference")], (path, calls)


def check_double_backward_refused(name: str, fast, op) -> None:
    """create_graph=True through ``fast`` and ``op`` (as in ``check_one_backend``) raises naming titan::``name``."""
    x = torch.randn(6, 8, device=DEV, requires_grad=True)
    w = torch.randn(2, 8, 4, device=DEV, requires_grad=True)
    offsets = make_offsets([2, 4])
    for y in (fast(x, w, offsets), op(x, w, offsets)):
        for loss in (y.square().sum(), y.sum()):  # the incoming gradient with and without a graph
            with pytest.raises(RuntimeError, match=f"titan::{name}.*double backward"):
                torch.autograd.grad(loss, (x, w), create_graph=True, retain_graph=True)


def opcheck_operands():
    """(x, w, offsets, dy) for torch.library.opcheck: an empty middle group, x and w needing grad."""
    offsets = make_offsets([3, 0, 4])
    x = torch.randn(9, 8, device=DEV, requires_grad=True)
    w = torch.randn(3, 8, 12, device=DEV, requires_grad=True)
    return x, w, offsets, torch.randn(9, 12, device=DEV)


def check_compile_fullgraph(op) -> None:
    """``op(x, w, offsets)`` under torch.compile(fullgraph=True, aot_eager) equals eager, value and gradients."""
    offsets = make_offsets([5, 0, 7, 2])
    x = torch.randn(14, 16, device=DEV, requires_grad=True)
    w = torch.randn(4, 16, 24, device=DEV, requires_grad=True)

    def f(x, w, offsets):
        return op(x, w, offsets).relu()

    torch._dynamo.reset()
    y = torch.compile(f, fullgraph=True, backend="aot_eager")(x, w, offsets)
    g = torch.autograd.grad(y.sum(), (x, w))
    y_ref = f(x, w, offsets)
    g_ref = torch.autograd.grad(y_ref.sum(), (x, w))
    assert rel_err(y, y_ref) <= 1e-6 and all(rel_err(a, b) <= 1e-6 for a, b in zip(g, g_ref))


def validation_cases():
    """(x, w, offsets, [(args, exception, message)]): the argument errors grouped_mm and fp8_grouped_mm
    share (the value checks of the offsets only on the CPU, where they cost no device sync)."""
    x = torch.randn(6, 8, device=DEV)
    w = torch.randn(2, 8, 4, device=DEV)
    o = make_offsets([2, 4])
    cases = [
        ((x.long(), w, o), TypeError, "x: expected dtype"),
        ((x, w.bfloat16(), o), TypeError, "w: expected dtype float32"),
        ((x, w, o.long()), TypeError, "offsets: expected dtype int32"),
        ((x[0], w, o), ValueError, "x: expected 2 dims"),
        ((x, w[0], o), ValueError, "w: expected 3 dims"),
        ((x, torch.randn(2, 7, 4, device=DEV), o), ValueError, r"w: expected shape \(E, 8, N\)"),
        ((x, w, make_offsets([2, 1, 3])), ValueError, r"offsets: expected shape \(2,\)"),
        ((x, w, None), TypeError, "offsets: expected a torch.Tensor"),
    ]
    if DEV.type == "cpu":
        cases += [
            ((x, w, torch.tensor([4, 2], dtype=torch.int32)), ValueError, "non-decreasing"),
            ((x, w, torch.tensor([2, 7], dtype=torch.int32)), ValueError, r"in \[0, 6\]"),
        ]
    return x, w, o, cases


def check_measured_order(monkeypatch, measured_order, dtype: torch.dtype, run_candidates: bool) -> None:
    """``measured_order`` (a grouped GEMM's, timed by ``ops.grouped_gemm.time_order``) with a stand-in
    timer that makes the later candidate faster, on CPU tensors: the order follows the times, is
    cached per key, and a failing timer keeps the given order. ``run_candidates``: the stand-in also
    runs each candidate (forward and backward)."""
    from titan_kernels.ops import _common

    seen = []

    def fake_time(fn, device, reps=10):
        if run_candidates:
            fn()
        seen.append(device.type)
        return 2.0 if len(seen) == 1 else 1.0

    monkeypatch.setattr(_common, "time_call", fake_time)
    measured_order.cache_clear()
    order = measured_order(("aten", "reference"), "cpu", None, dtype, 16, 8)
    assert order == ("reference", "aten") and len(seen) == 2
    assert measured_order(("aten", "reference"), "cpu", None, dtype, 16, 8) == order
    assert len(seen) == 2  # cached per key: not timed again

    def broken(fn, device, reps=10):
        raise RuntimeError("no timer")

    monkeypatch.setattr(_common, "time_call", broken)
    assert measured_order(("aten", "reference"), "cpu", None, dtype, 32, 8) == ("aten", "reference")
    measured_order.cache_clear()
