"""rms_norm / add_rms_norm: the eager fast path and the op path (``torch.ops.titan.*``) are one autograd
definition: equal outputs and gradients on every backend, the backward on the forward's backend in
both paths, and double backward equal to the float64 math in both paths.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from titan_kernels import backend
from titan_kernels.ops import rms_norm as rn
from tests.conftest import TEST_DEVICE
from tests.kernels.helpers import backends_here, rel_err

BACKENDS = backends_here()
EPS = 1e-5


def _inputs(residual: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    # Odd width, a non-contiguous x (every other column of a wider tensor).
    x = torch.randn(3, 5, 74, generator=g)[..., ::2].to(TEST_DEVICE)
    r = torch.randn(3, 5, 37, generator=g).to(TEST_DEVICE) if residual else None
    w = (torch.randn(37, generator=g) + 1).to(TEST_DEVICE)
    return x, r, w


def _fast(x, r, w):
    return rn.rms_norm(x, w, EPS) if r is None else rn.add_rms_norm(x, r, w, EPS)


def _op(x, r, w):
    if r is None:
        return torch.ops.titan.rms_norm(x, w, EPS)[0]
    y, h, _ = torch.ops.titan.add_rms_norm(x, r, w, EPS)
    return y, h


def _run(fn, x, r, w, be):
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, r, w)]
    with backend.use_backend(be):
        out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(1)
    loss = sum((o * torch.randn(o.shape, generator=g).to(o.device)).sum() for o in outs)
    loss.backward()
    return [o.detach() for o in outs] + [t.grad for t in leaves if t is not None]


@pytest.mark.parametrize("residual", [False, True], ids=["rms_norm", "add_rms_norm"])
@pytest.mark.parametrize("be", BACKENDS)
def test_fast_path_equals_op_path(be, residual):
    x, r, w = _inputs(residual)
    fast, op = _run(_fast, x, r, w, be), _run(_op, x, r, w, be)
    assert len(fast) == len(op)
    for a, b in zip(fast, op):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert rel_err(a, b) <= 1e-6, rel_err(a, b)


@pytest.fixture
def spy_reference_backward(monkeypatch):
    """Counts calls of the reference backward kernel."""
    calls = []
    fwd, bwd = backend.kernels("rms_norm", "cpu", "reference")

    def counting_bwd(*args):
        calls.append(1)
        return bwd(*args)

    with backend.replace_impl("rms_norm", "reference", (fwd, counting_bwd)):
        yield calls


@pytest.mark.parametrize("path", ["fast", "op"])
@pytest.mark.parametrize("residual", [False, True], ids=["rms_norm", "add_rms_norm"])
def test_backward_runs_on_the_forwards_backend(spy_reference_backward, residual, path):
    if backend.resolve("rms_norm", TEST_DEVICE) == "reference":
        pytest.skip("the automatic backend here is the reference: the test needs another one to tell them apart")
    x, r, w = _inputs(residual)
    x.requires_grad_()
    with backend.use_backend("reference"):
        out = (_fast if path == "fast" else _op)(x, r, w)
    y = out[0] if isinstance(out, tuple) else out
    y.sum().backward()  # outside the context: the automatic choice would be another backend
    assert len(spy_reference_backward) == 1


def _f64_second(residual: bool, x, r, w):
    """d/d(x, w) of sum(dx^2) + sum(dw * c) through float64 F.rms_norm, the ground truth."""
    return _second(lambda a, b, c: F.rms_norm(a if b is None else a + b, (a.shape[-1],), c, EPS), x, r, w, torch.float64)


def _second(fn, x, r, w, dtype):
    x = x.detach().to(dtype).requires_grad_()
    w = w.detach().to(dtype).requires_grad_()
    r = r.detach().to(dtype) if r is not None else None
    out = fn(x, r, w)
    y = out[0] if isinstance(out, tuple) else out
    g = torch.Generator().manual_seed(2)
    dy = torch.randn(y.shape, generator=g).to(dtype)
    dx, dw = torch.autograd.grad(y, (x, w), dy, create_graph=True)
    c = torch.randn(dw.shape, generator=g).to(dtype)
    return torch.autograd.grad((dx * dx).sum() + (dw * c).sum(), (x, w))


@pytest.mark.parametrize("path", ["fast", "op"])
@pytest.mark.parametrize("residual", [False, True], ids=["rms_norm", "add_rms_norm"])
def test_double_backward_equals_float64(residual, path):
    x, r, w = _inputs(residual)
    ours = _second(_fast if path == "fast" else _op, x, r, w, torch.float32)
    truth = _f64_second(residual, x, r, w)
    for a, b in zip(ours, truth):
        assert rel_err(a, b) <= 1e-5, rel_err(a, b)
        assert b.abs().max() > 0  # a real second derivative, not zeros


def test_double_backward_weight_is_not_zero():
    # The case of issue 11: d2/dw of rms_norm used to come out as zeros on the fast path.
    x = torch.randn(2, 4, device=TEST_DEVICE, requires_grad=True)
    w = torch.randn(4, device=TEST_DEVICE, requires_grad=True)
    (dw,) = torch.autograd.grad(rn.rms_norm(x, w).square().sum(), w, create_graph=True)
    (d2w,) = torch.autograd.grad(dw.sum(), w)
    x64, w64 = x.detach().double(), w.detach().double().requires_grad_()
    (dw64,) = torch.autograd.grad(F.rms_norm(x64, (4,), w64, 1e-6).square().sum(), w64, create_graph=True)
    (d2w64,) = torch.autograd.grad(dw64.sum(), w64)
    assert rel_err(d2w, d2w64) <= 1e-5
