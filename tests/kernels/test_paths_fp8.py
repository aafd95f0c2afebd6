"""fp8_linear: the eager fast path and the op path are one autograd definition.

Checked, for every recipe and backend that runs here: equal outputs and gradients from
``tk.fp8_linear`` (fast path) and ``torch.ops.titan.fp8_linear`` (op path); the backward runs on the
backend the forward's request chose, in both paths, whatever context the backward runs in; double
backward is refused with a RuntimeError naming the op, in both paths.
"""
from __future__ import annotations

import types

import pytest
import torch

import titan_kernels as tk
from titan_kernels import backend
from titan_kernels.ops.fp8.gemm import OP as GEMM_OP
from titan_kernels.ops.fp8 import gemm_backend_name, scaled_mm
from tests.conftest import TEST_DEVICE
from tests.kernels.test_fp8_linear import BACKENDS, RECIPES, randn, use

PATHS = {
    "fast": lambda x, w, recipe: tk.fp8_linear(x, w, recipe),
    "op": lambda x, w, recipe: torch.ops.titan.fp8_linear(x, w, recipe),
}


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_paths_equal(be, recipe):
    x = randn(3, 7, 48)[:, ::2]  # odd rows, non-contiguous
    w = randn(40, 48)
    dy = randn(3, 4, 40)
    res = {}
    for name, fn in PATHS.items():
        xi, wi = x.detach().requires_grad_(), w.detach().requires_grad_()
        with use(be):
            y = fn(xi, wi, recipe)
            dx, dw = torch.autograd.grad(y, (xi, wi), dy)
        res[name] = (y, dx, dw)
    for a, b in zip(res["fast"], res["op"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.fixture
def count():
    """Counts the reference backend's GEMM calls (the backward's two GEMMs run there or not)."""
    counter = types.SimpleNamespace(calls=0)

    def counting(*args, **kw):
        counter.calls += 1
        return ref.forward(*args, **kw)

    with backend.replace_impl(GEMM_OP, "reference", counting) as ref:
        yield counter


@pytest.mark.parametrize("path", list(PATHS))
def test_backward_runs_on_the_forwards_backend(count, path):
    x = randn(5, 32).requires_grad_()
    w = randn(16, 32).requires_grad_()
    with tk.use_backend("reference"):
        y = PATHS[path](x, w, "tensorwise")
    assert count.calls == 1
    y.sum().backward()  # outside the context: still the reference GEMMs (dx and dW)
    assert count.calls == 3
    # A forward with no request and a backward inside use_backend("reference"): the automatic choice.
    count.calls = 0
    y = PATHS[path](x, w, "tensorwise")
    with tk.use_backend("reference"):
        y.sum().backward()
    auto_is_reference = gemm_backend_name(TEST_DEVICE) == "reference"
    assert count.calls == (3 if auto_is_reference else 0)
    backend.clear_choices()


@pytest.mark.parametrize("path", list(PATHS))
def test_double_backward_is_refused(path):
    x = randn(5, 32).requires_grad_()
    w = randn(16, 32).requires_grad_()
    y = PATHS[path](x, w, "rowwise")
    with pytest.raises(RuntimeError, match="titan::fp8_linear: double backward"):
        torch.autograd.grad(y.square().sum(), (x, w), create_graph=True)


def test_cpu_gemm_choice_follows_the_timing(monkeypatch):
    # The automatic GEMM on the CPU is torch._scaled_mm only where it is not slower than the
    # dequantized float32 GEMM; an explicit "cpu" request still runs _scaled_mm.
    if not scaled_mm.scaled_mm_available("cpu"):
        pytest.skip("this torch has no float8 torch._scaled_mm on the CPU")
    for pays, want in ((True, "scaled_mm"), (False, "reference")):
        monkeypatch.setattr(scaled_mm, "_cpu_scaled_mm_pays", lambda pays=pays: pays)
        backend.clear_choices()
        assert gemm_backend_name("cpu") == want
        with tk.use_backend("cpu"):
            assert gemm_backend_name("cpu") == "scaled_mm"
    backend.clear_choices()
