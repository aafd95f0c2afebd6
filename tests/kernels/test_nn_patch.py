"""Drop-in RMSNorm module and patch(): constructor, state_dict, in-place replacement."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import titan_kernels as tk
from titan_kernels.nn import RMSNorm


def test_rmsnorm_matches_torch_module_and_state_dict():
    ref = nn.RMSNorm(37, eps=1e-5)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(37))
    ours = RMSNorm(37, eps=1e-5)
    ours.load_state_dict(ref.state_dict())
    assert ours.state_dict().keys() == ref.state_dict().keys()
    x = torch.randn(3, 5, 37)
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-6)
    # eps=None means finfo(dtype).eps, as torch.nn.RMSNorm
    torch.testing.assert_close(RMSNorm([37])(x), nn.RMSNorm([37])(x), rtol=1e-5, atol=1e-6)
    no_affine = RMSNorm(37, elementwise_affine=False)
    assert no_affine.weight is None and list(no_affine.state_dict()) == []
    torch.testing.assert_close(no_affine(x), nn.RMSNorm(37, elementwise_affine=False)(x), rtol=1e-5, atol=1e-6)


def test_rmsnorm_rejects_multi_dim_shape():
    with pytest.raises(ValueError, match="normalized_shape"):
        RMSNorm((4, 8))


def test_rmsnorm_meta_init_then_materialize():
    with torch.device("meta"):
        m = RMSNorm(16, eps=1e-6)
    m.to_empty(device="cpu")
    m.reset_parameters()
    assert torch.equal(m.weight, torch.ones(16))


class LlamaRMSNorm(nn.Module):
    """The Hugging Face layout: `weight` and `variance_epsilon`."""

    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden))
        self.variance_epsilon = eps

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * xf.to(x.dtype)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(24, eps=1e-5)
        self.hf_norm = LlamaRMSNorm(24)
        self.proj = nn.Linear(24, 24)
        self.multi = nn.RMSNorm((3, 24))  # over two dims: not ours, left alone
        self.layers = nn.ModuleList([nn.RMSNorm(24) for _ in range(2)])

    def forward(self, x):
        x = self.proj(self.norm(x)) + self.hf_norm(x)
        for layer in self.layers:
            x = layer(x)
        return self.multi(x)


def test_patch_replaces_in_place_and_keeps_weights():
    torch.manual_seed(0)
    model = Block()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.RMSNorm) and m.weight is not None:
                m.weight.copy_(torch.randn_like(m.weight))
    x = torch.randn(2, 3, 24)
    before = model(x)
    weight_ids = {id(model.norm.weight), id(model.hf_norm.weight)}
    assert tk.patch(model) == 4
    assert isinstance(model.norm, RMSNorm) and isinstance(model.hf_norm, RMSNorm)
    assert all(isinstance(layer, RMSNorm) for layer in model.layers)
    assert type(model.multi) is nn.RMSNorm
    assert {id(model.norm.weight), id(model.hf_norm.weight)} == weight_ids
    torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-5)
    assert tk.patch(model) == 0  # idempotent


def test_patch_refuses_a_bare_norm():
    with pytest.raises(ValueError, match="model"):
        tk.patch(nn.RMSNorm(8))


def test_module_forward_takes_the_eager_fast_path(monkeypatch):
    # nn.Parameter weights must not force the (slower) dispatcher path in eager mode.
    import titan_kernels.ops.rms_norm as ops

    calls = []
    monkeypatch.setattr(ops.torch.ops.titan, "rms_norm", lambda *a: calls.append(a), raising=False)
    m = RMSNorm(8, eps=1e-6)
    x = torch.randn(2, 8, requires_grad=True)
    m(x).sum().backward()
    assert calls == [] and m.weight.grad is not None
