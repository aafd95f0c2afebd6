"""Selective activation checkpointing ("op"): our ops' outputs are saved like aten's matmuls.

Checked: attention's forward kernel does not run again in the backward; what the policy saves per
token equals the memory estimate's count; the gradients equal those without checkpointing.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from titan_kernels import backend
from titan_kernels.ops.attention import aten as attention_aten
from trainer.estimate.memory import activation_values_per_token
from trainer.models.llama3.args import Llama3Args as ModelArgs
from trainer.registry import build_model
from trainer.parallel import activation_checkpoint as ac

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=50, multiple_of=32, max_seq_len=32)


def _model(mode, option="op"):
    model = build_model(ARGS, device="cpu")
    model.init_weights(0)
    ac.apply_ac(model, mode, option)
    return model


def _blocks(model, x):
    for layer in model.layers.values():
        x = layer(x, model.rope)
    return x


def test_titan_ops_are_in_the_save_list():
    assert torch.ops.titan.flash_attn.default in ac._SAVE_OPS
    assert torch.ops.titan.fp8_linear.default in ac._SAVE_OPS
    if hasattr(torch.ops.titan, "linear_cross_entropy"):
        assert torch.ops.titan.linear_cross_entropy.default in ac._SAVE_OPS


def test_attention_is_not_recomputed():
    calls = {"fwd": 0}
    fwd, bwd = attention_aten.IMPLS[("sdpa_flash", "cpu")]

    def counting_fwd(*args, **kw):
        calls["fwd"] += 1
        return fwd(*args, **kw)

    x = torch.randn(2, 24, ARGS.dim)
    grads = {}
    with backend.replace_impl("flash_attn", "sdpa_flash", (counting_fwd, bwd), family="cpu"):
        for mode in ("none", "selective"):
            torch.manual_seed(0)
            model = _model(mode)
            calls["fwd"] = 0
            xi = x.clone().requires_grad_()
            _blocks(model, xi).square().sum().backward()
            grads[mode] = [xi.grad] + [p.grad for p in model.parameters()]
            assert calls["fwd"] == ARGS.n_layers, (mode, calls)  # once per block: never again in the backward
    for a, b in zip(grads["none"], grads["selective"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class _SavedOutputs(TorchDispatchMode):
    """Counts the output elements of the ops the "op" policy saves."""

    def __init__(self):
        super().__init__()
        self.values = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in ac._SAVE_OPS:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            self.values += sum(t.numel() for t in outs if isinstance(t, torch.Tensor))
        return out


@pytest.mark.parametrize("kv", [None, 2])
def test_op_mode_saves_what_the_estimate_counts(kv):
    args = ARGS.replace(n_kv_heads=kv)
    model = build_model(args, device="cpu")
    model.init_weights(0)
    batch, seq = 2, 24
    x = torch.randn(batch, seq, args.dim, requires_grad=True)
    mode = _SavedOutputs()
    with mode:
        _blocks(model, x)
    block_inputs = args.n_layers * args.dim  # the checkpoint keeps each block's input
    saved = mode.values / (batch * seq) + block_inputs
    assert saved == activation_values_per_token(args, "selective", "op")
