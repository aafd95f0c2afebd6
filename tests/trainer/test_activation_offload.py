"""Activation offload and the per-layer modes (trainer/parallel/activation_offload.py,
trainer/config/activation_policy.py), on the CPU where the hooks run as on a GPU without streams.

Checked: with every block offloaded (and with a per-layer mix of keep / offload / full / op) the
gradients are bitwise those without; the saved activations really leave (bytes counted, the forward's
tensors are copies); the backward fetches each block once, the block before it one step ahead; a
second backward through the same graph is refused; the budget policy keeps the last blocks and
offloads or recomputes the rest against the memory it is given.
"""
import pytest
import torch

from tests.trainer.helpers import config_error
from trainer.config.activation_policy import BlockCosts, budget_modes, describe, memory_of, parse_per_layer
from trainer.models.llama3.args import Llama3Args as ModelArgs
from trainer.registry import build_model
from trainer.parallel import activation_checkpoint as ac

ARGS = ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=50, multiple_of=32, max_seq_len=32)


def _grads(mode="none", layer_modes=None):
    torch.manual_seed(0)
    model = build_model(ARGS, device="cpu")
    model.init_weights(0)
    ac.apply_ac(model, mode, "op", layer_modes=layer_modes, device="cpu")
    x = torch.randn(3, 29, ARGS.dim, requires_grad=True)  # awkward sequence length
    h = x
    for layer in model.layers.values():
        h = layer(h, model.rope)
    h.square().sum().backward()
    return model, [x.grad] + [p.grad for p in model.layers.parameters()]


def test_offloaded_blocks_give_the_same_gradients_and_leave_the_device():
    _, ref = _grads("none")
    model, got = _grads("offload")
    off = model._titan_offloader
    # Every block saves its q/k/v, attention output, SwiGLU inputs...: at least 4 block inputs' worth each.
    assert off.bytes_offloaded >= ARGS.n_layers * 4 * 3 * 29 * ARGS.dim * 4, off.bytes_offloaded
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    mixed = {0: "offload", 1: "full", 2: "op", 3: "none"}
    model, got = _grads("none", mixed)
    assert model._titan_offloader.bytes_offloaded > 0
    for a, b in zip(ref, got):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # full / op recompute in another order


def test_backward_fetches_each_block_once_one_ahead_and_refuses_a_second_backward(monkeypatch):
    torch.manual_seed(0)
    model = build_model(ARGS, device="cpu")
    model.init_weights(0)
    ac.apply_ac(model, "offload", device="cpu")
    off = model._titan_offloader
    order = []
    fetch = off._fetch
    monkeypatch.setattr(off, "_fetch", lambda rec: (order.append(off._pending.index(rec)), fetch(rec)))
    x = torch.randn(2, 16, ARGS.dim, requires_grad=True)
    h = x
    for layer in model.layers.values():
        h = layer(h, model.rope)
    loss = h.sum()
    assert order == []  # nothing comes back during the forward
    loss.backward(retain_graph=True)
    assert order == [3, 2, 1, 0]  # last block first, each fetched once (the one before it prefetched)
    with pytest.raises(RuntimeError, match="retain_graph=True is not supported with activation offload"):
        loss.backward()


def test_per_layer_rules_and_their_errors():
    assert parse_per_layer(["0-2:offload", "3:full"], 4) == {0: "offload", 1: "offload", 2: "offload", 3: "full"}
    assert describe(["offload", "offload", "none", "full"]) == "0-1:offload,2:none,3:full"
    for rule, words in (("0-2", "expected 'LAYERS:MODE'"), ("0:keep", "expected a mode of"),
                        ("3-1:full", "is reversed"), ("x:full", "a layer id or a range"), ("9:full", "does not exist")):
        with pytest.raises(ValueError, match=words):
            parse_per_layer([rule], 4)


def test_per_layer_rules_that_overlap_are_refused():
    """'0-1:offload,1-3:full' gave layer 1 the later rule's mode without a word."""
    from tests.trainer.helpers import config_error

    for rules in (["0-1:offload", "1-3:full"], ["2:full", "0-3:none"], ["1:op", "1:op"]):
        with pytest.raises(ValueError, match="is in both"):
            parse_per_layer(rules, 4)
    err = config_error(["--activation_checkpoint.per_layer", "0-1:offload,1-3:full"])
    assert "--activation_checkpoint.per_layer: layer 1 is in both '0-1:offload' and '1-3:full'" in err


def test_budget_keeps_the_last_blocks_and_offloads_where_pcie_keeps_up():
    fast = BlockCosts(keep_bytes=10.0, full_bytes=1.0, forward_s=1.0, pcie_bytes_per_s=100.0)  # copy 0.1 s
    slow = BlockCosts(keep_bytes=10.0, full_bytes=1.0, forward_s=1.0, pcie_bytes_per_s=2.0)  # copy 5 s
    assert fast.cheaper_to_offload and not slow.cheaper_to_offload
    # 8 blocks of 10: all kept needs 80; offloading costs 2 blocks of staging.
    assert budget_modes(8, 80.0, fast) == ["none"] * 8
    modes = budget_modes(8, 50.0, fast)
    assert modes == ["offload"] * 5 + ["none"] * 3 and memory_of(modes, fast) == 3 * 10.0 + 2 * 10.0
    modes = budget_modes(8, 50.0, slow)  # recompute: inputs 1 each + one block recomputed at a time
    assert modes == ["full"] * 5 + ["none"] * 3 and memory_of(modes, slow) == 5 * 1.0 + 3 * 10.0 + 10.0
    mid = BlockCosts(keep_bytes=10.0, full_bytes=1.0, forward_s=1.0, pcie_bytes_per_s=5.0)  # copy 2 s
    assert mid.offload_exposed_s == 0.0 and mid.max_offloaded(8) == 4  # 4 copies of 2 s in 8 forwards of 1 s
    modes = budget_modes(8, 50.0, mid)
    assert modes[-2:] == ["none"] * 2 and modes.count("offload") == 4 and modes.count("full") == 2
    with pytest.raises(ValueError, match="below the least the activations need"):
        budget_modes(8, 5.0, fast)


def test_offload_options_refused_in_one_line():
    assert "does not combine with --compile.enable" in config_error(
        ["--activation_checkpoint.mode", "offload", "--compile.enable"])
    assert "does not combine with --compile.enable" in config_error(
        ["--activation_checkpoint.per_layer", "1:offload", "--compile.enable"])
    msg = config_error(["--training.enable_cpu_offload", "--float8.enable_fsdp_float8_all_gather"])
    assert msg.startswith("--training.enable_cpu_offload: does not combine with --float8.enable_fsdp_float8_all_gather")
    assert "expected a value > 0 (GiB) with --activation_checkpoint.mode budget" in config_error(
        ["--activation_checkpoint.mode", "budget"])
    assert "expected a mode of none, op, full, offload" in config_error(["--activation_checkpoint.per_layer", "0:x"])
    assert "--training.pcie_bandwidth_gbps: expected a finite value > 0" in config_error(
        ["--training.pcie_bandwidth_gbps", "0"])
