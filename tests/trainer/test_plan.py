"""The layout planner (``python -m trainer.plan``): its output, its commands (valid trainer configs
whose layout multiplies to N), every flavor at 8..16384 GPUs in seconds, the step-time model's parts;
and the memory model against the measured peak of live tensors on the CPU (tests/trainer/memory_probe.py).
"""
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.trainer import memory_probe
from trainer.config import parse_args
from trainer.estimate.memory import GIB, USABLE_FRACTION, Layout
from trainer.estimate.step_time import GPUS
from trainer.models.llama3.args import LLAMA3_FLAVORS
from trainer.models.qwen3.args import QWEN3_FLAVORS
from trainer.estimate.plan import best, evaluate, flavor_args, main, search

REPO = Path(__file__).resolve().parents[2]


def _check_plan(p, n_gpus):
    L = p.layout
    assert L.n_devices == n_gpus
    assert p.memory.total <= USABLE_FRACTION * p.gpu.memory
    assert 0 < p.mfu < 1 and p.time.total > 0
    config = parse_args(p.trainer_flags())  # every flag is a real key with a valid value
    par = config.parallelism
    assert (par.data_parallel_replicate_degree * par.data_parallel_shard_degree * par.tensor_parallel_degree
            * par.pipeline_parallel_degree * par.context_parallel_degree) == n_gpus
    assert config.training.local_batch_size == p.local_batch_size
    assert config.activation_checkpoint.mode == p.ac_mode  # not the flavor's TOML default
    assert config.parallelism.tensor_parallel_degree == L.tp and config.parallelism.pipeline_parallel_degree == L.pp
    # EP is within dp_shard (not in the product); explicit for a MoE flavor (its TOML sets another)
    assert par.expert_parallel_degree == L.ep and (L.ep == 1 or par.data_parallel_shard_degree % L.ep == 0)


@pytest.mark.parametrize("flavor, n", [("70B", 64), ("405B", 512)])
def test_cli_prints_the_best_layouts_with_memory_communication_time_and_command(capsys, flavor, n):
    t0 = time.perf_counter()
    assert main(["--flavor", flavor, "--ngpu", str(n), "--top", "3"]) == 0
    assert time.perf_counter() - t0 < 10
    out = capsys.readouterr().out
    assert out.count("\n#") == 3 and "assumptions:" in out
    for part in ("memory per GPU (GiB): params", "communication per step (GiB sent per GPU)", "step time (s): compute",
                 "tokens/s per GPU", "MFU", f"sbatch --nodes {n // 8} --gpus-per-node 8 scripts/slurm/train.sbatch",
                 f"torchrun --nnodes {n // 8} --nproc_per_node 8 --rdzv_backend c10d", "--max-restarts 3"):
        assert part in out, part
    plans = best(flavor_args(flavor, 8192), flavor, n, GPUS["H100"], 8192, top=3)
    for p in plans:
        _check_plan(p, n)
    assert plans[0].tokens_per_s_per_gpu >= plans[-1].tokens_per_s_per_gpu


@pytest.mark.parametrize("model, flavors", [("llama3", LLAMA3_FLAVORS), ("qwen3", QWEN3_FLAVORS)])
def test_every_flavor_from_8_to_16384_gpus_quickly(model, flavors):
    for flavor in flavors:
        for n in (8, 24, 512, 16384):
            t0 = time.perf_counter()
            args = flavor_args(flavor, 8192, model=model)
            plans = best(args, flavor, n, GPUS["H100"], 8192, top=2)
            assert time.perf_counter() - t0 < 10, (flavor, n)
            if 16 * args.num_params() / n > USABLE_FRACTION * GPUS["H100"].memory:
                assert not plans  # 16 bytes of state per parameter alone exceed n x 72 GiB
                continue
            assert plans, (flavor, n)
            for p in plans:
                _check_plan(p, n)
                # Llama: over the 16Mi-token cap only where no split of the model can bring it down,
                # and then with the smallest batch: one sequence per GPU's data-parallel rank
                assert model != "llama3" or p.tokens_per_step <= 2**24 or p.tokens_per_step <= 8192 * n // (p.layout.tp * p.layout.pp)
    # the tied Llama 3.2 models are never given TP or PP (the trainer refuses them)
    assert all(p.layout.tp == p.layout.pp == 1 for p in search(flavor_args("1B", 8192), "1B", 64, GPUS["H100"], 8192))


def test_cli_without_a_fitting_layout_names_the_smallest_count_and_one_node_uses_torchrun(capsys):
    assert main(["--flavor", "405B", "--ngpu", "8"]) == 1
    assert "no layout of 8 x H100 fits; the smallest power-of-two count that fits: " in capsys.readouterr().out
    assert main(["--flavor", "8B", "--ngpu", "8", "--gpu", "H200", "--top", "1"]) == 0
    assert "torchrun --standalone --nproc_per_node 8 --max-restarts 3 -m trainer --flavor 8B" in capsys.readouterr().out
    # python -m trainer.plan loads no torch (which is what makes it fast)
    code = "import sys, trainer.plan; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


def test_step_time_model_parts():
    args = flavor_args("405B", 8192)
    gpu = GPUS["H100"]
    p = evaluate(args, "405B", gpu, Layout(1, 8, 8, 8), 16, 8192, "full", "2", "Interleaved1F1B")
    t = p.time
    # bubble = (compute + TP) * (pp - 1) / (v * m) with v = 2 stages per rank, m = 16 micro-batches
    assert t.bubble == pytest.approx((t.compute + t.tp) * 7 / 32)
    assert p.comm_links == {"dp_shard_cp": "IB", "tp": "NVLink", "pp": "IB"}
    # full AC re-runs the blocks' forward: a third more block FLOPs than the model FLOPs
    none = evaluate(args, "405B", gpu, Layout(1, 8, 8, 8), 16, 8192, "none", "2", "Interleaved1F1B")
    assert 1.25 < t.compute / none.time.compute < 4 / 3 and p.model_flops == none.model_flops
    # MFU counts model FLOPs only
    assert p.mfu == pytest.approx(p.model_flops / (t.total * gpu.peak_flops))
    # FSDP inside one node uses NVLink, across nodes the network
    small = evaluate(flavor_args("8B", 8192), "8B", gpu, Layout(1, 8), 1, 8192, "none", "2", None)
    assert small.comm_links["dp_shard_cp"] == "NVLink"


def test_memory_model_within_15_percent_of_the_measured_peak_on_one_process():
    case = "1 process, full AC"
    world, argv, _ = memory_probe.CASES[case]
    got, est = memory_probe.measure(world, argv), memory_probe.estimate(case).total
    assert abs(est / got - 1) < 0.15, (got / GIB, est / GIB)


@pytest.mark.slow  # about 5 minutes on 2 shared cores: 9 layouts, most on 2 processes
def test_memory_model_within_15_percent_of_the_measured_peak_under_every_layout():
    rows = memory_probe.table(list(memory_probe.CASES))
    bad = [(case, got, est) for case, got, est in rows if abs(est / got - 1) >= 0.15]
    assert not bad, bad


def test_moe_counts_active_parameters_for_flops_and_all_for_memory():
    from trainer.estimate.memory import model_costs
    moe = QWEN3_FLAVORS["30B-A3B"]
    c = model_costs(moe)
    assert c.total_params == moe.num_params() and c.active_params == moe.active_params() < c.total_params / 5
    assert c.flops_per_token(4096) == moe.flops_per_token(4096)
    assert c.ffn_hidden == moe.moe.top_k * moe.moe.hidden_dim  # the activations of the experts a token visits
    assert c.q_dim == moe.n_heads * moe.head_dim != moe.dim
    plans = best(flavor_args("30B-A3B", 4096, model="qwen3"), "30B-A3B", 64, GPUS["H100"], 4096, top=2)
    assert plans and all(p.trainer_flags()[:2] == ["--model.name", "qwen3"] for p in plans)
    for p in plans:
        _check_plan(p, 64)


def test_planner_proposes_expert_parallel_for_moe_and_prints_total_and_active(capsys):
    assert main(["--model", "qwen3", "--flavor", "30B-A3B", "--ngpu", "8", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("30B-A3B: 30.53e9 parameters (3.35e9 active), seq_len 8192, on 8 x H100")
    assert "x EP 2" in out and "--parallelism.expert_parallel_degree 2" in out and "EP all-to-all" in out
    assert "experts 13.50 of the params, over ep 2 x dp_shard_mod_ep 4" in out
    args = flavor_args("30B-A3B", 8192, model="qwen3")
    for n in (8, 64):
        plans = search(args, "30B-A3B", n, GPUS["H100"], 8192)
        eps = {p.layout.ep for p in plans}
        assert {2, 4, 8} <= eps and max(eps) <= 128, (n, eps)  # the degrees dividing dp_shard and 128 experts
        for p in [q for q in plans if q.layout.ep > 1][:3]:
            _check_plan(p, n)  # it fits, and its command is a valid config with that ep
            assert p.layout.cp == p.layout.dp_replicate == 1  # EP is not supported with CP or HSDP
    # 235B-A22B on 64 GPUs: the best layout is expert parallel
    big = best(flavor_args("235B-A22B", 8192, model="qwen3"), "235B-A22B", 64, GPUS["H100"], 8192, top=1)
    assert big and big[0].layout.ep == 8
    _check_plan(big[0], 64)
    # no expert parallel for dense models
    assert {p.layout.ep for p in search(flavor_args("8B", 8192), "8B", 8, GPUS["H100"], 8192)} == {1}


def test_expert_parallel_memory_communication_and_time_terms():
    from trainer.estimate.memory import estimate_memory, model_costs

    args = flavor_args("30B-A3B", 8192, model="qwen3")
    c, gpu = model_costs(args), GPUS["H100"]
    one, ep8 = (evaluate(args, "30B-A3B", gpu, Layout(1, 16, ep=ep), 1, 8192, "full", "2", None) for ep in (1, 8))
    # the experts' state is sharded over ep x dp_shard_mod_ep = dp_shard either way: same bytes; only E/ep of
    # each block's experts are gathered (2 blocks in bf16 + one block's fp32 gradients)
    assert (one.memory.params, one.memory.grads, one.memory.optimizer) == (
        ep8.memory.params, ep8.memory.grads, ep8.memory.optimizer)
    assert one.expert_state == ep8.expert_state == pytest.approx(4 * c.expert_params / 16)
    assert one.memory.working - ep8.memory.working == pytest.approx((2 * 2 + 4) * c.expert_params / 48 * 7 / 8)
    assert one.memory.total == estimate_memory(c, Layout(1, 16), 1, 8192, ac_mode="full").total
    # all-to-all bytes per step: tokens x top_k x dim x 2 bytes x 2 directions x (forward + backward), for the
    # (ep-1)/ep of the rows that leave the rank, every MoE layer, full AC's recomputed forward twice more
    a2a = 8192 * 8 * 2048 * 2 * 7 / 8 * (4 + 2) * 48
    assert ep8.comm_bytes["ep"] == pytest.approx(a2a) and "ep" not in one.comm_bytes
    assert ep8.comm_links["ep"] == "NVLink" and ep8.comm_links["dp_shard_mod_ep"] == "IB"  # ep inner, 2 nodes
    assert ep8.time.ep == pytest.approx(a2a / (gpu.nvlink * 0.8))
    assert ep8.time.total == pytest.approx(ep8.time.compute + ep8.time.ep + ep8.time.fsdp)
    # an expert count ep must divide: 8 experts on dp_shard 12 allow 1, 2, 4
    from trainer.estimate.plan import ep_choices

    moe = flavor_args("debugmodel_moe", 2048, model="qwen3")
    assert ep_choices(moe, 12) == [1, 2, 4] and ep_choices(moe, 12, dp_replicate=2) == [1]
    assert ep_choices(moe, 12, cp=2) == [1] and ep_choices(args.replace(moe=None), 16) == [1]
