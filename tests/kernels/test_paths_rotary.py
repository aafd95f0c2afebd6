"""rotary: the eager fast path and the op path (``torch.ops.titan.rotary``) are one autograd definition:
equal outputs and gradients on every backend, the backward on the forward's backend in both paths,
and double backward (rotary is linear in q, k) equal to the float64 math in both paths.
"""
from __future__ import annotations

import pytest
import torch

import titan_kernels as tk
from titan_kernels import backend
from titan_kernels.reference import rotary as ref
from tests.conftest import TEST_DEVICE
from tests.kernels.helpers import backends_here, rel_err

BACKENDS = backends_here("rotary")


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 5, 4, 12, generator=g).to(TEST_DEVICE)
    k = torch.randn(2, 5, 2, 12, generator=g).to(TEST_DEVICE)
    cos, sin = tk.rope_cos_sin(12, 7, theta=10000.0, rotary_dim=10, device=TEST_DEVICE)
    return q, k, cos, sin


def _fast(q, k, cos, sin):
    return tk.apply_rotary_emb(q, k, cos, sin, interleaved=True)


def _op(q, k, cos, sin):
    return torch.ops.titan.rotary(q, k, cos, sin, None, True)


def _run(fn, be):
    q, k, cos, sin = _inputs()
    q.requires_grad_(), k.requires_grad_()
    with backend.use_backend(be):
        qo, ko = fn(q, k, cos, sin)
    g = torch.Generator().manual_seed(1)
    (qo * torch.randn(qo.shape, generator=g).to(qo.device) + 0).sum().add(
        (ko * torch.randn(ko.shape, generator=g).to(ko.device)).sum()).backward()
    return qo.detach(), ko.detach(), q.grad, k.grad


@pytest.mark.parametrize("be", BACKENDS)
def test_fast_path_equals_op_path(be):
    for a, b in zip(_run(_fast, be), _run(_op, be)):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert rel_err(a, b) <= 1e-6


@pytest.mark.parametrize("path", ["fast", "op"])
def test_backward_runs_on_the_forwards_backend(monkeypatch, path):
    if backend.resolve("rotary", TEST_DEVICE) == "reference":
        pytest.skip("the automatic backend here is the reference: the test needs another one to tell them apart")
    calls = []
    fwd, bwd = backend.kernels("rotary", TEST_DEVICE, "reference")
    with backend.replace_impl("rotary", "reference", (fwd, lambda *a: calls.append(1) or bwd(*a))):
        q, k, cos, sin = _inputs()
        q.requires_grad_()
        with backend.use_backend("reference"):
            qo, ko = (_fast if path == "fast" else _op)(q, k, cos, sin)
        (qo.sum() + ko.sum()).backward()  # outside the context
    assert len(calls) == 1


@pytest.mark.parametrize("path", ["fast", "op"])
def test_double_backward_equals_float64(path):
    q, k, cos, sin = _inputs()
    fn = _fast if path == "fast" else _op

    def second(rot, dtype):
        qq = q.to(dtype).requires_grad_()
        kk = k.to(dtype).requires_grad_()
        qo, ko = rot(qq, kk)
        g = torch.Generator().manual_seed(2)
        dq, dk = torch.autograd.grad((qo.square().sum() + ko.pow(3).sum()), (qq, kk), create_graph=True)
        c = torch.randn(dq.shape, generator=g).to(dtype)
        return torch.autograd.grad((dq * c).sum() + dk.square().sum(), (qq, kk))

    ours = second(lambda a, b: fn(a, b, cos, sin), torch.float32)
    truth = second(lambda a, b: ref.rotary_fwd(a, b, cos.double(), sin.double(), None, True), torch.float64)
    for a, b in zip(ours, truth):
        assert b.abs().max() > 0
        assert rel_err(a, b) <= 1e-5, rel_err(a, b)
