"""Layout planner: the best parallel layouts of a flavor on N GPUs, with memory, communication,
step time and the command that runs them.

    python -m trainer.plan --flavor 405B --ngpu 512 [--gpu H100|H200|A100|B200] [--seq_len 8192]
                           [--local_batch_size N] [--top 5] [--optimizer adamw|muon]
                           [--state_dtype float32|bfloat16] [--compare_optimizers]
                           [--pcie_gbps 64] [--host_memory_gib 2048]

Search: every tensor-parallel degree inside a node that divides the heads, KV heads, FFN and
vocabulary (and a MoE model's expert hidden size); context-parallel degrees up to seq_len / 8192 that
the sequence split allows; pipeline degrees up to the layer count (schedules 1F1B and Interleaved1F1B, micro-batches of one sequence);
FSDP over the rest or HSDP (any replicate x shard split); for a MoE flavor, every expert-parallel
degree that divides both dp_shard and the number of experts (``ParallelDims``: ep borrows
dp_shard ranks, ``dp_shard = dp_shard_mod_ep * ep``; not with CP or HSDP; with TP and PP it
composes); local batch sizes (multiples of pp under
PP); activation checkpointing none, selective per-op, full (the first that fits is taken, they only
cost time). A layout is kept when ``trainer.estimate.memory.estimate_memory`` fits
``USABLE_FRACTION`` of the GPU and the global batch stays at most ``--max_global_tokens``
(16Mi = Llama 3 405B's batch); they are ranked by estimated throughput.

Offload is the last resort: only when no layout fits does the search try activation offload (every
block's activations in host memory), then FSDP2 CPU offload (parameters, gradients and optimizer
states in host memory, the optimizer step on the CPU) with each activation mode; a layout with
offload must also fit the host memory (``--host_memory_gib`` per node), and its step time carries
the PCIe copies at ``--pcie_gbps`` (PCIe Gen5 x16 by default) and the CPU step
(``trainer.estimate.offload``), which its description spells out.

The step time of each layout is ``trainer.estimate.step_time``'s model (compute at a share of the GPU's
peak, the communication of ``trainer.estimate.comm`` over NVLink or InfiniBand, the pipeline bubble).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from dataclasses import dataclass, field

from trainer.estimate.memory import GIB, USABLE_FRACTION, Layout, MemoryEstimate, ModelCosts, estimate_memory, model_costs
from trainer.estimate.memory import block_values_per_token, stages_per_rank
from trainer.estimate.comm import communication_per_step
from trainer.estimate.offload import (
    PCIE_GEN5_X16,
    OffloadTime,
    cpu_optimizer_seconds,
    offload_time,
)
from trainer.estimate.step_time import COMPUTE_EFFICIENCY, GPU, GPUS, LINK_EFFICIENCY, StepTime, link, step_time
from trainer import registry
from trainer.models.common.args import ModelArgs, format_params

MAX_GLOBAL_TOKENS = 2**24
AC_CHOICES = (("none", "2"), ("selective", "op"), ("full", "2"))
# The last resorts, tried only when nothing above fits: (cpu_offload, AC choices).
OFFLOAD_CHOICES = ((False, (("offload", "2"),)), (True, AC_CHOICES + (("offload", "2"),)))
HOST_MEMORY_GIB = 2048  # per node: a DGX H100 / H200 holds 2 TiB
HOST_USABLE_FRACTION = 0.8  # the rest for the OS, the data loader, pinned staging
PP_SCHEDULES = ("1F1B", "Interleaved1F1B")
# torchrun restarts of a failed group (a crashed or hung rank) before giving up; each resumes from the
# last good checkpoint.
MAX_RESTARTS = 3


@dataclass(frozen=True)
class Plan:
    """One layout with its estimates; ``command()`` launches it."""

    flavor: str
    gpu: GPU
    n_gpus: int
    gpus_per_node: int
    seq_len: int
    layout: Layout
    local_batch_size: int
    ac_mode: str
    selective_ac_option: str
    schedule: str | None
    memory: MemoryEstimate
    comm_bytes: dict[str, float]
    comm_links: dict[str, str]
    time: StepTime
    model_flops: float  # per GPU and step
    tokens_per_step: int
    extra_flags: tuple[str, ...] = field(default=())
    costs: ModelCosts | None = None  # the model's counts (total vs active, experts)
    cpu_offload: bool = False
    offload: OffloadTime | None = None  # what offload adds to the step (None: no offload)
    host_memory: float = 0.0  # bytes per node the host offers

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.time.total * self.gpu.peak_flops)

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_step / (self.time.total * self.n_gpus)

    @property
    def moe(self) -> bool:
        return self.costs is not None and self.costs.n_moe_layers > 0

    @property
    def expert_state(self) -> float:
        """Bytes per GPU of the routed experts' fp32 master weights (their share of ``memory.params``;
        gradients the same, AdamW twice): sharded over ep x dp_shard_mod_ep = dp_shard, tp and pp."""
        if not self.moe:
            return 0.0
        L = self.layout
        return 4 * self.costs.expert_params / (L.dp_shard * L.cp * L.tp * L.pp)

    @property
    def microbatches(self) -> int:
        return self.local_batch_size if self.layout.pp > 1 else 1

    def ac_text(self) -> str:
        if self.ac_mode == "selective":
            return f"selective {self.selective_ac_option}"
        return self.ac_mode + (" (activations to host)" if self.ac_mode == "offload" else "")

    def offload_text(self) -> str:
        """What offload holds and costs, one line (empty without offload)."""
        if self.offload is None:
            return ""
        m, o = self.memory, self.offload
        what = "CPU offload (params, grads and optimizer states in host memory, optimizer step on the CPU)" \
            if self.cpu_offload else "activation offload"
        if self.cpu_offload and self.ac_mode == "offload":
            what += " + activation offload"
        return (f"offload: {what}; host {m.host / GIB:.1f} GiB per GPU ({m.host * self.gpus_per_node / GIB:,.0f} of "
                f"{HOST_USABLE_FRACTION * self.host_memory / GIB:,.0f} GiB usable per node); PCIe {m.h2d / GIB:.1f} GiB in + "
                f"{m.d2h / GIB:.1f} GiB out per step = {o.pcie:.3g} s ({o.exposed:.3g} s not hidden)"
                + (f", CPU optimizer step {o.cpu_step:.3g} s" if self.cpu_offload else "")
                + f": +{o.total:.3g} s per step ({100 * o.total / self.time.total:.0f}% of it)")

    def summary(self) -> str:
        lay = self.layout.describe()
        if self.layout.pp > 1:
            v = stages_per_rank(self.schedule)
            lay += f" ({self.schedule}, {v} stage(s) per rank, {self.microbatches} micro-batches of 1)"
        return (f"{lay}, AC {self.ac_text()}, local batch {self.local_batch_size}: "
                f"{self.memory.total / GIB:.1f} GiB per GPU, {self.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, "
                f"MFU {100 * self.mfu:.1f}% (estimated)")

    def trainer_flags(self) -> list[str]:
        """Every layout key explicitly (a flavor's TOML may set others, e.g. 405B's full AC)."""
        L = self.layout
        flags = [*self.extra_flags, "--flavor", self.flavor, "--training.seq_len", str(self.seq_len),
                 "--training.local_batch_size", str(self.local_batch_size),
                 "--parallelism.data_parallel_replicate_degree", str(L.dp_replicate),
                 "--parallelism.data_parallel_shard_degree", str(L.dp_shard),
                 "--parallelism.tensor_parallel_degree", str(L.tp),
                 "--parallelism.pipeline_parallel_degree", str(L.pp)]
        if self.moe:  # always explicit: a MoE flavor's TOML sets its own (e.g. 8 for 30B-A3B)
            flags += ["--parallelism.expert_parallel_degree", str(L.ep)]
        if L.pp > 1:
            flags += ["--parallelism.pipeline_parallel_schedule", str(self.schedule),
                      "--parallelism.pipeline_parallel_microbatch_size", "1"]
        flags += ["--parallelism.context_parallel_degree", str(L.cp), "--activation_checkpoint.mode", self.ac_mode]
        if self.cpu_offload:
            flags += ["--training.enable_cpu_offload"]
        if self.ac_mode == "selective":
            flags += ["--activation_checkpoint.selective_ac_option", self.selective_ac_option]
        return flags

    def command(self) -> str:
        """The launch command: torchrun on one node; sbatch of scripts/slurm/train.sbatch (srun + torchrun) on several.

        torchrun restarts a group whose rank crashed or hung (``--max-restarts``), and the trainer
        resumes from the last good checkpoint (``--checkpoint.enable``); the sbatch script does both."""
        flags = " ".join(self.trainer_flags())
        nodes = math.ceil(self.n_gpus / self.gpus_per_node)
        if nodes == 1:
            return (f"torchrun --standalone --nproc_per_node {self.n_gpus} --max-restarts {MAX_RESTARTS} -m trainer "
                    f"{flags} --checkpoint.enable")
        return f"sbatch --nodes {nodes} --gpus-per-node {self.gpus_per_node} scripts/slurm/train.sbatch {flags}"

    def torchrun_per_node(self) -> str:
        nodes = math.ceil(self.n_gpus / self.gpus_per_node)
        return (f"torchrun --nnodes {nodes} --nproc_per_node {self.gpus_per_node} --rdzv_backend c10d "
                f"--rdzv_endpoint $HEAD_NODE:29500 --rdzv_id $JOB_ID --max-restarts {MAX_RESTARTS} -m trainer "
                f"{' '.join(self.trainer_flags())} --checkpoint.enable")

    def describe(self, rank: int | None = None) -> str:
        head = f"#{rank} " if rank is not None else ""
        m = self.memory
        mem = "  ".join(f"{n} {b / GIB:.2f}" for n, b in (
            ("params", m.params), ("grads", m.grads), ("optimizer", m.optimizer), ("gathered", m.working),
            ("activations", m.activations), ("loss", m.loss)))
        peak_rule = "sum" if m.grads_coexist else "params + optimizer + gathered + max(activations + loss, grads)"
        comm = "  ".join(f"{d} {b / GIB:.2f} ({self.comm_links[d]})" for d, b in self.comm_bytes.items()) or "none"
        experts = ""
        if self.moe:
            L = self.layout
            experts = (f"; experts {self.expert_state / GIB:.2f} of the params, over ep {L.ep} x dp_shard_mod_ep "
                       f"{L.dp_shard // L.ep}")
        lines = [
            f"{head}{self.summary()}",
            f"   memory per GPU (GiB): {mem}; peak {m.total / GIB:.2f} = {peak_rule} "
            f"(usable {USABLE_FRACTION * self.gpu.memory / GIB:.0f} of {self.gpu.memory / GIB:.0f}){experts}",
            f"   communication per step (GiB sent per GPU): {comm}",
            f"   step time (s): {self.time.describe()}; {self.tokens_per_step:,} tokens per step",
        ]
        if self.offload is not None:
            lines.append(f"   {self.offload_text()}")
        lines += [f"   {self.command()}"]
        if math.ceil(self.n_gpus / self.gpus_per_node) > 1:
            lines.append(f"   (or on every node: {self.torchrun_per_node()})")
        return "\n".join(lines)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _tp_ok(args: ModelArgs, tp: int) -> bool:
    if tp == 1:
        return True
    if args.tie_word_embeddings:  # the trainer refuses TP with tied embeddings
        return False
    return all(n % tp == 0 for n in args.tp_divisible().values())


def ep_choices(args, dp_shard: int, dp_replicate: int = 1, cp: int = 1) -> list[int]:
    """Expert-parallel degrees the trainer accepts for this layout: 1, and for a MoE model every
    divisor of dp_shard that divides num_experts (``ParallelDims``, ``check_ep_divisibility``),
    none > 1 with CP or HSDP (not supported)."""
    moe = args.moe
    if moe is None or cp > 1 or dp_replicate > 1:
        return [1]
    return [e for e in _divisors(dp_shard) if moe.num_experts % e == 0]


def optimizer_flags(optimizer: str, state_bytes: int) -> tuple[str, ...]:
    """The trainer options of an optimizer choice (none for the default, AdamW with float32 states)."""
    flags = ("--optimizer.name", "muon") if optimizer == "muon" else ()
    return flags + (("--optimizer.state_dtype", "bfloat16") if state_bytes == 2 else ())


def evaluate(args: ModelArgs, flavor: str, gpu: GPU, layout: Layout, local_batch_size: int, seq_len: int,
             ac_mode: str, selective_ac_option: str, schedule: str | None, gpus_per_node: int = 8,
             fused_loss: bool = True, memory: MemoryEstimate | None = None, optimizer: str = "adamw",
             state_bytes: int = 4, cpu_offload: bool = False, pcie_bandwidth: float = PCIE_GEN5_X16,
             host_memory: float = HOST_MEMORY_GIB * GIB) -> Plan:
    """The Plan of one layout: memory, communication by dimension and its link, step time.
    ``optimizer`` ("adamw"/"muon") and ``state_bytes`` (4 or 2) size the optimizer state;
    ``cpu_offload`` and ac_mode "offload" add host memory and PCIe time at ``pcie_bandwidth`` bytes/s."""
    costs = model_costs(args)
    sched = schedule or "1F1B"
    if memory is None:
        memory = estimate_memory(costs, layout, local_batch_size, seq_len, compute_bytes=2, master_bytes=4,
                                 ac_mode=ac_mode, selective_ac_option=selective_ac_option, pp_schedule=sched,
                                 microbatch_size=1, fused_loss=fused_loss, optimizer=optimizer,
                                 state_bytes=state_bytes, cpu_offload=cpu_offload)
    v = stages_per_rank(sched) if layout.pp > 1 else 1
    colls = communication_per_step(costs, layout, local_batch_size, seq_len, microbatch_size=1,
                                   stages_per_rank=v, ac_mode=ac_mode)
    comm: dict[str, float] = {}
    for c in colls:
        comm[c.dim] = comm.get(c.dim, 0.0) + c.bytes
    tp, cp, ds, rep, ep = layout.tp, layout.cp, layout.dp_shard, layout.dp_replicate, layout.ep
    links = {"tp": link(1, tp, gpus_per_node), "cp": link(tp, cp, gpus_per_node),
             "dp_shard_cp": link(tp, ds * cp, gpus_per_node), "dp_replicate": link(tp * cp * ds, rep, gpus_per_node),
             "pp": link(tp * cp * ds * rep, layout.pp, gpus_per_node),
             # with EP the mesh splits dp_shard into (dp_shard_mod_ep, ep), ep inner (cp = 1)
             "ep": link(tp * cp, ep, gpus_per_node), "dp_shard_mod_ep": link(tp * cp * ep, ds // ep, gpus_per_node)}
    t, flops = step_time(costs, gpu, layout, local_batch_size, seq_len, ac_mode, selective_ac_option,
                         schedule, comm, links)
    off = None
    if cpu_offload or ac_mode == "offload":
        shards = layout.dp_shard * layout.cp * layout.tp
        one_copy = max(costs.block_params * 4 / shards if cpu_offload else 0.0,
                       block_values_per_token(costs, "none", layout.tp) * local_batch_size * seq_len / layout.cp * 2
                       if ac_mode == "offload" else 0.0)
        cpu_step = cpu_optimizer_seconds(costs, costs.total_params / (shards * layout.pp), optimizer, state_bytes,
                                         layout.n_devices) if cpu_offload else 0.0
        off = offload_time(memory, t.compute, one_copy, cpu_step, pcie_bandwidth, LINK_EFFICIENCY)
        t = dataclasses.replace(t, offload=off.total)
    family = registry.family_of(args)
    extra = (("--model.name", family) if family != "llama3" else ()) + optimizer_flags(optimizer, state_bytes)
    return Plan(flavor, gpu, layout.n_devices, gpus_per_node, seq_len, layout, local_batch_size, ac_mode,
                selective_ac_option, schedule if layout.pp > 1 else None, memory, comm,
                {d: links[d] for d in comm}, t, flops, local_batch_size * seq_len * layout.dp, extra, costs,
                cpu_offload, off, host_memory)


def _batch_choices(pp: int, given: int | None) -> list[int]:
    if given is not None:
        return [given] if pp == 1 or given % pp == 0 else []
    if pp == 1:
        return [1, 2, 4, 8, 16]
    return [pp * k for k in (1, 2, 4, 8)]


def search(args: ModelArgs, flavor: str, n_gpus: int, gpu: GPU, seq_len: int, local_batch_size: int | None = None,
           gpus_per_node: int = 8, max_global_tokens: int = MAX_GLOBAL_TOKENS, fused_loss: bool = True,
           memory_only: bool = False, optimizer: str = "adamw", state_bytes: int = 4, offload: bool = False,
           pcie_bandwidth: float = PCIE_GEN5_X16, host_memory: float = HOST_MEMORY_GIB * GIB) -> list[Plan]:
    """Every layout of ``n_gpus`` that fits ``gpu`` (module docstring), best first; with ``offload``,
    when none fits, the layouts that fit with activation offload, else with CPU offload.

    With ``memory_only`` it stops at the first layout that fits (for the fit check's search over N).
    Raises ValueError for bad sizes.
    """
    if n_gpus < 1 or seq_len < 1 or gpus_per_node < 1:
        raise ValueError(f"n_gpus, seq_len, gpus_per_node: expected integers >= 1, got {n_gpus}, {seq_len}, "
                         f"{gpus_per_node}")
    if local_batch_size is not None and local_batch_size < 1:
        raise ValueError(f"local_batch_size: expected an integer >= 1, got {local_batch_size}")
    passes = [(False, AC_CHOICES)] + (list(OFFLOAD_CHOICES) if offload else [])
    for cpu_offload, ac_choices in passes:
        plans, over_cap = _search_pass(args, flavor, n_gpus, gpu, seq_len, local_batch_size, gpus_per_node,
                                       max_global_tokens, fused_loss, memory_only, optimizer, state_bytes,
                                       cpu_offload, ac_choices, pcie_bandwidth, host_memory)
        if memory_only and plans:
            return plans[:1]
        if plans:
            return sorted(plans, key=lambda p: (-p.tokens_per_s_per_gpu, p.memory.total))
        if over_cap:  # even the smallest batch exceeds the cap: the smallest global batches, fastest first
            return sorted(over_cap, key=lambda p: (p.tokens_per_step, -p.tokens_per_s_per_gpu, p.memory.total))
    return []


def _search_pass(args, flavor, n_gpus, gpu, seq_len, local_batch_size, gpus_per_node, max_global_tokens, fused_loss,
                 memory_only, optimizer, state_bytes, cpu_offload, ac_choices, pcie_bandwidth, host_memory
                 ) -> tuple[list[Plan], list[Plan]]:
    """One pass of :func:`search` over the layouts with the given offload and AC choices:
    (plans within the global batch cap, plans over it)."""
    costs = model_costs(args)
    usable = USABLE_FRACTION * gpu.memory
    host_per_gpu = HOST_USABLE_FRACTION * host_memory / min(n_gpus, gpus_per_node)
    plans: list[Plan] = []
    over_cap: list[Plan] = []
    max_cp = max(1, seq_len // 8192)  # ring attention pays off on long sequences only
    for tp in _divisors(n_gpus):
        if tp > gpus_per_node or not _tp_ok(args, tp):
            continue
        for cp in _divisors(n_gpus // tp):
            if cp > max_cp or (cp > 1 and (seq_len % (2 * cp) or (seq_len // cp) % tp)) or (seq_len % tp):
                continue
            for pp in _divisors(n_gpus // (tp * cp)):
                if pp > 1 and (args.tie_word_embeddings or pp > args.n_layers or args.pipeline_refusal()):
                    continue
                dp = n_gpus // (tp * cp * pp)
                for sched in (PP_SCHEDULES if pp > 1 else (None,)):
                    v = stages_per_rank(sched) if sched else 1
                    if pp * v > args.n_layers:
                        continue
                    for b in _batch_choices(pp, local_batch_size):
                        tokens = b * seq_len * dp
                        shard_ep = [(ds, ep) for ds in sorted(_divisors(dp), reverse=True)
                                    for ep in ep_choices(args, ds, dp // ds, cp)]
                        for dp_shard, ep in shard_ep:
                            layout = Layout(dp // dp_shard, dp_shard, tp, pp, cp, ep)
                            for ac, opt in ac_choices:
                                mem = estimate_memory(costs, layout, b, seq_len, compute_bytes=2, master_bytes=4,
                                                      ac_mode=ac, selective_ac_option=opt,
                                                      pp_schedule=sched or "1F1B", microbatch_size=1,
                                                      fused_loss=fused_loss, optimizer=optimizer,
                                                      state_bytes=state_bytes, cpu_offload=cpu_offload)
                                if mem.total > usable or mem.host > host_per_gpu:
                                    continue
                                plan = evaluate(args, flavor, gpu, layout, b, seq_len, ac, opt, sched, gpus_per_node,
                                                fused_loss, memory=mem, optimizer=optimizer, state_bytes=state_bytes,
                                                cpu_offload=cpu_offload, pcie_bandwidth=pcie_bandwidth,
                                                host_memory=host_memory)
                                if memory_only:
                                    return [plan], []
                                (plans if tokens <= max_global_tokens else over_cap).append(plan)
                                break  # more recomputation only costs time
    return plans, over_cap


def best(args: ModelArgs, flavor: str, n_gpus: int, gpu: GPU, seq_len: int, top: int = 5, **kw) -> list[Plan]:
    """The ``top`` best distinct layouts (one per layout, its best batch/AC/schedule); offload when
    nothing else fits unless ``offload=False`` is given."""
    kw.setdefault("offload", True)
    out, seen = [], set()
    for p in search(args, flavor, n_gpus, gpu, seq_len, **kw):
        key = (p.layout, p.schedule)
        if key in seen:
            continue
        seen.add(key)
        out.append(p)
        if len(out) == top:
            break
    return out


def smallest_fit(args: ModelArgs, flavor: str, seq_len: int, gpu: str = "H100", start: int = 8,
                 limit: int = 16384, fused_loss: bool = True, optimizer: str = "adamw",
                 state_bytes: int = 4, offload: bool = False) -> Plan | None:
    """The best layout at the smallest GPU count (``start`` doubling up to ``limit``) where any fits
    (with ``offload``: offload counts as fitting); None if none."""
    spec = GPUS[gpu]
    n = start
    kw = dict(fused_loss=fused_loss, optimizer=optimizer, state_bytes=state_bytes, offload=offload)
    while n <= limit:
        if search(args, flavor, n, spec, seq_len, local_batch_size=None, memory_only=True, **kw):
            found = best(args, flavor, n, spec, seq_len, top=1, **kw)
            return found[0] if found else None
        n *= 2
    return None


def flavor_args(flavor: str, seq_len: int, vocab_size: int | None = None, model: str = "llama3") -> ModelArgs:
    """The flavor's args (``model``: a registered family); the debug flavors take ``vocab_size``
    (default: the built-in byte tokenizer's 258)."""
    try:
        spec = registry.get(model)
    except ValueError:
        raise ValueError(f"--model.name: expected one of {', '.join(registry.names())}, got {model!r}") from None
    if flavor not in spec.flavors:
        raise ValueError(f"--flavor: expected one of {', '.join(spec.flavors)} for {model}, got {flavor!r}")
    args = spec.flavors[flavor]
    if args.vocab_size == -1:
        args = args.replace(vocab_size=vocab_size or 258)
    elif vocab_size:
        args = args.replace(vocab_size=vocab_size)
    return args.replace(max_seq_len=seq_len)


OPTIMIZER_CHOICES = (("adamw", 4), ("adamw", 2), ("muon", 4), ("muon", 2))


def optimizer_label(optimizer: str, state_bytes: int) -> str:
    return f"{'AdamW' if optimizer == 'adamw' else 'Muon'} with {'fp32' if state_bytes == 4 else 'bf16'} states"


def assumptions(gpu: GPU, gpus_per_node: int, optimizer: str = "adamw", state_bytes: int = 4) -> str:
    return (f"assumptions: {gpu.name} {gpu.memory / GIB:.0f} GiB ({100 * USABLE_FRACTION:.0f}% usable), "
            f"bf16 compute at {100 * COMPUTE_EFFICIENCY:.0f}% of {gpu.peak_flops / 1e12:.0f} TFLOP/s, "
            f"NVLink {gpu.nvlink / 1e9:.0f} GB/s and InfiniBand {gpu.network / 1e9:.0f} GB/s per GPU and direction "
            f"at {100 * LINK_EFFICIENCY:.0f}%, {gpus_per_node} GPUs per node; fp32 master weights, "
            f"{optimizer_label(optimizer, state_bytes)}, fp32 gradient reduction (trainer/estimate/step_time.py states the model)")


def smallest_node_count(args: ModelArgs, flavor: str, seq_len: int, gpu: GPU, gpus_per_node: int = 8,
                        **okw) -> int | None:
    """The fewest GPUs, in whole nodes, on which any layout fits (None: none up to 16384)."""
    p2 = smallest_fit(args, flavor, seq_len, gpu.name, start=gpus_per_node, **okw)
    if p2 is None:
        return None
    for n in range(max(gpus_per_node, p2.n_gpus // 2 + gpus_per_node), p2.n_gpus, gpus_per_node):
        if search(args, flavor, n, gpu, seq_len, gpus_per_node=gpus_per_node, memory_only=True, offload=False, **okw):
            return n
    return p2.n_gpus


def optimizer_comparison(args: ModelArgs, flavor: str, gpu: GPU, seq_len: int, gpus_per_node: int = 8) -> list[str]:
    """What bf16 optimizer states or Muon buy, for each of ``OPTIMIZER_CHOICES``: the fewest GPUs
    (whole nodes) on which any layout fits, and on the fewest for AdamW with float32 states, the
    optimizer state per GPU, the largest local batch of any layout that fits and the best throughput."""
    counts = {c: smallest_node_count(args, flavor, seq_len, gpu, gpus_per_node, optimizer=c[0], state_bytes=c[1])
              for c in OPTIMIZER_CHOICES}
    base_n = counts[OPTIMIZER_CHOICES[0]]
    lines = [f"optimizer states: what bf16 states or Muon buy ({flavor}, seq_len {seq_len}, {gpu.name}; "
             f"batch and speed on {base_n}, where AdamW with fp32 states just fits):"]
    for (opt, sb), n in counts.items():
        line = f"  {optimizer_label(opt, sb):<24} fits on {n if n else '> 16384':>5} GPUs"
        plans = search(args, flavor, base_n, gpu, seq_len, gpus_per_node=gpus_per_node, optimizer=opt, offload=False,
                       state_bytes=sb) if base_n else []
        if plans:
            line += (f"; on {base_n}: optimizer state {plans[0].memory.optimizer / GIB:4.1f} GiB/GPU, largest local "
                     f"batch {max(p.local_batch_size for p in plans):>3}, best {plans[0].tokens_per_s_per_gpu:,.0f} "
                     f"tokens/s per GPU ({plans[0].layout.describe()}, local batch {plans[0].local_batch_size}, "
                     f"AC {plans[0].ac_mode})")
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.plan",
                                     description="Rank the parallel layouts of a flavor on N GPUs.")
    parser.add_argument("--model.name", "--model", dest="model", choices=registry.names(), default="llama3",
                        help="model family (default llama3)")
    parser.add_argument("--flavor", required=True, help="a flavor of the family, e.g. 8B, 70B, 405B")
    parser.add_argument("--ngpu", type=int, required=True, help="number of GPUs (8 to 16384)")
    parser.add_argument("--gpu", choices=tuple(GPUS), default="H100")
    parser.add_argument("--seq_len", type=int, default=8192)
    parser.add_argument("--local_batch_size", type=int, default=None,
                        help="sequences per data-parallel rank and step (default: searched)")
    parser.add_argument("--gpus_per_node", type=int, default=8)
    parser.add_argument("--max_global_tokens", type=int, default=MAX_GLOBAL_TOKENS,
                        help=f"largest global batch in tokens (default {MAX_GLOBAL_TOKENS:,})")
    parser.add_argument("--vocab_size", type=int, default=None, help="debug flavors: the tokenizer's vocabulary")
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                        help="the optimizer whose states are counted (default adamw)")
    parser.add_argument("--state_dtype", choices=("float32", "bfloat16"), default="float32",
                        help="dtype of the optimizer states (default float32)")
    parser.add_argument("--pcie_gbps", type=float, default=PCIE_GEN5_X16 / 1e9,
                        help="host-device bandwidth per GPU and direction, GB/s nominal (default 64: PCIe Gen5 x16); "
                             "costs CPU and activation offload")
    parser.add_argument("--host_memory_gib", type=float, default=HOST_MEMORY_GIB,
                        help=f"host memory per node in GiB (default {HOST_MEMORY_GIB}); offload must fit "
                             f"{100 * HOST_USABLE_FRACTION:.0f}%% of it")
    parser.add_argument("--compare_optimizers", action="store_true",
                        help="also show what bf16 states or Muon buy: smallest fit, throughput, largest batch")
    ns = parser.parse_args(argv)
    okw = dict(optimizer=ns.optimizer, state_bytes=2 if ns.state_dtype == "bfloat16" else 4)
    if ns.ngpu < 1 or ns.seq_len < 1 or ns.top < 1 or ns.gpus_per_node < 1:
        parser.error("--ngpu, --seq_len, --top and --gpus_per_node must be >= 1")
    if ns.local_batch_size is not None and ns.local_batch_size < 1:
        parser.error("--local_batch_size must be >= 1")
    for key in ("pcie_gbps", "host_memory_gib"):  # inf: offload priced at 0 s, as --training.pcie_bandwidth_gbps refuses
        value = getattr(ns, key)
        if not (math.isfinite(value) and value > 0):
            parser.error(f"--{key}: expected a finite number > 0, got {value!r}")
    gpus_per_node = ns.gpus_per_node if ns.ngpu >= ns.gpus_per_node else ns.ngpu
    if ns.ngpu % gpus_per_node:
        parser.error(f"--ngpu {ns.ngpu} is not a whole number of nodes of --gpus_per_node {gpus_per_node}")
    t0 = time.perf_counter()
    try:
        args = flavor_args(ns.flavor, ns.seq_len, ns.vocab_size, ns.model)
    except ValueError as exc:
        parser.error(str(exc))
    gpu = GPUS[ns.gpu]
    plans = best(args, ns.flavor, ns.ngpu, gpu, ns.seq_len, top=ns.top, local_batch_size=ns.local_batch_size,
                 gpus_per_node=gpus_per_node, max_global_tokens=ns.max_global_tokens, pcie_bandwidth=ns.pcie_gbps * 1e9,
                 host_memory=ns.host_memory_gib * GIB, **okw)
    print(f"{ns.flavor}: {format_params(args)}, seq_len {ns.seq_len}, on {ns.ngpu} x {gpu.name} "
          f"({ns.ngpu // gpus_per_node} node(s) of {gpus_per_node})")
    print(assumptions(gpu, gpus_per_node, **okw))
    if ns.compare_optimizers:
        print("\n".join(optimizer_comparison(args, ns.flavor, gpu, ns.seq_len, gpus_per_node)))
    if not plans:
        print(f"no layout of {ns.ngpu} x {gpu.name} fits", end="")
        found = smallest_fit(args, ns.flavor, ns.seq_len, ns.gpu, start=max(8, 2 ** math.ceil(math.log2(ns.ngpu))),
                             **okw)
        print(f"; the smallest power-of-two count that fits: {found.n_gpus} ({found.summary()})" if found
              else f"; none up to 16384 GPUs: reduce --seq_len")
        return 1
    # Layouts differ in tokens per step (their local batch): say what the order compares.
    print("ranked by estimated tokens/s per GPU; each layout's tokens per step (global batch) is on its "
          "step-time line, and a larger batch changes the optimization, not only the speed")
    over = plans[0].tokens_per_step > ns.max_global_tokens
    if over:
        print(f"note: even the smallest layouts' global batch exceeds --max_global_tokens {ns.max_global_tokens:,}")
    if plans[0].offload is not None:
        alone = smallest_fit(args, ns.flavor, ns.seq_len, ns.gpu, start=max(8, 2 ** math.ceil(math.log2(ns.ngpu))), **okw)
        what = "CPU offload" if plans[0].cpu_offload else "activation offload"
        print(f"note: no layout of {ns.ngpu} x {gpu.name} fits without offload; these need {what} (its cost is on "
              f"each layout's offload line)" + (f"; without offload the smallest power-of-two count that fits is "
                                                f"{alone.n_gpus} ({alone.summary()})" if alone else ""))
    for i, p in enumerate(plans, 1):
        print()
        print(p.describe(i))
    print(f"\n(searched in {time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
