"""Memory per device of a training run for a parallel layout, without building the model.

Beside it: the communication per step (``trainer.estimate.comm``), the optimizer's share
(``trainer.estimate.optimizer``), the step time on a GPU (``trainer.estimate.step_time``); ``trainer.plan``
searches the layouts with them and ``trainer.estimate.fit`` checks a run against this machine.

Memory per device (bytes), for the worst rank (the first pipeline stage, or the last when its loss
dominates; every pp rank is evaluated). Notation: ``P_s`` parameters of the rank's stages (its
blocks as the pipeline splits them, ``pipeline_ranks``, plus the embedding on the first stage, final
norm and output on the last), sharded over
``n = dp_shard * cp`` ranks by FSDP2 and over ``tp`` by tensor parallel:
  params       P_s * master_bytes / (n * tp)            fp32 master weights
  grads        P_s * master_bytes / (n * tp)            reduced in fp32 into the sharded grads
  optimizer    state values x state_bytes / (n * tp): AdamW 2 per parameter; Muon 1 on the hidden matrices and
               experts, 2 on the rest, plus its step buffers (``trainer.estimate.optimizer``)
  working      unsharded copies under FSDP2 (when n > 1 or the compute dtype is not fp32): the root
               (embedding, output) for the whole step, two blocks at a time (current + prefetched)
               in the compute dtype, and one block's unsharded fp32 gradients before its
               reduce-scatter; under PP the stage's blocks stay gathered between micro-batches
               (``reshard_after_forward=False``); divided by tp
  activations  what autograd keeps for the backward, in the compute dtype, per token of a
               micro-batch (T = micro-batch tokens / cp) and block (``block_values_per_token``):
               without recomputation 2*dim + (4*dim + 2*kv_dim + 3*ffn + n_heads + 2) / tp values:
               the norm outputs that feed wq/wk/wv and w1/w3 are all-gathered over the sequence
               under TP + SP and saved whole by the matmuls (tp = 1: 6*dim + ...); the rest is the
               block input, q, k, v, attention output and log-sum-exp, the residual, two RMSNorm
               rstd, and SwiGLU's two inputs and output (the fused op recomputes the activation),
               which is exactly what autograd saves for ``trainer.models.common.decoder.TransformerBlock``
               (checked in tests/trainer/test_estimate.py);
               full AC: each block's input (dim / tp), plus one block recomputed at a time;
               selective "op": the outputs of the matmuls and of attention plus the block input:
               2*dim (wo, w2 outputs before their reduce-scatter) + (3*dim + 2*kv_dim + 2*ffn + n_heads) / tp;
               selective N: every N-th block as full AC;
               micro-batches in flight: 1 without PP; pp rank r of 1F1B holds min(m, pp - r) of
               them, of Interleaved1F1B (pp - r) * (1 + (pp - 1) / (pp * v)) (Korthikanti et al.
               2022, sec. 4.2.3, for r = 0), of GPipe all m
  loss         the last stage, one micro-batch: unfused, the float32 log-softmax kept for the
               backward plus its gradient and the logits' gradient at the start of the backward,
               12 * T_seq * vocab / tp bytes (T_seq: tokens before sequence parallel); fused
               (``titan_kernels.linear_cross_entropy``): the hidden and weight gradients computed
               in the forward plus two float32 logit chunks
Peak: params + optimizer + working + max(activations + loss, grads + one block's activations): at
the start of the backward every activation is alive and no gradient exists yet (they are set to
None after each step); block by block the backward frees activations as it writes gradients, and it
ends in the first block (recomputed under full AC) with almost every gradient written. With gradient
accumulation or PP, gradients of earlier micro-batches coexist with activations: their sum.

This follows the accounting of Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models" (2022), adapted to SwiGLU, GQA, memory-efficient attention (no seq x seq scores
kept) and DTensor tensor parallel. It is an estimate: allocator fragmentation and communication
buffers add a few GiB on GPUs, which the fit check leaves as headroom (``USABLE_FRACTION``).
tests/trainer/test_plan.py measures it against the peak of live tensors on the CPU.

Offload (``trainer.config.activation_policy``, ``trainer.estimate.offload`` for the time): with CPU offload
(``cpu_offload``) params, grads and optimizer state are host bytes (``host``), not device ones; the
device keeps the gathered blocks plus one block's fp32 shard on its way to the all-gather; per
accumulation micro-batch (under PP once per step: the stage keeps its blocks gathered and
reduce-scatters after the last micro-batch) every all-gather copies its fp32 shard host-to-device
(blocks twice when they reshard after forward, the root once) and every reduce-scatter its fp32
gradient shard back. Per-layer
activation modes (``layer_modes``: none, op, full, offload; ``ac_mode`` offload = all offload):
kept blocks as above, an offloaded block nothing on the device beyond ``OFFLOAD_STAGING_BLOCKS``
blocks of staging, its bytes in host memory (per micro-batch in flight) and twice over PCIe.

Hooks for mixture-of-experts models: everything reads the model through ``ModelCosts``
(``model_costs``), which separates total parameters (memory) from active parameters (FLOPs);
an MoE model fills it with its experts' share, sharded by an expert-parallel degree.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from trainer.config.activation_policy import OFFLOAD_STAGING_BLOCKS, base_mode
from trainer.estimate.optimizer import muon_step_bytes, state_values
from trainer.models.common.args import ModelArgs

GIB = 2**30
# Share of a device's memory a run may plan to use (headroom for fragmentation, NCCL buffers, CUDA context).
USABLE_FRACTION = 0.9
# Float32 logits per chunk of the fused loss on GPUs (titan_kernels.reference.cross_entropy.CHUNK_BYTES).
FUSED_LOSS_CHUNK_BYTES = 256 * 2**20
SCHEDULES = ("1F1B", "Interleaved1F1B", "GPipe", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
_INTERLEAVED = ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
_V = ("ZBVZeroBubble", "DualPipeV")


@dataclass(frozen=True)
class Layout:
    """A parallel layout; ``n_devices = dp_replicate * dp_shard * tp * pp * cp``."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1  # expert parallel: borrows dp_shard ranks (not in n_devices); MoE models only

    @property
    def n_devices(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp

    @property
    def model_shards(self) -> int:
        """How many pieces each parameter is cut into: FSDP2 over dp_shard x cp, TP, PP stages."""
        return self.dp_shard * self.cp * self.tp * self.pp

    @property
    def dp(self) -> int:
        """Data-parallel degree (ranks reading different data)."""
        return self.dp_replicate * self.dp_shard

    def describe(self) -> str:
        parts = []
        if self.dp_replicate > 1:
            parts.append(f"HSDP {self.dp_replicate}x{self.dp_shard}")
        elif self.dp_shard > 1:
            parts.append(f"FSDP {self.dp_shard}")
        for name, v in (("EP", self.ep), ("TP", self.tp), ("PP", self.pp), ("CP", self.cp)):
            if v > 1:
                parts.append(f"{name} {v}")
        return " x ".join(parts) or "1 device"


@dataclass(frozen=True)
class ModelCosts:
    """What the estimates read from a model (dense Llama: ``model_costs(args)``).

    ``total_params`` sizes the memory, ``active_params`` the FLOPs (equal for dense models; an MoE
    model counts only the experts a token visits as active). Block fields are per transformer block.
    """

    n_layers: int
    dim: int
    q_dim: int  # n_heads * head_dim (= dim for Llama)
    kv_dim: int
    ffn_hidden: int  # SwiGLU width a token passes through (MoE: top_k experts + shared ones)
    n_heads: int
    head_dim: int
    vocab_size: int
    block_params: int
    embedding_params: int
    output_params: int  # 0 when tied to the embedding
    norm_params: int
    total_params: int
    active_params: int
    tied: bool
    expert_params: int = 0  # all routed-expert weights of the model (what expert parallel splits)
    n_moe_layers: int = 0
    top_k: int = 0  # expert rows per token (MoE): what the all-to-all moves
    extra_params: int = 0  # outside the layers, embedding and output: e.g. MTP modules (on the last stage)
    extra_blocks: int = 0  # blocks among those extra parameters (their activations)
    args: object = field(default=None, compare=False)  # the model args the FLOPs come from

    def gathered_block_params(self, ep: int = 1) -> float:
        """Parameters of one (average) block as FSDP2 all-gathers them on a rank: with expert
        parallel only its E/ep experts are gathered."""
        return self.block_params - self.expert_params / self.n_layers * (1 - 1 / ep)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 * (active parameters without the embedding lookup) + attention,
        counted per score entry the kernels compute (``trainer.models.common.args``)."""
        return self.args.flops_per_token(seq_len)

    def attention_flops_per_token(self, seq_len: int) -> float:
        return self.args.attention_flops_per_token(seq_len)


def model_costs(args) -> ModelCosts:
    """The ModelCosts of a model's hyperparameters (any family: the typed interface of
    ``trainer.models.common.args.ModelArgs``; for a MoE model ``active_params`` and the ``moe.top_k`` experts
    of ``moe.hidden_dim`` per token).

    The MoE share is counted simply: the experts' weights sharded like the rest (FSDP2 over dp_shard,
    with expert parallel over ep x dp_shard/ep, so the same bytes), only E/ep of them gathered per
    block under expert parallel (``Layout.ep``), the activations of the top_k experts a token visits,
    the FLOPs of the active parameters; the router, the token permutation buffers and load imbalance
    are left out. ``block_params`` is the mean over the blocks (dense and MoE ones differ).
    """
    p = args.num_params()
    moe = args.moe
    ffn = args.ffn_hidden_dim if args.n_moe_layers < args.n_layers else 0
    if moe is not None:  # the average SwiGLU width per layer over dense and MoE layers
        n_moe = args.n_moe_layers
        ffn = round((n_moe * moe.active_width() + (args.n_layers - n_moe) * ffn) / args.n_layers)
    emb = args.embedding_params()
    out = args.output_params()
    blocks = p - emb - out - args.dim - args.extra_params()
    return ModelCosts(
        n_layers=args.n_layers, dim=args.dim, q_dim=args.n_heads * args.qk_head_dim,
        kv_dim=args.kv_heads * (args.qk_head_dim + args.v_head_dim) // 2,
        ffn_hidden=ffn, n_heads=args.n_heads, head_dim=args.qk_head_dim, vocab_size=args.loss_vocab_size(),
        block_params=round(blocks / args.n_layers), embedding_params=emb, output_params=out,
        norm_params=args.dim, total_params=p, active_params=args.active_params(), tied=args.tie_word_embeddings,
        expert_params=args.expert_params(), n_moe_layers=args.n_moe_layers, top_k=moe.top_k if moe else 0,
        extra_params=args.extra_params(), extra_blocks=args.attention_layers() - args.n_layers, args=args,
    )


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated bytes per device, by component; ``total`` is the peak (module docstring)."""

    params: float
    grads: float
    optimizer: float
    working: float
    activations: float
    loss: float = 0.0
    grads_coexist: bool = False
    last_block: float = 0.0  # activations of the block the backward ends with (alive with all gradients)
    optimizer_step: float = 0.0  # Muon's Newton-Schulz buffers at the step (trainer.estimate.optimizer)
    host: float = 0.0  # host memory per device: offloaded states (CPU offload) and activations
    h2d: float = 0.0  # bytes per step over PCIe, host to device (CPU offload's shards, activations back)
    d2h: float = 0.0  # and device to host (gradient shards, activations out)

    @property
    def total(self) -> float:
        transient = self.activations + self.loss
        if self.grads_coexist:
            tail = transient + self.grads
        else:
            tail = max(transient, self.grads + self.last_block)
        step = self.params + self.optimizer + self.grads + self.optimizer_step  # at the optimizer step
        return max(self.params + self.optimizer + self.working + tail, step)

    def parts(self) -> list[tuple[str, float]]:
        return [("parameters", self.params), ("gradients", self.grads), ("optimizer state", self.optimizer),
                ("activations", self.activations), ("loss", self.loss), ("gathered weights/buffers", self.working)
                ] + ([("optimizer step buffers", self.optimizer_step)] if self.optimizer_step else [])

    def describe(self) -> str:
        text = ", ".join(f"{name} {b / GIB:,.1f}" for name, b in self.parts()) + f": peak {self.total / GIB:,.1f} GiB"
        if self.host:
            text += (f"; host {self.host / GIB:,.1f} GiB, PCIe {self.h2d / GIB:,.1f} GiB in + {self.d2h / GIB:,.1f} GiB "
                     f"out per step")
        return text


def block_values_per_token(costs: ModelCosts | ModelArgs, mode: str = "none", tp: int = 1) -> float:
    """Values one block keeps per token of its micro-batch (T tokens after CP; see the module docstring).

    ``mode``: "none" (everything autograd saves), "op" (selective per-op AC), "full" (the block input).
    """
    c = costs if isinstance(costs, ModelCosts) else model_costs(costs)
    d, f = c.dim, c.ffn_hidden
    # attention: q, its output, k, v, lse (per head, split by tp) and what it keeps whole on every rank
    # (MLA's latents); the model args say (``attention_saved_values``)
    if c.args is not None:
        whole, per_head = c.args.attention_saved_values()
    else:
        whole, per_head = 0, 2 * c.q_dim + 2 * c.kv_dim + c.n_heads
    if mode == "none":  # block input, residual; attention; 2 rstd; SwiGLU
        return 2 * d + whole + (2 * d + per_head + 3 * f + 2) / tp
    if mode == "op":  # wo and w2 outputs; the block input; attention; w1, w3 outputs
        return 2 * d + whole + (d + per_head + 2 * f) / tp
    if mode == "full":
        return d / tp
    raise ValueError(f"mode: expected none, op or full, got {mode!r}")


def activation_values_per_token(args: ModelArgs | ModelCosts, ac_mode: str = "none", selective_ac_option: str = "2",
                                tp: int = 1, n_layers: int | None = None) -> float:
    """Values (elements) autograd keeps per token over ``n_layers`` blocks (default all), excluding the loss."""
    c = args if isinstance(args, ModelCosts) else model_costs(args)
    n = c.n_layers if n_layers is None else n_layers
    full_block = block_values_per_token(c, "none", tp)
    if ac_mode == "none":
        return n * full_block
    if ac_mode == "full":
        return n * block_values_per_token(c, "full", tp) + full_block
    if ac_mode == "offload":  # staging only; the blocks themselves are in host memory
        return OFFLOAD_STAGING_BLOCKS * full_block
    if ac_mode != "selective":
        raise ValueError(f"activation_checkpoint.mode: expected none, full, selective or offload, got {ac_mode!r}")
    if selective_ac_option == "op":
        return n * block_values_per_token(c, "op", tp)
    every = int(selective_ac_option)
    n_ckpt = math.ceil(n / every)
    return n_ckpt * block_values_per_token(c, "full", tp) + (n - n_ckpt) * full_block + full_block


def stages_per_rank(schedule: str) -> int:
    return 2 if schedule in _INTERLEAVED else 1


def _in_flight(pp: int, schedule: str, microbatches: int, rank: int) -> float:
    """Micro-batches whose activations pp rank ``rank`` holds at once (per layer of the rank): 1F1B's
    warm-up leaves pp - rank in flight; interleaved schedules (v stages per rank) hold
    (pp - rank) * (1 + (pp - 1) / (pp * v)) (Korthikanti et al. 2022 for rank 0); GPipe all of them."""
    if pp == 1:
        return 1.0
    if schedule == "GPipe":
        return float(microbatches)
    depth = float(pp - rank)
    if schedule in _INTERLEAVED and schedule not in _V:
        depth *= 1 + (pp - 1) / (pp * stages_per_rank(schedule))
    return min(float(microbatches), depth)


def estimate_memory(
    args: ModelArgs | ModelCosts,
    layout: Layout,
    local_batch_size: int,
    seq_len: int,
    compute_bytes: int = 2,
    master_bytes: int = 4,
    ac_mode: str = "none",
    selective_ac_option: str = "2",
    *,
    grad_accum: int = 1,
    pp_schedule: str = "1F1B",
    microbatch_size: int = 1,
    reduce_bytes: int = 4,
    fused_loss: bool = True,
    loss_chunk_bytes: int = FUSED_LOSS_CHUNK_BYTES,
    optimizer: str = "adamw",
    state_bytes: int | None = None,
    reshard_after_forward: bool | None = None,
    cpu_offload: bool = False,
    layer_modes: list[str] | None = None,
) -> MemoryEstimate:
    """Estimated peak memory per device of training ``args`` on ``layout`` (see the module docstring).

    ``local_batch_size`` sequences of ``seq_len`` per data-parallel rank and accumulation
    micro-batch (split into pipeline micro-batches of ``microbatch_size`` under PP);
    ``compute_bytes``: bytes per value of the compute dtype (2 for bf16, 4 for fp32);
    ``master_bytes``: of the sharded master weights, gradients and AdamW state (4 = fp32);
    ``fused_loss``: the output projection and cross-entropy run as ``linear_cross_entropy``.
    ``optimizer`` "adamw" or "muon", ``state_bytes`` per state value (None: ``master_bytes``).
    ``reshard_after_forward``: FSDP2's, for the blocks (None: the default, True except under PP; False
    keeps the stage's blocks gathered from forward to backward). ``cpu_offload``: FSDP2's CPU offload;
    ``layer_modes``: one activation mode per layer (none, op, full, offload; module docstring), which
    replaces ``ac_mode``.
    Returns the worst stage's estimate. Raises ValueError for sizes < 1, an unknown schedule or optimizer.
    """
    for name, v in (("local_batch_size", local_batch_size), ("seq_len", seq_len),
                    ("dp_replicate", layout.dp_replicate), ("dp_shard", layout.dp_shard), ("tp", layout.tp),
                    ("pp", layout.pp), ("cp", layout.cp), ("grad_accum", grad_accum),
                    ("microbatch_size", microbatch_size)):
        if v < 1:
            raise ValueError(f"{name}: expected an integer >= 1, got {v}")
    if pp_schedule not in SCHEDULES:
        raise ValueError(f"pp_schedule: expected one of {SCHEDULES}, got {pp_schedule!r}")
    c = args if isinstance(args, ModelCosts) else model_costs(args)
    tp, pp, cp = layout.tp, layout.pp, layout.cp
    n_shard = layout.dp_shard * cp
    micro = microbatch_size if pp > 1 else local_batch_size
    m = local_batch_size // microbatch_size * grad_accum if pp > 1 else 1
    tokens = micro * seq_len / cp  # per micro-batch on this rank, before sequence parallel
    n_micro = m * (1 if pp > 1 else grad_accum)  # micro-batches through each layer per step
    coexist = grad_accum > 1 or pp > 1
    reshard = pp == 1 if reshard_after_forward is None else reshard_after_forward

    def stage(layers: int, root: float, in_flight: float, has_loss: bool) -> MemoryEstimate:
        p_stage = layers * c.block_params + root
        if has_loss:  # a family's extra blocks (MTP) run on the last stage, after the layers
            layers += c.extra_blocks
        state = p_stage * master_bytes / (n_shard * tp)
        working = 0.0
        if n_shard > 1 or compute_bytes != master_bytes or layout.dp_replicate > 1:
            blk = c.gathered_block_params(layout.ep)  # expert parallel: E/ep experts per block
            gathered = root + 2 * blk if reshard else layers * blk + root
            working = (gathered * compute_bytes + blk * reduce_bytes) / tp
        host_acts = pcie_acts = 0.0
        modes = _stage_modes(layer_modes, ac_mode, selective_ac_option, c.n_layers, layers)
        if modes is not None:
            keep = block_values_per_token(c, "none", tp)
            per = {"none": keep, "op": block_values_per_token(c, "op", tp), "full": block_values_per_token(c, "full", tp),
                   "offload": 0.0}
            n_off = modes.count("offload")
            vals = in_flight * sum(per[x] for x in modes) + max(
                OFFLOAD_STAGING_BLOCKS * keep if n_off else 0.0, keep if "full" in modes else 0.0)
            host_acts = in_flight * n_off * keep * tokens * compute_bytes
            pcie_acts = n_micro * n_off * keep * tokens * compute_bytes  # each way
        elif ac_mode == "full":
            vals = layers * in_flight * block_values_per_token(c, "full", tp) + block_values_per_token(c, "none", tp)
        else:
            vals = in_flight * activation_values_per_token(c, ac_mode, selective_ac_option, tp, n_layers=layers)
        acts = vals * tokens * compute_bytes
        loss = 0.0
        if has_loss:
            seq_tokens = tokens  # the loss sees every token of the micro-batch (vocab-parallel under TP)
            # The final norm keeps its input; unfused, the output matmul keeps its all-gathered input.
            acts += ((c.dim + 1) / tp + (0 if fused_loss else c.dim)) * tokens * compute_bytes
            if fused_loss:
                chunk = min(loss_chunk_bytes, seq_tokens * c.vocab_size / tp * 4)
                loss = (seq_tokens * c.dim * compute_bytes + c.output_params / tp * (compute_bytes + 4)
                        + seq_tokens * 4 + 2 * chunk)
            else:
                loss = 12 * seq_tokens * c.vocab_size / tp
        last_block = block_values_per_token(c, "none", tp) * tokens * compute_bytes
        opt = state_values(c, layers, p_stage, optimizer) * (master_bytes if state_bytes is None else state_bytes)
        opt /= n_shard * tp
        step = muon_step_bytes(c, layout.ep) if optimizer == "muon" else 0.0
        if not cpu_offload:
            return MemoryEstimate(state, state, opt, working, acts, loss, coexist, last_block, step,
                                  host_acts, pcie_acts, pcie_acts)
        # FSDP2 CPU offload: the states on the host; one block's fp32 shard on the device on its way in.
        blk_shard = c.gathered_block_params(layout.ep) * master_bytes / (n_shard * tp)
        root_shard = root * master_bytes / (n_shard * tp)
        gathers = 2 if reshard else 1
        # Per accumulation micro-batch; under PP once per step (the pipeline stage keeps the blocks gathered
        # and reduce-scatters after the last micro-batch only).
        rounds = 1 if pp > 1 else grad_accum
        h2d = rounds * (root_shard + gathers * layers * blk_shard) + pcie_acts
        d2h = rounds * state * reduce_bytes / master_bytes + pcie_acts
        return MemoryEstimate(0.0, 0.0, 0.0, working + blk_shard, acts, loss, coexist, last_block, 0.0,
                              2 * state + opt + host_acts, h2d, d2h)

    emb, out = c.embedding_params, c.output_params + c.norm_params + c.extra_params
    if pp == 1:
        return stage(c.n_layers, emb + out, 1.0, True)
    return max((stage(layers, emb * first + out * last, _in_flight(pp, pp_schedule, m, r), last)
                for r, (layers, first, last) in enumerate(pipeline_ranks(c.n_layers, pp, pp_schedule))),
               key=lambda e: e.total)


def _stage_modes(layer_modes: list[str] | None, ac_mode: str, selective_ac_option: str, n_layers: int,
                 layers: int) -> list[str] | None:
    """The per-layer activation modes of a stage of ``layers`` blocks, or None for the classic modes'
    formulas (none, full, selective). A pipeline stage takes the model's mix of modes in proportion."""
    if layer_modes is None:
        if ac_mode != "offload":
            return None
        layer_modes = [base_mode(ac_mode, selective_ac_option, i) for i in range(n_layers)]
    if not layer_modes:
        return None
    return [layer_modes[min(len(layer_modes) - 1, i * len(layer_modes) // max(layers, 1))] for i in range(layers)]


def pipeline_ranks(n_layers: int, pp: int, schedule: str) -> list[tuple[int, bool, bool]]:
    """Per pp rank: (layers it holds, holds the first stage, holds the last stage), as
    ``trainer.parallel.pipeline.plan_stages`` splits the layers evenly (looped stages r, r + pp, ...;
    V schedules r and 2*pp - 1 - r)."""
    v = stages_per_rank(schedule)
    n_stages = pp * v
    base, extra = divmod(n_layers, n_stages)
    size = [base + (1 if s < extra else 0) for s in range(n_stages)]
    out = []
    for r in range(pp):
        stages = (r, n_stages - 1 - r) if schedule in _V else tuple(r + i * pp for i in range(v))
        out.append((sum(size[s] for s in stages), 0 in stages, n_stages - 1 in stages))
    return out
