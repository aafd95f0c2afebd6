"""Memory estimate: the activation count against what autograd really saves, components, layout search."""
import pytest
import torch

from trainer.estimate.memory import (
    GIB,
    Layout,
    activation_values_per_token,
    block_values_per_token,
    estimate_memory,
    pipeline_ranks,
)
from trainer.estimate.fit import Devices, fit_report
from trainer.models.llama3.args import Llama3Args as ModelArgs
from trainer.registry import build_model
from tests.trainer.helpers import llama_model_args as model_args
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
    est = estimate_memory(args, Layout(1, 8), local_batch_size=1, seq_len=8192, compute_bytes=2, ac_mode="full",
                          fused_loss=False)
    p = 8_030_261_248
    assert est.params == est.grads == p * 4 / 8
    assert est.optimizer == 2 * p * 4 / 8
    block = activation_values_per_token(args.replace(n_layers=1), "none")
    final_norm = 2 * 4096 + 1
    assert est.activations == (32 * 4096 + block + final_norm) * 2 * 8192
    assert est.loss == 12 * 8192 * 128256  # unfused: float32 log-softmax, its gradient, the logits' gradient
    # the peak: at the start of the backward (all activations, no gradient yet) or at its end (all
    # gradients and the first block's activations), whichever is larger
    static = est.params + est.optimizer + est.working
    assert est.total == pytest.approx(static + max(est.activations + est.loss, est.grads + est.last_block))
    fused = estimate_memory(args, Layout(1, 8), 1, 8192, ac_mode="full")  # the trainer's default loss
    assert fused.loss < est.loss / 3  # the hidden and weight gradients and two logit chunks
    # HSDP keeps a full copy per replica group: twice the per-device state of 8-way sharding
    hsdp = estimate_memory(args, Layout(2, 4), 1, 8192, ac_mode="full")
    assert hsdp.params == 2 * est.params
    # gradient accumulation: gradients of the first micro-batch live through the second one's forward
    accum = estimate_memory(args, Layout(1, 8), 1, 8192, ac_mode="full", grad_accum=2)
    assert accum.total == pytest.approx(static + accum.activations + accum.loss + accum.grads)


def test_tensor_parallel_keeps_the_gathered_norm_outputs_whole():
    args = model_args("70B", 128256, 8192)
    d = args.dim
    # the two all-gathered norm outputs (inputs of wq/wk/wv and w1/w3) are not divided by tp
    assert block_values_per_token(args, "none", tp=8) == pytest.approx(2 * d + (block_values_per_token(args, "none")
                                                                                  - 2 * d) / 8)
    est1 = estimate_memory(args, Layout(1, 8), 1, 8192)
    est8 = estimate_memory(args, Layout(1, 1, 8), 1, 8192)
    assert est1.activations / 8 < est8.activations < est1.activations / 4


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B", "ZBVZeroBubble"])
def test_pipeline_ranks_hold_the_layers_plan_stages_gives_them(schedule):
    from trainer.parallel.pipeline import plan_stages

    for n_layers, pp in ((6, 2), (126, 8), (80, 4), (7, 3)):
        if n_layers < pp * (1 if schedule == "1F1B" else 2):
            continue
        ranks = pipeline_ranks(n_layers, pp, schedule)
        for r, (layers, first, last) in enumerate(ranks):
            plan = plan_stages(n_layers, pp, r, schedule)
            assert layers == sum(len(plan.layers[s]) for s in plan.local_stages)
            assert first == (0 in plan.local_stages) and last == (plan.num_stages - 1 in plan.local_stages)


def test_pipeline_stage_memory_is_a_fraction_and_in_flight_micro_batches_count():
    args = model_args("70B", 128256, 8192)
    one = estimate_memory(args, Layout(1, 8), 8, 8192, ac_mode="full")
    pp4 = estimate_memory(args, Layout(1, 8, 1, 4), 8, 8192, ac_mode="full", microbatch_size=1)
    assert pp4.params == pytest.approx(one.params / 4, rel=0.05)
    gpipe = estimate_memory(args, Layout(1, 8, 1, 4), 8, 8192, ac_mode="full", pp_schedule="GPipe")
    inter = estimate_memory(args, Layout(1, 8, 1, 4), 8, 8192, ac_mode="full", pp_schedule="Interleaved1F1B")
    assert pp4.activations < inter.activations < gpipe.activations


def test_fit_report_none_when_it_fits_and_a_message_when_not():
    cpu = Devices("cpu", 1, 20 * GIB, "test cpu")
    small = model_args("debugmodel", 258, 256)
    assert fit_report(small, "debugmodel", Layout(), 8, 256, 4, "none", "2", cpu) is None
    big = model_args("405B", 128256, 8192)
    msg = fit_report(big, "405B", Layout(), 1, 8192, 4, "full", "2", cpu)
    assert "405.85e9 parameters" in msg
    for part in ("parameters", "gradients", "optimizer state", "activations", "devices found", "test cpu",
                 "would fit", "H100", "--parallelism.tensor_parallel_degree", "python -m trainer.plan --model.name llama3 --flavor 405B"):
        assert part in msg, part
    gpu = Devices("cuda", 8, 141 * GIB, "NVIDIA H200")
    msg = fit_report(big, "405B", Layout(1, 8), 1, 8192, 2, "full", "2", gpu)
    assert "8 x NVIDIA H200" in msg and "x H200," in msg.split("would fit:")[1]
    # the suggestion fits and is the smallest power-of-two GPU count that does
    from trainer.estimate.step_time import GPUS
    from trainer.estimate.plan import search

    n = int(msg.split("would fit:")[1].split(" x H200")[0])
    assert not search(big, "405B", n // 2, GPUS["H200"], 8192, memory_only=True)


def test_estimate_errors():
    with pytest.raises(ValueError, match="seq_len"):
        estimate_memory(model_args("8B", 128256, 64), Layout(), 1, 0)
