"""What offload costs in time: the PCIe copies of a step and the optimizer step on the CPU, beside the
bytes ``trainer.estimate.memory`` counts (``MemoryEstimate.host``, ``h2d``, ``d2h``); and the per-layer
activation modes of ``--activation_checkpoint.mode budget`` for a run (:func:`run_layer_modes`).
Torch-free.

Model (per GPU, one optimizer step), stated so it can be checked:
  PCIe      max(h2d, d2h) / (bandwidth * LINK_EFFICIENCY): the two directions run at once; the
            bandwidth is per direction, nominal, default ``PCIE_GEN5_X16`` (64 GB/s; measured
            copies reach about 80% of it, like the other links of ``trainer.estimate.step_time``)
  exposed   the copies overlap the compute (FSDP2 issues them with its all-gathers and
            reduce-scatters, activation offload on a side stream): what exceeds the compute, plus one
            block's copy that nothing hides (the first shard in, the last block's activations back)
  CPU step  the optimizer on the host, counted whole (the trainer overlaps it with the next forward,
            unit by unit, which hides at most that forward: left as margin here): AdamW streams ``ADAMW_BYTES_PER_PARAM`` bytes per parameter of the rank's shard
            at ``HOST_STREAM_BYTES_PER_S``; Muon's Newton-Schulz adds about 5 iterations x 6 m^2 n
            FLOPs per m x n matrix (m <= n) at ``HOST_FLOPS``
The host constants are one GPU's share of a two-socket server of 8 GPUs (DGX H100: 2 x 56 cores,
2 x 8 channels of DDR5-4800, 614 GB/s in all), at about 60% of the peak, i.e. what a streaming kernel
sustains; ``bench/bench_offload.py`` measures ``fused_adamw_``'s rate on the machine at hand.
"""
from __future__ import annotations

from dataclasses import dataclass

from trainer.config.activation_policy import BlockCosts, base_mode, budget_modes, parse_per_layer
from trainer.estimate.memory import GIB, MemoryEstimate, ModelCosts, block_values_per_token, model_costs
from trainer.estimate.optimizer import block_vector_params
from trainer.estimate.step_time import COMPUTE_EFFICIENCY, GPUS

PCIE_GEN5_X16 = 64e9  # bytes/s per direction, nominal (32 GT/s x 16 lanes, 128b/130b)
HOST_STREAM_BYTES_PER_S = 45e9  # one GPU's share of host memory bandwidth a streaming kernel sustains
HOST_FLOPS = 0.5e12  # one GPU's share of the host's fp32 matmul rate
# fp32 AdamW: read param, grad, exp_avg, exp_avg_sq, write param, exp_avg, exp_avg_sq (4 bytes each);
# bf16 states save 2 bytes on each of the four state accesses.
ADAMW_BYTES_PER_PARAM = {4: 28, 2: 20}
NS_STEPS = 5


@dataclass(frozen=True)
class OffloadTime:
    """Seconds per step that offload adds (module docstring)."""

    pcie: float  # the copies, both directions at once
    exposed: float  # of them, not hidden behind the compute
    cpu_step: float  # the optimizer on the host (0 without CPU offload)

    @property
    def total(self) -> float:
        return self.exposed + self.cpu_step


def pcie_seconds(nbytes: float, bandwidth: float = PCIE_GEN5_X16, efficiency: float = 0.8) -> float:
    """Seconds to move ``nbytes`` one way at ``bandwidth`` bytes/s (nominal) x ``efficiency``."""
    return nbytes / (bandwidth * efficiency)


def cpu_optimizer_seconds(c: ModelCosts, params_per_rank: float, optimizer: str = "adamw", state_bytes: int = 4,
                          n_ranks: int = 1) -> float:
    """The optimizer step on the host for ``params_per_rank`` parameters (module docstring); Muon's
    hidden matrices (all of the model's, shared over ``n_ranks``) add their Newton-Schulz FLOPs."""
    t = params_per_rank * ADAMW_BYTES_PER_PARAM.get(state_bytes, 28) / HOST_STREAM_BYTES_PER_S
    if optimizer == "muon":
        hidden = c.n_layers * (c.block_params - block_vector_params(c))
        m = min(c.dim, c.ffn_hidden) if c.ffn_hidden else c.dim
        t += NS_STEPS * 6 * m * hidden / n_ranks / HOST_FLOPS
    return t


def offload_time(mem: MemoryEstimate, compute_s: float, block_copy_bytes: float, cpu_step_s: float = 0.0,
                 bandwidth: float = PCIE_GEN5_X16, efficiency: float = 0.8) -> OffloadTime:
    """The OffloadTime of a step whose estimate ``mem`` moves ``mem.h2d`` / ``mem.d2h`` bytes, beside
    ``compute_s`` of compute; ``block_copy_bytes``: the one copy nothing hides."""
    if not (mem.h2d or mem.d2h):
        return OffloadTime(0.0, 0.0, cpu_step_s)
    pcie = pcie_seconds(max(mem.h2d, mem.d2h), bandwidth, efficiency)
    exposed = max(0.0, pcie - compute_s) + pcie_seconds(block_copy_bytes, bandwidth, efficiency)
    return OffloadTime(pcie, exposed, cpu_step_s)


def block_costs(c: ModelCosts, tokens: float, tp: int, compute_bytes: int, peak_flops: float, efficiency: float,
                bandwidth: float = PCIE_GEN5_X16, link_efficiency: float = 0.8) -> BlockCosts:
    """One block's BlockCosts for a micro-batch of ``tokens`` tokens on a rank (after CP), at the
    GPU's ``peak_flops`` x ``efficiency`` and PCIe ``bandwidth`` x ``link_efficiency``."""
    keep = block_values_per_token(c, "none", tp) * tokens * compute_bytes
    full = block_values_per_token(c, "full", tp) * tokens * compute_bytes
    seq = c.args.max_seq_len if c.args is not None else 8192
    fwd_flops = (2 * c.block_params + c.attention_flops_per_token(seq) / (3 * c.n_layers)) * tokens / tp
    return BlockCosts(keep, full, fwd_flops / (peak_flops * efficiency), bandwidth * link_efficiency)


def run_layer_modes(config, args, tp: int = 1, cp: int = 1, compute_bytes: int = 2, device_name: str = "") -> list[str] | None:
    """The per-layer activation modes of a run (a JobConfig ``config``, model ``args``): mode budget's
    choice (:func:`trainer.config.activation_policy.budget_modes` for ``memory_budget_gib``), with
    ``per_layer``'s rules on top; None when neither is set (the mode alone decides). The compute
    time of a block is taken at ``COMPUTE_EFFICIENCY`` of the peak of the GPU ``device_name`` names
    (``GPUS``; an H100 when none matches, e.g. on the CPU).

    Raises:
        ValueError: a bad per_layer rule, budget without a memory_budget_gib > 0, or a budget too small.
    """
    ac = config.activation_checkpoint
    n = args.n_layers
    rules = parse_per_layer(list(ac.per_layer), n)
    if ac.mode != "budget":
        return None if not rules else [rules.get(i) or base_mode(ac.mode, ac.selective_ac_option, i) for i in range(n)]
    if ac.memory_budget_gib <= 0:
        raise ValueError(f"--activation_checkpoint.memory_budget_gib: expected a value > 0 with mode budget, got "
                         f"{ac.memory_budget_gib!r}")
    c = model_costs(args)
    tokens = config.training.local_batch_size * config.training.seq_len / cp
    gpu = next((g for name, g in GPUS.items() if name in device_name.upper()), GPUS["H100"])
    costs = block_costs(c, tokens, tp, compute_bytes, gpu.peak_flops, COMPUTE_EFFICIENCY,
                        config.training.pcie_bandwidth_gbps * 1e9)
    modes = budget_modes(n, ac.memory_budget_gib * GIB, costs)
    return [rules.get(i, m) for i, m in enumerate(modes)]
