"""The fp8_linear ops: outputs and gradients of every recipe on every backend that runs here, against
float64 math; the eager fast path against the op path; backends agreeing; each recipe's GEMM
operands; frozen weights, 3-D and zero-size inputs; errors; opcheck. The module (Float8Linear) is
tests/kernels/test_float8_linear.py; the recipes' configs test_float8_config.py.

No gradcheck: quantization is piecewise constant, so finite differences of the fp8 op are not its
gradient. The backward implements the gradient of the linear map (straight-through, as torchao),
which is what is compared against float64 here.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import titan_kernels as tk
from titan_kernels import backend
from titan_kernels.ops.fp8.gemm import OP as GEMM_OP
from titan_kernels.ops.fp8 import scaled_mm
from tests.conftest import TEST_DEVICE

# torch._scaled_mm is checked wherever it runs, on the CPU too (tests/kernels/conftest.py).
pytestmark = pytest.mark.usefixtures("scaled_mm_when_available")

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
# Relative norm error against float64: e4m3 operands; e5m2 gradients (tensorwise) have one
# mantissa bit less; grad_weight in high precision (rowwise_with_gw_hp) is exact up to the dtype.
TOL_E4M3, TOL_E5M2 = 7e-2, 1.2e-1


def grad_tols(recipe, dtype):
    if recipe == "tensorwise":
        return TOL_E5M2, TOL_E5M2
    return TOL_E4M3, (TOL_E4M3 if recipe == "rowwise" else {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype])


def backends_here() -> list:
    out = []
    for name in ("auto", "reference", "triton"):
        st = backend.backend_status("reference" if name == "auto" else name, TEST_DEVICE)
        marks = [] if st.available else [pytest.mark.skip(reason=f"{name} backend unavailable: {st.reason}")]
        out.append(pytest.param(name, marks=marks, id=name))
    return out


BACKENDS = backends_here()


def use(be):
    """auto: no backend requested (quantize on the default backend, GEMM on torch._scaled_mm)."""
    return contextlib.nullcontext() if be == "auto" else tk.use_backend(be)


def rel_err(a, b) -> float:
    if b.numel() == 0:
        return 0.0
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def randn(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(shape, dtype=torch.float64) * scale + 0.1).to(dtype).to(TEST_DEVICE)


def f64_linear(x, w, g):
    x64, w64, g64 = x.double(), w.double(), g.double()
    y = x64 @ w64.t()
    return y, g64 @ w64, g64.reshape(-1, g.shape[-1]).t() @ x64.reshape(-1, x.shape[-1])


# --------------------------------------------------------------------------- fp8_linear


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("shape", [(1, 16, 8), (3, 5, 40, 24), (70, 96, 33)], ids=["1tok", "3d", "odd"])
def test_fp8_linear_against_float64(be, recipe, shape):
    *lead, k, n = shape
    x = randn(*lead, k, scale=2.0).requires_grad_()
    w = randn(n, k, scale=0.5).requires_grad_()
    g = randn(*lead, n)
    with use(be):
        y = tk.fp8_linear(x, w, recipe)
        dx, dw = torch.autograd.grad(y, (x, w), g)
    y64, dx64, dw64 = f64_linear(x.detach(), w.detach(), g)
    tol_dx, tol_dw = grad_tols(recipe, torch.float32)
    assert y.shape == (*lead, n) and y.dtype == x.dtype and not y._is_view()
    assert rel_err(y, y64) < TOL_E4M3
    assert rel_err(dx, dx64) < tol_dx
    assert rel_err(dw, dw64) < tol_dw


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_op_path_equals_fast_path(be, recipe):
    x = randn(6, 7, 32).requires_grad_()
    w = randn(24, 32).requires_grad_()
    g = randn(6, 7, 24)
    with use(be):
        y1 = tk.fp8_linear(x, w, recipe)
        d1 = torch.autograd.grad(y1, (x, w), g)
        y2 = torch.ops.titan.fp8_linear(x, w, recipe)
        d2 = torch.autograd.grad(y2, (x, w), g)
    assert torch.equal(y1, y2)
    assert all(torch.equal(a, b) for a, b in zip(d1, d2))


@pytest.mark.parametrize("recipe", RECIPES)
def test_backends_agree(recipe):
    """The Triton and reference quantizers give the same codes, so fp8_linear agrees across them
    up to GEMM summation order."""
    if not backend.backend_status("triton", TEST_DEVICE).available:
        pytest.skip("triton backend unavailable: " + backend.backend_status("triton", TEST_DEVICE).reason)
    x = randn(20, 48).requires_grad_()
    w = randn(40, 48).requires_grad_()
    g = randn(20, 40)
    outs = []
    for be in ("reference", "triton"):
        with tk.use_backend(be):
            y = tk.fp8_linear(x, w, recipe)
            outs.append((y, *torch.autograd.grad(y, (x, w), g)))
    for a, b in zip(*outs):
        assert rel_err(a, b) < 1e-5


def test_recipe_casts():
    """Each recipe's GEMM operands have the dtypes and scale shapes torchao's recipe gives them."""
    calls = []
    real = scaled_mm.scaled_mm_gemm

    def spy(a, b, sa, sb, *rest):
        calls.append((a.dtype, b.dtype, tuple(sa.shape), tuple(sb.shape)))
        return real(a, b, sa, sb, *rest)

    E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
    expect = {
        "tensorwise": [(E4, E4, (), ()), (E5, E4, (), ()), (E5, E4, (), ())],
        "rowwise": [(E4, E4, (9, 1), (12, 1)), (E4, E4, (9, 1), (16, 1)), (E4, E4, (12, 1), (16, 1))],
        "rowwise_with_gw_hp": [(E4, E4, (9, 1), (12, 1)), (E4, E4, (9, 1), ())],  # dW in high precision
    }
    if not scaled_mm.scaled_mm_available(TEST_DEVICE):
        pytest.skip("torch._scaled_mm unavailable on " + TEST_DEVICE)
    for recipe, want in expect.items():
        calls.clear()
        with backend.replace_impl(GEMM_OP, "scaled_mm", spy):
            x = randn(9, 16).requires_grad_()
            w = randn(12, 16).requires_grad_()
            tk.fp8_linear(x, w, recipe).sum().backward()
        assert calls == want, recipe


@pytest.mark.parametrize("be", BACKENDS)
def test_frozen_weight_and_input(be):
    x = randn(5, 32)
    w = randn(16, 32).requires_grad_()
    with use(be):
        y = tk.fp8_linear(x, w)  # x needs no grad: only dW
        (dw,) = torch.autograd.grad(y.sum(), (w,))
        x.requires_grad_()
        y = tk.fp8_linear(x, w.detach())
        (dx,) = torch.autograd.grad(y.sum(), (x,))
        dx2, dw2 = torch.ops.titan.fp8_linear_backward(torch.ones(5, 16, device=TEST_DEVICE), x.detach(), w.detach(),
                                                        "tensorwise", True, False)
    assert dw.shape == w.shape and dx.shape == x.shape
    assert dw2.shape == (16, 0)  # a same-rank empty placeholder (see the op docstring)
    torch.testing.assert_close(dx2, dx)


@pytest.mark.parametrize("be", BACKENDS)
def test_zero_size(be):
    x = torch.randn(0, 32, device=TEST_DEVICE, requires_grad=True)
    w = randn(16, 32).requires_grad_()
    with use(be):
        y = tk.fp8_linear(x, w, "rowwise")
        dx, dw = torch.autograd.grad(y.sum(), (x, w))
    assert y.shape == (0, 16) and dx.shape == (0, 32)
    assert not dw.any()
    with use(be):
        y = tk.fp8_linear(randn(3, 0), torch.zeros(4, 0, device=TEST_DEVICE))
    assert y.shape == (3, 4) and not y.any()


def test_errors():
    x = randn(4, 8)
    w = randn(6, 8)
    with pytest.raises(ValueError, match="recipe: expected one of"):
        tk.fp8_linear(x, w, "blockwise")
    with pytest.raises(ValueError, match=r"weight: expected shape \(out_features, 8\)"):
        tk.fp8_linear(x, randn(6, 9))
    with pytest.raises(TypeError, match="weight: expected dtype float32"):
        tk.fp8_linear(x, w.bfloat16())
    with pytest.raises(TypeError, match="x: expected dtype"):
        tk.fp8_linear(x.to(torch.int64), w)
    with pytest.raises(ValueError, match="x: expected at least 1 dimension"):
        tk.fp8_linear(torch.tensor(1.0), w)


# --------------------------------------------------------------------------- op contract


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_opcheck(be, recipe):
    x = randn(5, 3, 32).requires_grad_()
    w = randn(16, 32).requires_grad_()
    xt = randn(32, 15).t().reshape(5, 3, 32).detach().requires_grad_()  # non-contiguous
    wt = randn(32, 16).t().detach().requires_grad_()
    dy = randn(5, 3, 16)
    with use(be):
        for xx, ww in ((x, w), (xt, wt)):
            torch.library.opcheck(torch.ops.titan.fp8_linear, (xx, ww, recipe))
            for flags in ((True, True), (True, False), (False, True)):
                torch.library.opcheck(torch.ops.titan.fp8_linear_backward,
                                      (dy, xx.detach(), ww.detach(), recipe, *flags))
