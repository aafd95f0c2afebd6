"""Memory estimate: the activation count against what autograd really saves, components, layout search."""
import pytest
import torch

from trainer.estimate import (
    GIB,
    USABLE_FRACTION,
    Devices,
    Layout,
    activation_values_per_token,
    estimate_memory,
    fit_report,
    suggest_layout,
)
from trainer.models.llama import ModelArgs, build_model, model_args
from trainer.parallel.activation_checkpoint import apply_ac


def _saved_values_per_token(args, mode, batch=2, seq=24):
    """Values autograd keeps for the blocks' backward (parameters and buffers excluded), per token."""
    model = build_model(args, device="cpu")
    model.init_weights(0)
    apply_ac(model, mode, "2")
    skip = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    saved = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            saved[s.data_ptr()] = s.nbytes() // t.element_size()
        return t

    x = torch.randn(batch, seq, args.dim, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for layer in model.layers.values():
            x = layer(x, model.rope)
    return sum(saved.values()) / (batch * seq)


@pytest.mark.parametrize("kv", [None, 2])
def test_activation_count_equals_autograd_saved_tensors(kv):
    args = ModelArgs(dim=96, n_layers=3, n_heads=6, n_kv_heads=kv, vocab_size=50, multiple_of=32,
                     ffn_dim_multiplier=1.3, max_seq_len=32)
    assert _saved_values_per_token(args, "none") == activation_values_per_token(args, "none")
    # full AC keeps each block's input; one block is recomputed at a time in the backward
    full_block = activation_values_per_token(args.replace(n_layers=1), "none")
    assert _saved_values_per_token(args, "full") + full_block == activation_values_per_token(args, "full")


def test_selective_modes_sit_between_none_and_full():
    args = model_args("8B", 128256, 8192)
    none, full = activation_values_per_token(args, "none"), activation_values_per_token(args, "full")
    op = activation_values_per_token(args, "selective", "op")
    every2 = activation_values_per_token(args, "selective", "2")
    assert full < op < none and full < every2 < none
    assert activation_values_per_token(args, "selective", "1") == full
    with pytest.raises(ValueError, match="activation_checkpoint.mode"):
        activation_values_per_token(args, "some")


def test_components_for_8b_on_8_gpus():
    args = model_args("8B", 128256, 8192)
    est = estimate_memory(args, Layout(1, 8), local_batch_size=1, seq_len=8192, compute_bytes=2, ac_mode="full")
    p = 8_030_261_248
    assert est.params == est.grads == p * 4 / 8
    assert est.optimizer == 2 * p * 4 / 8
    acts = (32 * 4096 + activation_values_per_token(args.replace(n_layers=1), "none")) * 2 * 8192
    assert est.activations == acts + 128256 * (2 + 8) * 8192
    assert est.total == pytest.approx(est.params + est.grads + est.optimizer + est.working + est.activations)
    # HSDP keeps a full copy per replica group: twice the per-device state of 8-way sharding
    hsdp = estimate_memory(args, Layout(2, 4), 1, 8192, ac_mode="full")
    assert hsdp.params == 2 * est.params


def test_suggestion_is_the_smallest_fitting_layout():
    args = model_args("70B", 128256, 8192)
    sug = suggest_layout(args, seq_len=8192, local_batch_size=8)
    assert sug is not None
    n = sug.layout.n_devices
    assert sug.estimate.total <= USABLE_FRACTION * 80 * GIB
    for ac, opt in (("none", "2"), ("selective", "op"), ("full", "2")):
        smaller = estimate_memory(args, Layout(1, n // 2), 1, 8192, ac_mode=ac, selective_ac_option=opt)
        assert smaller.total > USABLE_FRACTION * 80 * GIB
    assert "torchrun" in sug.describe() and f"data_parallel_shard_degree {n}" in sug.describe()


def test_fit_report_none_when_it_fits_and_a_message_when_not():
    cpu = Devices("cpu", 1, 20 * GIB, "test cpu")
    small = model_args("debugmodel", 258, 256)
    assert fit_report(small, "debugmodel", Layout(), 8, 256, 4, "none", "2", cpu) is None
    big = model_args("70B", 128256, 8192)
    msg = fit_report(big, "70B", Layout(), 1, 8192, 4, "full", "2", cpu)
    assert "70.55e9 parameters" in msg
    for part in ("parameters", "gradients", "optimizer state", "activations", "devices found", "test cpu",
                 "would fit", "H100"):
        assert part in msg, part
    gpu = Devices("cuda", 8, 141 * GIB, "NVIDIA H200")
    msg = fit_report(big, "70B", Layout(1, 8), 1, 8192, 2, "full", "2", gpu)
    assert "8 x NVIDIA H200" in msg and "x NVIDIA H200 (141 GiB" in msg.split("would fit:")[1]


def test_estimate_errors():
    with pytest.raises(ValueError, match="seq_len"):
        estimate_memory(model_args("8B", 128256, 64), Layout(), 1, 0)
