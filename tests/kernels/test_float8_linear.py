"""nn.Float8Linear and convert_to_float8: every recipe against a bf16 nn.Linear (both against
float64) on every backend that runs here; shared parameters, the filter, autocast, errors; the FSDP2
float8 all-gather weight wrappers outside FSDP; torch.compile(fullgraph=True) forward+backward.
The GEMMs themselves (the fp8_linear op) are tests/kernels/test_fp8_linear.py.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import titan_kernels as tk
from titan_kernels.nn import Float8Linear, convert_to_float8
from titan_kernels.nn.float8_all_gather import Float8AllGatheredWeight, WeightWithFloat8AllGather
from tests.conftest import TEST_DEVICE
from tests.kernels.test_fp8_linear import BACKENDS, RECIPES, TOL_E4M3, f64_linear, grad_tols, randn, rel_err, use

# torch._scaled_mm is checked wherever it runs, on the CPU too (tests/kernels/conftest.py).
pytestmark = pytest.mark.usefixtures("scaled_mm_when_available")


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
