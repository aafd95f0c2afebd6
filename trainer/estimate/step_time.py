"""The step time of a layout on a GPU, and the GPU table (``GPUS``); ``trainer.plan`` ranks the
layouts by it.

Step-time model (per GPU, one optimizer step), stated so it can be checked:
  compute   model FLOPs (``6 N + attention``, torchtitan's formula; active parameters for MoE) of
            the rank's tokens / (tp * pp * cp), times the recomputation (full AC re-runs each block's
            forward: +1/3 of the block FLOPs), at ``COMPUTE_EFFICIENCY`` of the GPU's dense bf16
            peak (matmuls, attention and the memory-bound ops together), set between torchtitan's
            two published H100 runs it must reproduce: Llama 3 8B on 8 GPUs (FSDP, local batch 2,
            selective AC; 5,762 tokens/s per GPU, this model +33%) and 405B on 512 GPUs (FSDP 8 x
            TP 8 x PP 8 Interleaved1F1B; 128, this model -28% with local batch 16): a ranking aid
            more than a promise
  TP        bytes / NVLink bandwidth: on the critical path (no async TP assumed)
  CP        the K/V blocks ring attention sends (``trainer.estimate.comm``), hidden behind the
            attention compute where they fit
  FSDP/HSDP all-gathers and reduce-scatters overlap with compute; exposed: what exceeds the
            compute, plus one unit's worth (the first all-gather and last reduce-scatter)
  PP        sends between stages on the critical path, and the bubble:
            (compute + TP + EP) * (pp - 1) / (v * m), m micro-batches, v stages per rank
  EP        the token all-to-alls (per MoE layer and micro-batch: rows of tokens * top_k * dim
            bf16 values out and back in the forward, their gradients in the backward; (ep-1)/ep of
            them leave the rank) on the critical path: the experts wait for their rows. The
            experts' weights and optimizer state are sharded over ep x dp_shard_mod_ep (= dp_shard)
            ranks, the rest over dp_shard x cp as without EP, so EP changes the state bytes not at
            all; it gathers only E/ep experts per block (less memory) and all-gathers / reduce-scatters
            them over dp_shard_mod_ep ranks only (less FSDP traffic, overlapped like the rest)
  bandwidth per GPU and direction: NVLink inside a node (8 GPUs) and InfiniBand across nodes, at
            80% of the link rate (``GPUS``); a group whose ranks span nodes runs at the network's.
            A group's span follows the mesh order (pp, dp_replicate, dp_shard, cp, tp): tp innermost;
            with EP dp_shard is (dp_shard_mod_ep, ep), ep inner.
  MFU       model FLOPs / (step time * peak), as the trainer reports it.
"""
from __future__ import annotations

from dataclasses import dataclass

from trainer.estimate.memory import GIB, Layout, ModelCosts, stages_per_rank

# Share of the dense bf16 peak a training step sustains in its compute (see the module docstring).
COMPUTE_EFFICIENCY = 0.45
LINK_EFFICIENCY = 0.8


@dataclass(frozen=True)
class GPU:
    """A GPU and its node: memory (bytes), dense bf16 peak (FLOP/s), NVLink and network bandwidth
    (bytes/s per GPU and direction, nominal; ``LINK_EFFICIENCY`` of it is used)."""

    name: str
    memory: float
    peak_flops: float
    nvlink: float
    network: float


GPUS = {
    # H100/H200 SXM: NVLink 4 (900 GB/s both directions), one 400 Gb/s NDR InfiniBand NIC per GPU.
    "H100": GPU("H100", 80 * GIB, 989e12, 450e9, 50e9),
    "H200": GPU("H200", 140 * GIB, 989e12, 450e9, 50e9),
    # A100 SXM 80 GB: NVLink 3 (600 GB/s), 200 Gb/s HDR per GPU.
    "A100": GPU("A100", 80 * GIB, 312e12, 300e9, 25e9),
    # B200: NVLink 5 (1.8 TB/s), 800 Gb/s per GPU.
    "B200": GPU("B200", 180 * GIB, 2250e12, 900e9, 100e9),
}


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step by part (module docstring); ``total`` is their sum."""

    compute: float
    tp: float
    cp: float
    fsdp: float
    pp: float
    bubble: float
    ep: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + self.tp + self.cp + self.fsdp + self.pp + self.bubble + self.ep

    def describe(self) -> str:
        parts = [("compute", self.compute), ("TP", self.tp), ("CP", self.cp), ("EP all-to-all", self.ep),
                 ("FSDP exposed", self.fsdp), ("PP sends", self.pp), ("bubble", self.bubble)]
        return " + ".join(f"{n} {v:.3g}" for n, v in parts if v > 0 or n == "compute") + f" = {self.total:.3g} s"


def link(stride: int, size: int, gpus_per_node: int) -> str:
    """The link of a group of ``size`` ranks ``stride`` apart in the mesh: NVLink inside a node, else IB."""
    return "NVLink" if stride * size <= gpus_per_node else "IB"


def step_time(costs: ModelCosts, gpu: GPU, layout: Layout, local_batch_size: int, seq_len: int, ac_mode: str,
              selective_ac_option: str, schedule: str | None, comm: dict[str, float], links: dict[str, str],
              efficiency: float = COMPUTE_EFFICIENCY) -> tuple[StepTime, float]:
    """(StepTime, model FLOPs per GPU) of one optimizer step (module docstring)."""
    tp, pp, cp = layout.tp, layout.pp, layout.cp
    tokens_rank = local_batch_size * seq_len  # per data-parallel rank and step (no accumulation)
    flops = costs.flops_per_token(seq_len) * tokens_rank / (tp * pp * cp)
    out_share = 6 * costs.output_params * tokens_rank / (tp * pp * cp) if not costs.tied else 0.0
    block_flops = max(flops - out_share, 0.0)
    recompute = 0.0
    if ac_mode == "full":
        recompute = block_flops / 3
    elif ac_mode == "selective" and selective_ac_option != "op":
        recompute = block_flops / 3 / int(selective_ac_option)
    rate = gpu.peak_flops * efficiency
    t_compute = (flops + recompute) / rate
    t_attn = costs.attention_flops_per_token(seq_len) * tokens_rank / (tp * pp * cp) / rate

    def seconds(dim: str) -> float:
        bw = (gpu.nvlink if links.get(dim) == "NVLink" else gpu.network) * LINK_EFFICIENCY
        return comm.get(dim, 0.0) / bw

    t_tp = seconds("tp")
    t_cp = max(0.0, seconds("cp") - t_attn)
    t_ep = seconds("ep")  # on the critical path: the experts wait for their rows
    t_fsdp = seconds("dp_shard_cp") + seconds("dp_replicate") + seconds("dp_shard_mod_ep")
    units = costs.n_layers / pp + 1
    t_fsdp_exposed = max(0.0, t_fsdp - t_compute) + (t_fsdp / units if t_fsdp else 0.0)
    t_pp = seconds("pp")
    bubble = 0.0
    if pp > 1:
        v = stages_per_rank(schedule)
        bubble = (t_compute + t_tp + t_ep) * (pp - 1) / (v * local_batch_size)
    return StepTime(t_compute, t_tp, t_cp, t_fsdp_exposed, t_pp, bubble, t_ep), flops
