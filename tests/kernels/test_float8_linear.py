"""fp8_linear ops and nn.Float8Linear: outputs and gradients of every recipe on every backend that
runs here, against float64 math and against a bf16 nn.Linear; the eager fast path against the op
path; frozen weights, 3-D and zero-size inputs, autocast; convert_to_float8; the float8 all-gather
weight wrappers outside FSDP; errors; opcheck; torch.compile(fullgraph=True) forward+backward.

No gradcheck: quantization is piecewise constant, so finite differences of the fp8 op are not its
gradient. The backward implements the gradient of the linear map (straight-through, as torchao),
which is what is compared against float64 here.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import titan_kernels as tk
from titan_kernels import backend
from titan_kernels.nn.float8_all_gather import Float8AllGatheredWeight, WeightWithFloat8AllGather
from titan_kernels.nn import Float8Linear, convert_to_float8
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


# --------------------------------------------------------------------------- Float8Linear


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_float8_linear_against_bf16_linear(be, recipe):
    """Float8Linear vs nn.Linear in bf16 (the baseline it replaces), both against float64."""
    torch.manual_seed(1)
    lin = nn.Linear(96, 40, device=TEST_DEVICE, dtype=torch.bfloat16)
    f8 = Float8Linear.from_float(nn.Linear(96, 40, device=TEST_DEVICE, dtype=torch.bfloat16), recipe)
    f8.load_state_dict(lin.state_dict())
    x = randn(4, 9, 96, dtype=torch.bfloat16, scale=2.0)
    g = randn(4, 9, 40, dtype=torch.bfloat16)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    with use(be):
        y8 = f8(x1)
        y8.backward(g)
    yb = lin(x2)
    yb.backward(g)
    y64, dx64, dw64 = f64_linear(x, lin.weight.detach(), g)
    y64 = y64 + lin.bias.double()
    tol_dx, tol_dw = grad_tols(recipe, torch.bfloat16)
    assert y8.dtype == torch.bfloat16
    for got, base, ref, tol in ((y8, yb, y64, TOL_E4M3), (x1.grad, x2.grad, dx64, tol_dx),
                                (f8.weight.grad, lin.weight.grad, dw64, tol_dw)):
        assert rel_err(base, ref) < 1e-2  # bf16 itself
        assert rel_err(got, ref) < tol
        assert rel_err(got, base) < tol + 1e-2
    torch.testing.assert_close(f8.bias.grad, lin.bias.grad)  # the bias stays in high precision


def test_from_float_shares_parameters():
    lin = nn.Linear(16, 8)
    f8 = Float8Linear.from_float(lin, "rowwise")
    assert f8.weight is lin.weight and f8.bias is lin.bias
    assert list(f8.state_dict()) == list(lin.state_dict())
    assert "recipe=rowwise" in repr(f8)
    nob = Float8Linear.from_float(nn.Linear(16, 8, bias=False))
    assert nob.bias is None
    with torch.device("meta"):
        meta = Float8Linear.from_float(nn.Linear(4096, 1024))
    assert meta.weight.is_meta
    fresh = Float8Linear(16, 8, recipe="rowwise_with_gw_hp")
    assert fresh.weight.shape == (8, 16) and fresh(torch.randn(3, 16)).shape == (3, 8)


def test_convert_to_float8_with_filter():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8)))
    seen = []

    def keep(mod, fqn):
        seen.append(fqn)
        return fqn != "2.1"

    out = convert_to_float8(model, "rowwise", keep)
    assert out is model and seen == ["0", "2.0", "2.1"]
    assert isinstance(model[0], Float8Linear) and isinstance(model[2][0], Float8Linear)
    assert type(model[2][1]) is nn.Linear
    assert model[0].recipe == "rowwise"
    assert model(torch.randn(5, 32)).shape == (5, 8)
    convert_to_float8(model)  # converting again leaves converted layers alone
    assert model[0].recipe == "rowwise"
    root = convert_to_float8(nn.Linear(8, 8))
    assert isinstance(root, Float8Linear)


def test_autocast():
    lin = Float8Linear(32, 16)
    x = torch.randn(4, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.bfloat16
    assert rel_err(y, x.double() @ lin.weight.double().t() + lin.bias.double()) < TOL_E4M3


def test_float8_linear_errors():
    with pytest.raises(TypeError, match="linear: expected an nn.Linear"):
        Float8Linear.from_float(nn.Conv1d(3, 3, 1))
    with pytest.raises(ValueError, match="recipe: expected one of"):
        Float8Linear.from_float(nn.Linear(4, 4), "delayed")
    with pytest.raises(ValueError, match="recipe: expected one of"):
        convert_to_float8(nn.Linear(4, 4), "nope")
    with pytest.raises(ValueError, match="enable_fsdp_float8_all_gather: needs recipe 'tensorwise'"):
        Float8Linear.from_float(nn.Linear(4, 4), "rowwise", enable_fsdp_float8_all_gather=True)
    with pytest.raises(TypeError, match="model: expected an nn.Module"):
        convert_to_float8("model")
    with pytest.raises(TypeError, match="weight: expected dtype"):
        Float8Linear(8, 4)(torch.randn(2, 8, dtype=torch.bfloat16))


def test_all_gather_weight_outside_fsdp():
    """The FSDP2 wrapper acts as the plain weight everywhere else: forward, grads, optimizer,
    state_dict round trip, meta init + to_empty."""
    torch.manual_seed(0)
    plain = Float8Linear.from_float(nn.Linear(40, 24))
    wrapped = Float8Linear.from_float(nn.Linear(40, 24), enable_fsdp_float8_all_gather=True)
    wrapped.load_state_dict(plain.state_dict())
    assert isinstance(wrapped.weight, WeightWithFloat8AllGather) and isinstance(wrapped.weight, nn.Parameter)
    x = torch.randn(7, 40)
    y1, y2 = plain(x), wrapped(x)
    y1.sum().backward()
    y2.sum().backward()
    assert torch.equal(y1, y2)
    assert torch.equal(plain.weight.grad, wrapped.weight.grad)
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1) for m in (plain, wrapped)]
    for opt in opts:
        opt.step()
    assert type(opts[1].state[wrapped.weight]["exp_avg"]) is torch.Tensor  # optimizer state stays plain
    assert isinstance(wrapped.weight, WeightWithFloat8AllGather)
    assert torch.equal(plain.weight.detach(), wrapped.weight._tensor)
    # state_dict hands out the plain tensor (checkpoints need no wrapper class), sharing storage.
    sd = wrapped.state_dict()
    assert type(sd["weight"]) is torch.Tensor
    assert sd["weight"].data_ptr() == wrapped.weight._tensor.data_ptr()
    with torch.device("meta"):
        meta = Float8Linear.from_float(nn.Linear(40, 24), enable_fsdp_float8_all_gather=True)
    meta.to_empty(device="cpu")
    assert isinstance(meta.weight, WeightWithFloat8AllGather) and not meta.weight.is_meta
    meta.load_state_dict(plain.state_dict())
    assert torch.equal(meta(x), plain(x))


def test_all_gathered_weight_dequantizes_for_other_ops():
    w = torch.randn(6, 16)
    codes, scale = tk.fp8_quantize(w)
    gw = Float8AllGatheredWeight(codes, scale, torch.float32)
    deq = codes.float() * scale
    assert torch.equal(gw + 0, deq)
    assert torch.equal(gw.t() @ torch.ones(6), deq.t() @ torch.ones(6))
    assert isinstance(gw.detach(), Float8AllGatheredWeight)
    # Float8Linear uses the codes directly: the same result as quantizing w on the fly.
    lin = Float8Linear(16, 6, bias=False)
    x = torch.randn(3, 16)
    with torch.no_grad():
        lin.weight.copy_(w)
    y_ref = lin(x)
    lin.weight = nn.Parameter(gw, requires_grad=True)
    assert torch.equal(lin(x), y_ref)


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


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_compile_fullgraph_forward_backward(be, recipe):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 64), nn.SiLU(), nn.Linear(64, 24, bias=False)).to(TEST_DEVICE)
    convert_to_float8(model, recipe)
    x = randn(2, 5, 48)
    with use(be):
        y_e = model(x)
        y_e.square().sum().backward()
        grads_e = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        compiled = torch.compile(model, fullgraph=True, dynamic=False)
        y_c = compiled(x)
        y_c.square().sum().backward()
    torch.testing.assert_close(y_c, y_e, rtol=1e-6, atol=1e-6)
    for p, g in zip(model.parameters(), grads_e):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-5)
