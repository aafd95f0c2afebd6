"""Offload in the estimate, the planner and the fit check (trainer/estimate/memory.py, estimate_offload.py,
plan.py, fit.py): the arithmetic against its formula, and the two cases of the issue:

- Llama 3 70B on 8 x H100 80 GB fits only with CPU offload (fp32 states alone are 140 GiB per GPU),
  and the plan says so with the step time it costs; on 16 GPUs nothing is offloaded.
- Llama 3 8B on one H100 at seq 8192: its fp32 states (120 GiB) can only live on the host (CPU
  offload); then at local batch 2 it fits with activation offload and not with every activation kept.
"""
import pytest

from trainer.config import parse_args
from trainer.estimate.memory import GIB, USABLE_FRACTION, Layout, block_values_per_token, estimate_memory, model_costs
from trainer.estimate.offload import (
    ADAMW_BYTES_PER_PARAM,
    HOST_STREAM_BYTES_PER_S,
    PCIE_GEN5_X16,
    cpu_optimizer_seconds,
    run_layer_modes,
)
from trainer.estimate.step_time import GPUS
from trainer.estimate.fit import Devices, fit_report
from trainer.estimate.plan import best, flavor_args, main, search

H100 = GPUS["H100"]
USABLE = USABLE_FRACTION * H100.memory


def test_cpu_offload_arithmetic_against_its_formula():
    args = flavor_args("8B", 8192)
    c = model_costs(args)
    n = 8
    on = estimate_memory(args, Layout(1, n), 1, 8192, ac_mode="full", cpu_offload=True)
    off = estimate_memory(args, Layout(1, n), 1, 8192, ac_mode="full")
    p_rank = (c.n_layers * c.block_params + c.embedding_params + c.output_params + c.norm_params) / n
    assert on.params == on.grads == on.optimizer == 0.0
    assert on.host == pytest.approx(16 * p_rank, rel=1e-12)  # fp32 param + grad + 2 AdamW states
    assert on.host == pytest.approx(off.params + off.grads + off.optimizer, rel=1e-12)
    root = (c.embedding_params + c.output_params + c.norm_params) / n * 4
    blocks = c.n_layers * c.block_params / n * 4
    assert on.h2d == pytest.approx(root + 2 * blocks, rel=1e-12)  # blocks gathered in forward and backward
    assert on.d2h == pytest.approx(4 * p_rank, rel=1e-12)  # one fp32 gradient shard
    assert on.working == pytest.approx(off.working + c.block_params / n * 4, rel=1e-12)
    accum = estimate_memory(args, Layout(1, n), 1, 8192, ac_mode="full", cpu_offload=True, grad_accum=3)
    assert accum.d2h == pytest.approx(3 * on.d2h) and accum.h2d == pytest.approx(3 * on.h2d)
    assert cpu_optimizer_seconds(c, p_rank) == pytest.approx(p_rank * ADAMW_BYTES_PER_PARAM[4] / HOST_STREAM_BYTES_PER_S)


def test_activation_offload_arithmetic_against_its_formula():
    args = flavor_args("8B", 8192)
    c = model_costs(args)
    tokens, keep = 2 * 8192, block_values_per_token(c, "none")
    none = estimate_memory(args, Layout(1, 8), 2, 8192)
    off = estimate_memory(args, Layout(1, 8), 2, 8192, ac_mode="offload")
    last = (c.dim + 1) * tokens * 2  # the final norm's input and rstd, on the device either way
    assert none.activations == pytest.approx(c.n_layers * keep * tokens * 2 + last, rel=1e-12)
    assert off.activations == pytest.approx(2 * keep * tokens * 2 + last, rel=1e-12)  # 2 blocks of staging
    assert off.host == pytest.approx(c.n_layers * keep * tokens * 2, rel=1e-12)
    assert off.h2d == off.d2h == off.host  # out in the forward, back in the backward
    mixed = estimate_memory(args, Layout(1, 8), 2, 8192, layer_modes=["offload"] * 16 + ["none"] * 16)
    assert mixed.host == pytest.approx(off.host / 2) and mixed.activations == pytest.approx(
        (16 + 2) * keep * tokens * 2 + last, rel=1e-12)


def test_70b_on_8_h100_fits_only_with_cpu_offload_and_says_what_it_costs(capsys):
    args = flavor_args("70B", 8192)
    assert search(args, "70B", 8, H100, 8192, offload=False) == []
    plans = best(args, "70B", 8, H100, 8192, top=3)
    assert plans and all(p.cpu_offload and p.memory.total <= USABLE for p in plans)
    p = plans[0]
    assert p.time.offload == pytest.approx(p.offload.exposed + p.offload.cpu_step)
    assert p.offload.pcie == pytest.approx(max(p.memory.h2d, p.memory.d2h) / (PCIE_GEN5_X16 * 0.8))
    assert "--training.enable_cpu_offload" in p.command()
    assert not any(q.offload for q in best(args, "70B", 16, H100, 8192, top=3))  # fits without: no offload
    assert main(["--flavor", "70B", "--ngpu", "8", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "no layout of 8 x H100 fits without offload; these need CPU offload" in out
    assert "offload: CPU offload" in out and "CPU optimizer step" in out and "s per step (" in out
    assert "smallest power-of-two count that fits is 16" in out


def test_8b_on_one_h100_at_8192_fits_with_activation_offload_and_not_without():
    args = flavor_args("8B", 8192)
    kw = dict(local_batch_size=2, seq_len=8192, cpu_offload=True)
    assert estimate_memory(args, Layout(1, 1), **kw).total > USABLE
    assert estimate_memory(args, Layout(1, 1), ac_mode="offload", **kw).total <= USABLE
    assert estimate_memory(args, Layout(1, 1), 2, 8192, ac_mode="offload").total > USABLE  # states need the host
    devices = Devices("cuda", 1, H100.memory * USABLE_FRACTION, "NVIDIA H100 80GB HBM3", 1024 * GIB)
    msg = fit_report(args, "8B", Layout(1, 1), 2, 8192, 2, "none", "2", devices, cpu_offload=True)
    assert "fits here with --activation_checkpoint.mode offload: peak" in msg
    msg = fit_report(args, "8B", Layout(1, 1), 2, 8192, 2, "none", "2", devices)
    assert "fits here with --training.enable_cpu_offload --activation_checkpoint.mode offload" in msg
    msg = fit_report(args, "8B", Layout(1, 1), 1, 8192, 2, "full", "2", devices)
    assert "fits here with --training.enable_cpu_offload: peak" in msg and "optimizer step runs on the CPU" in msg


def test_budget_mode_keeps_what_fits_for_a_run():
    args = flavor_args("8B", 8192)
    block = block_values_per_token(model_costs(args), "none") * 8192 * 2 / GIB
    argv = ["--flavor", "8B", "--training.seq_len", "8192", "--training.local_batch_size", "1",
            "--activation_checkpoint.mode", "budget", "--activation_checkpoint.memory_budget_gib", str(12 * block),
            "--activation_checkpoint.per_layer", "0:offload"]
    modes = run_layer_modes(parse_args(argv), args)
    # A block's copy (1.1 GB, 22 ms at 80% of 64 GB/s) hides behind the next block's backward (2 x 9 ms)
    # but not behind one forward: 13 of the 32 forwards carry the copies out; 9 kept + 2 of staging.
    assert modes.count("none") == 9 and modes[-9:] == ["none"] * 9
    assert modes[1:].count("offload") == 13 and modes[0] == "offload"  # layer 0 as per_layer says
    slow = run_layer_modes(parse_args([*argv, "--training.pcie_bandwidth_gbps", "8"]), args)
    assert "offload" not in slow[1:] and slow.count("none") >= 9  # at 8 GB/s recomputing is cheaper
    with pytest.raises(ValueError, match="below the least the activations need"):
        run_layer_modes(parse_args([*argv[:-4], "--activation_checkpoint.memory_budget_gib", "0.01"]), args)


@pytest.mark.parametrize("flag,value", [("--pcie_gbps", "inf"), ("--pcie_gbps", "nan"), ("--pcie_gbps", "0"),
                                        ("--host_memory_gib", "-1"), ("--host_memory_gib", "inf")])
def test_a_pcie_rate_or_host_memory_that_is_not_finite_and_positive_is_one_line(capsys, flag, value):
    """``--pcie_gbps inf`` priced every offload at 0 s and planned on; a bad value is named with what it got."""
    with pytest.raises(SystemExit) as info:
        main(["--flavor", "70B", "--ngpu", "8", flag, value])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == f"python -m trainer.plan: error: {flag}: expected a finite number > 0, got {float(value)!r}"
