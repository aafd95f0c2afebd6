"""Memory per device of a Llama 3 training run for a parallel layout, without building the model.

Per device (bytes), for P parameters sharded over ``dp_shard`` ranks by FSDP2:
  params       P * master_bytes / dp_shard            (fp32 master weights)
  grads        P * master_bytes / dp_shard            (reduced in fp32 into the sharded grads)
  optimizer    2 * P * master_bytes / dp_shard        (AdamW exp_avg and exp_avg_sq)
  working      unsharded copies under FSDP: the root (embedding, output) for the whole step, two
               blocks at a time (current + prefetched) in the compute dtype, and one block's
               unsharded fp32 gradients before its reduce-scatter
  activations  what autograd keeps for the backward, in the compute dtype, per token:
               per block, without recomputation: 6*dim + 2*kv_dim + 4*ffn_hidden + n_heads + 2
               values (block input, normed input, q, attention output, residual, normed residual;
               k and v; SwiGLU's w1 and w3 outputs, their activation and product; attention's
               log-sum-exp and two RMSNorm rstd), which is exactly what autograd saves for
               ``trainer.models.llama.TransformerBlock`` (checked in tests/trainer/test_estimate.py);
               full AC: only each block's input, plus one block recomputed at a time;
               selective "op": the block input and the matmul/attention outputs kept:
               5*dim + 2*kv_dim + 2*ffn_hidden + n_heads (the LSE), also checked against what
               the policy saves in tests/trainer/test_estimate.py;
               selective N: every N-th block as full AC;
               plus the logits: vocab * (compute bytes + 8) per token (a float32 copy for the loss
               and its gradient).
This follows the accounting of Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models" (2022), adapted to SwiGLU, GQA and memory-efficient attention (no seq x seq
scores kept). It is an estimate: allocator fragmentation and communication buffers add a few GiB
on GPUs, which the fit check leaves as headroom.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from trainer.models.llama import ModelArgs

GIB = 2**30
# Share of a device's memory a run may plan to use (headroom for fragmentation, NCCL buffers, CUDA context).
USABLE_FRACTION = 0.9
# What the suggestion assumes when the machine has no GPU.
REFERENCE_GPU = ("H100", 80 * GIB)


@dataclass(frozen=True)
class Layout:
    """A parallel layout; ``n_devices = dp_replicate * dp_shard * tp * pp * cp``."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1

    @property
    def n_devices(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp

    @property
    def model_shards(self) -> int:
        """How many pieces each parameter is cut into: FSDP2 over dp_shard x cp, TP, PP stages."""
        return self.dp_shard * self.cp * self.tp * self.pp


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated bytes per device, by component."""

    params: float
    grads: float
    optimizer: float
    working: float
    activations: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.working + self.activations

    def describe(self) -> str:
        parts = [
            ("parameters", self.params), ("gradients", self.grads), ("optimizer state", self.optimizer),
            ("activations", self.activations), ("gathered weights/buffers", self.working),
        ]
        return ", ".join(f"{name} {b / GIB:,.1f}" for name, b in parts) + f" = {self.total / GIB:,.1f} GiB"


def activation_values_per_token(args: ModelArgs, ac_mode: str = "none", selective_ac_option: str = "2") -> float:
    """Values (elements) autograd keeps per token over all blocks, excluding the logits."""
    kv_dim = args.kv_heads * args.head_dim
    full_block = 6 * args.dim + 2 * kv_dim + 4 * args.ffn_hidden_dim + args.n_heads + 2
    if ac_mode == "none":
        return args.n_layers * full_block
    if ac_mode == "full":
        return args.n_layers * args.dim + full_block
    if ac_mode != "selective":
        raise ValueError(f"activation_checkpoint.mode: expected none, full or selective, got {ac_mode!r}")
    if selective_ac_option == "op":
        return args.n_layers * (5 * args.dim + 2 * kv_dim + 2 * args.ffn_hidden_dim + args.n_heads)
    every = int(selective_ac_option)
    n_ckpt = math.ceil(args.n_layers / every)
    return n_ckpt * args.dim + (args.n_layers - n_ckpt) * full_block + full_block


def estimate_memory(
    args: ModelArgs,
    layout: Layout,
    local_batch_size: int,
    seq_len: int,
    compute_bytes: int = 2,
    master_bytes: int = 4,
    ac_mode: str = "none",
    selective_ac_option: str = "2",
) -> MemoryEstimate:
    """Estimated memory per device of training ``args`` on ``layout`` (see the module docstring).

    ``compute_bytes``: bytes per value of the compute dtype (2 for bf16, 4 for fp32);
    ``master_bytes``: of the sharded master weights, gradients and AdamW state (4 = fp32).
    Raises ValueError for sizes < 1.
    """
    for name, v in (("local_batch_size", local_batch_size), ("seq_len", seq_len),
                    ("dp_replicate", layout.dp_replicate), ("dp_shard", layout.dp_shard), ("tp", layout.tp),
                    ("pp", layout.pp), ("cp", layout.cp)):
        if v < 1:
            raise ValueError(f"{name}: expected an integer >= 1, got {v}")
    p = args.num_params()
    shard = layout.model_shards
    # Sequence parallel and context parallel split every kept activation over tp x cp (an estimate:
    # the gathered inputs of attention/FFN are transient); a pipeline stage keeps its L/pp layers
    # for up to pp micro-batches in flight (1F1B), about the whole model's worth for one.
    tokens = local_batch_size * seq_len / (layout.tp * layout.cp)
    working = 0.0
    if layout.n_devices > 1 or compute_bytes != master_bytes:
        root = p - args.n_layers * args.layer_params()
        working = root * compute_bytes + 2 * args.layer_params() * compute_bytes + args.layer_params() * master_bytes
        working /= layout.tp
    acts = activation_values_per_token(args, ac_mode, selective_ac_option) * compute_bytes * tokens
    acts += args.vocab_size * (compute_bytes + 8) * tokens
    return MemoryEstimate(
        params=p * master_bytes / shard,
        grads=p * master_bytes / shard,
        optimizer=2 * p * master_bytes / shard,
        working=working,
        activations=acts,
    )


@dataclass(frozen=True)
class Devices:
    """What this machine offers one training process."""

    kind: str  # "cuda" or "cpu"
    count: int
    memory_per_device: float  # bytes one process may use
    name: str

    def describe(self) -> str:
        if self.kind == "cuda":
            return f"{self.count} x {self.name} ({self.memory_per_device / GIB:.0f} GiB each)"
        return f"no GPU; CPU ({self.name}) with {self.memory_per_device / GIB:.1f} GiB of memory available per process"


def detect_devices(processes_per_node: int | None = None) -> Devices:
    """The visible GPUs (their total memory), else the CPU (available RAM shared by this node's processes)."""
    import torch

    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        props = torch.cuda.get_device_properties(0)
        return Devices("cuda", n, float(props.total_memory), props.name)
    import platform

    import psutil

    procs = processes_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    avail = psutil.virtual_memory().available / max(procs, 1)
    return Devices("cpu", 1, float(avail), f"{_cpu_model() or platform.machine()}, {os.cpu_count()} cores")


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


@dataclass(frozen=True)
class Suggestion:
    layout: Layout
    ac_mode: str
    selective_ac_option: str
    local_batch_size: int
    estimate: MemoryEstimate
    gpu_name: str
    gpu_memory: float

    def describe(self) -> str:
        flags = f"--parallelism.data_parallel_shard_degree {self.layout.dp_shard}"
        if self.ac_mode != "none":
            flags += f" --activation_checkpoint.mode {self.ac_mode}"
            if self.ac_mode == "selective":
                flags += f" --activation_checkpoint.selective_ac_option {self.selective_ac_option}"
        flags += f" --training.local_batch_size {self.local_batch_size}"
        nodes = math.ceil(self.layout.n_devices / 8)
        return (
            f"{self.layout.n_devices} x {self.gpu_name} ({self.gpu_memory / GIB:.0f} GiB; {nodes} node(s) of 8) with "
            f"bf16 FSDP2 over {self.layout.dp_shard} GPUs: torchrun --nnodes {nodes} --nproc_per_node "
            f"{min(8, self.layout.n_devices)} -m trainer ... {flags} "
            f"(estimated {self.estimate.total / GIB:,.1f} GiB per GPU)"
        )


def suggest_layout(
    args: ModelArgs,
    seq_len: int,
    local_batch_size: int,
    gpu_memory: float = REFERENCE_GPU[1],
    gpu_name: str = REFERENCE_GPU[0],
    max_devices: int = 4096,
) -> Suggestion | None:
    """The smallest FSDP2 layout (GPU count a power of two) that fits ``args`` in bf16 with fp32 master weights.

    Tries, for each GPU count, the given local batch size then smaller ones, with no activation
    checkpointing, then selective per-op, then full. Returns None if nothing up to ``max_devices`` fits.
    """
    batches = sorted({b for b in (local_batch_size, 4, 2, 1) if 1 <= b <= local_batch_size}, reverse=True)
    n = 1
    while n <= max_devices:
        for ac_mode, opt in (("none", "2"), ("selective", "op"), ("full", "2")):
            for b in batches:
                est = estimate_memory(args, Layout(1, n), b, seq_len, compute_bytes=2, master_bytes=4,
                                      ac_mode=ac_mode, selective_ac_option=opt)
                if est.total <= USABLE_FRACTION * gpu_memory:
                    return Suggestion(Layout(1, n), ac_mode, opt, b, est, gpu_name, gpu_memory)
        n *= 2
    return None


def fit_report(
    args: ModelArgs,
    flavor: str,
    layout: Layout,
    local_batch_size: int,
    seq_len: int,
    compute_bytes: int,
    ac_mode: str,
    selective_ac_option: str,
    devices: Devices,
) -> str | None:
    """None if the run fits ``devices``; otherwise the message explaining why not and what would fit.

    The message gives the parameter count, the estimated memory per device by component, the
    devices found and a layout with a GPU count that would fit.
    """
    est = estimate_memory(args, layout, local_batch_size, seq_len, compute_bytes=compute_bytes,
                          ac_mode=ac_mode, selective_ac_option=selective_ac_option)
    if est.total <= devices.memory_per_device:
        return None
    dtype = {2: "bf16", 4: "fp32"}.get(compute_bytes, f"{compute_bytes}-byte")
    if devices.kind == "cuda":
        gpu_name, gpu_mem = devices.name, devices.memory_per_device
    else:
        gpu_name, gpu_mem = REFERENCE_GPU
    sug = suggest_layout(args, seq_len, local_batch_size, gpu_memory=gpu_mem, gpu_name=gpu_name)
    lines = [
        f"flavor {flavor!r} does not fit: {args.num_params() / 1e9:.2f}e9 parameters "
        f"({args.num_params():,}).",
        f"  estimated memory per device ({layout.n_devices} device(s): dp_replicate={layout.dp_replicate}, "
        f"dp_shard={layout.dp_shard}; {dtype} compute, local_batch_size {local_batch_size}, seq_len {seq_len}, "
        f"activation checkpointing {ac_mode}): {est.describe()}",
        f"  devices found: {devices.describe()}",
    ]
    assumed = "" if devices.kind == "cuda" else f" (no GPU here; sized for {gpu_name} {gpu_mem / GIB:.0f} GiB)"
    if sug is None:
        lines.append(f"  no data-parallel layout of up to 4096 x {gpu_name} fits{assumed}; reduce training.seq_len")
    else:
        lines.append(f"  would fit{assumed}: {sug.describe()}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Communication per step (trainer/parallel/README.md derives these formulas)


@dataclass(frozen=True)
class Collective:
    """One kind of collective of a training step: ``count`` calls over the ``dim`` group, each moving
    ``bytes_per_call`` bytes in and out of every rank (ring algorithms: (n-1)/n of the buffer)."""

    dim: str
    op: str
    what: str
    count: float
    bytes_per_call: float

    @property
    def bytes(self) -> float:
        return self.count * self.bytes_per_call


def _ring(n: int) -> float:
    return (n - 1) / n


def communication_per_step(
    args: ModelArgs,
    layout: Layout,
    local_batch_size: int,
    seq_len: int,
    grad_accum: int = 1,
    microbatch_size: int = 1,
    stages_per_rank: int = 1,
    compute_bytes: int = 2,
    reduce_bytes: int = 4,
    loss_parallel: bool = True,
    ac_mode: str = "none",
) -> list[Collective]:
    """Bytes each rank sends (= receives) per optimizer step, by dimension and collective.

    ``local_batch_size`` sequences of ``seq_len`` per micro-batch and data-parallel rank,
    ``grad_accum`` micro-batches per step; ``microbatch_size``/``stages_per_rank`` for pipeline
    parallel; ``compute_bytes`` for parameters/activations on the wire (bf16: 2), ``reduce_bytes``
    for gradients (fp32: 4). ``ac_mode`` "full" re-runs each block's forward in the backward, with its
    TP and CP communication. Size-1 dims contribute nothing. See trainer/parallel/README.md.
    """
    L = args.n_layers / layout.pp  # layers on this rank
    d, kv, V = args.dim, args.kv_heads * args.head_dim, args.vocab_size
    tp, pp, cp, cb, rb = layout.tp, layout.pp, layout.cp, compute_bytes, reduce_bytes
    # Activations move per pipeline micro-batch under PP, else per accumulation micro-batch; tokens
    # of one on this rank, before sequence parallel.
    chunks = grad_accum * (local_batch_size // microbatch_size if pp > 1 else 1)
    tokens = (microbatch_size if pp > 1 else local_batch_size) * seq_len / cp
    recompute = 1 if ac_mode == "full" else 0
    out: list[Collective] = []

    # FSDP2 over dp_shard x cp: every accumulation micro-batch all-gathers each block in the forward
    # and again in the backward (resharded after forward; once under PP, which keeps them), the root
    # once, and reduce-scatters all gradients.
    n = layout.dp_shard * cp
    if n > 1 or layout.dp_replicate > 1:
        blocks = args.n_layers * args.layer_params() / (tp * pp)
        root = (args.num_params() - args.n_layers * args.layer_params()) / (tp * pp)
        gathers = 1 if pp > 1 else 2
        if n > 1:
            out.append(Collective("dp_shard_cp", "all-gather", "parameters (all units)", grad_accum,
                                  _ring(n) * cb * (gathers * blocks + root)))
            out.append(Collective("dp_shard_cp", "reduce-scatter", "gradients (all units)", grad_accum,
                                  _ring(n) * rb * (blocks + root)))
        if layout.dp_replicate > 1:
            r = layout.dp_replicate
            out.append(Collective("dp_replicate", "all-reduce", "gradient shards (all units)", grad_accum,
                                  2 * _ring(r) * rb * (blocks + root) / n))
    # Tensor + sequence parallel: per layer 2 all-gathers + 2 reduce-scatters of the (tokens, dim)
    # activation in the forward, the same in the backward; embedding and output one each way.
    if tp > 1:
        act = _ring(tp) * tokens * d * cb
        # Embedding and output: on the first and last stage only (a share 1/pp of the ranks on average).
        ends = 2 * chunks / pp
        out.append(Collective("tp", "all-gather", "activations", 2 * chunks * L * (2 + recompute) + ends, act))
        out.append(Collective("tp", "reduce-scatter", "activations", 2 * chunks * L * (2 + recompute) + ends, act))
        if loss_parallel:
            out.append(Collective("tp", "all-reduce", "loss-parallel max/sum/target", 3 * chunks / pp,
                                  2 * _ring(tp) * tokens * 4))
        else:
            out.append(Collective("tp", "all-gather", "logits", chunks / pp, _ring(tp) * tokens * V * cb))
        out.append(Collective("tp", "all-reduce", "norm weight gradients", grad_accum * (2 * L + 1 / pp),
                              2 * _ring(tp) * d * rb))
    # Context parallel (ring attention): per layer, the local K/V block makes cp - 1 hops forward; the
    # backward sends K/V again (cp - 1 hops) and their float32 gradients (cp hops).
    if cp > 1:
        kv_block = 2 * tokens * kv / tp
        calls = chunks * L
        out.append(Collective("cp", "send/recv", "K/V blocks", calls * (cp - 1) * (2 + recompute), kv_block * cb))
        out.append(Collective("cp", "send/recv", "K/V gradients", calls * cp, kv_block * rb))
    # Pipeline: each micro-batch's activations go to the next stage and their gradients come back,
    # a (microbatch_size, seq/cp/tp, dim) tensor per tp rank and boundary.
    if pp > 1:
        boundary = tokens / tp * d * cb
        # Every stage but the last sends forward, every one but the first sends back: averaged per rank.
        hops = chunks * stages_per_rank * (pp * stages_per_rank - 1) / (pp * stages_per_rank)
        out.append(Collective("pp", "send", "activations", hops, boundary))
        out.append(Collective("pp", "send", "activation gradients", hops, boundary))
    return out


def describe_communication(collectives: list[Collective]) -> str:
    """A table: dim, collective, what, calls per step, MiB per call, GiB per step (per rank) (per rank)."""
    lines = [f"{'dim':<13} {'collective':<15} {'what':<30} {'calls':>8} {'MiB each':>10} {'GiB/step':>9}"]
    for c in collectives:
        lines.append(f"{c.dim:<13} {c.op:<15} {c.what:<30} {c.count:>8.0f} {c.bytes_per_call / 2**20:>10.2f} "
                     f"{c.bytes / GIB:>9.3f}")
    lines.append(f"{'total':<13} {'':<15} {'':<30} {'':>8} {'':>10} {sum(c.bytes for c in collectives) / GIB:>9.3f}")
    return "\n".join(lines)
