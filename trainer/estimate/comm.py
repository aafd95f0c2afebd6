"""Communication per step of a training run for a parallel layout: the collectives and point-to-point
sends of every parallel dimension, in bytes per rank (trainer/parallel/README.md derives the formulas;
``trainer.plan`` turns them into time).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from trainer.estimate.memory import Layout, ModelCosts, model_costs
from trainer.models.common.args import ModelArgs
from trainer.parallel.cp_schedule import blocks_sent


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


@functools.lru_cache(maxsize=1024)  # the planner evaluates thousands of layouts with few distinct masks
def _mean_blocks_sent(cp: int, c: int, left: int, right: int, chunk: int) -> float:
    return sum(blocks_sent(cp, c, left, right, chunk)) / cp


def cp_blocks_per_layer(costs: ModelCosts, seq_len: int, cp: int) -> float:
    """K/V blocks one rank sends per attention layer in one ring pass (forward), the mean over the
    layers and the ranks: what ``trainer.parallel.context_parallel`` sends under each layer's mask
    (``ModelArgs.attention_window``), counted by the same schedule (``trainer.parallel.cp_schedule``).
    A model without args (a bare ``ModelCosts``) counts causal layers: cp - 1.
    """
    if cp == 1:
        return 0.0
    c = seq_len // (2 * cp)  # the zigzag chunk
    args = costs.args
    if args is None or c < 1:
        return float(cp - 1)
    total = 0.0
    for i in range(costs.n_layers):
        (left, right), chunk = args.attention_window(i)
        total += _mean_blocks_sent(cp, c, left, right, chunk)
    return total / costs.n_layers


def communication_per_step(
    args: ModelArgs | ModelCosts,
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
    reshard_after_forward: bool | None = None,
) -> list[Collective]:
    """Bytes each rank sends (= receives) per optimizer step, by dimension and collective (the mean
    over the ranks where they differ: context parallel under a sliding window).

    ``local_batch_size`` sequences of ``seq_len`` per micro-batch and data-parallel rank,
    ``grad_accum`` micro-batches per step; ``microbatch_size``/``stages_per_rank`` for pipeline
    parallel; ``compute_bytes`` for parameters/activations on the wire (bf16: 2), ``reduce_bytes``
    for gradients (fp32: 4). ``ac_mode`` "full" re-runs each block's forward in the backward, with its
    TP and CP communication. ``reshard_after_forward``: FSDP2's, for the blocks (None: True except
    under PP); False gathers each block once per micro-batch. Size-1 dims contribute nothing. See trainer/parallel/README.md.
    """
    c = args if isinstance(args, ModelCosts) else model_costs(args)
    L = c.n_layers / layout.pp  # layers on this rank
    d, kv, V = c.dim, c.kv_dim, c.vocab_size
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
    ep = layout.ep
    if n > 1 or layout.dp_replicate > 1:
        # With expert parallel the experts are their own FSDP unit over dp_shard / ep ranks (below).
        blocks = (c.n_layers * c.block_params - (c.expert_params if ep > 1 else 0)) / (tp * pp)
        root = (c.total_params - c.n_layers * c.block_params) / (tp * pp)
        gathers = 2 if (pp == 1 if reshard_after_forward is None else reshard_after_forward) else 1
        if n > 1:
            out.append(Collective("dp_shard_cp", "all-gather", "parameters (all units)", grad_accum,
                                  _ring(n) * cb * (gathers * blocks + root)))
            out.append(Collective("dp_shard_cp", "reduce-scatter", "gradients (all units)", grad_accum,
                                  _ring(n) * rb * (blocks + root)))
        if layout.dp_replicate > 1:
            r = layout.dp_replicate
            out.append(Collective("dp_replicate", "all-reduce", "gradient shards (all units)", grad_accum,
                                  2 * _ring(r) * rb * (blocks + root) / n))
        if ep > 1 and layout.dp_shard // ep > 1:
            m_ep = layout.dp_shard // ep
            experts = c.expert_params / (ep * tp * pp)  # this rank's E/ep experts
            out.append(Collective("dp_shard_mod_ep", "all-gather", "expert parameters", grad_accum,
                                  _ring(m_ep) * cb * gathers * experts))
            out.append(Collective("dp_shard_mod_ep", "reduce-scatter", "expert gradients", grad_accum,
                                  _ring(m_ep) * rb * experts))
    # Expert parallel: per MoE layer and micro-batch the (token, expert) rows go to their experts'
    # ranks and back in the forward (2 all-to-alls), their gradients likewise in the backward; every
    # tp rank sends the whole (all-gathered) sequence; (ep-1)/ep of the rows leave the rank.
    if ep > 1 and c.n_moe_layers:
        rows = tokens * c.top_k * d * cb * (ep - 1) / ep
        out.append(Collective("ep", "all-to-all", "routed tokens and their gradients",
                              chunks * c.n_moe_layers / pp * (4 + 2 * recompute), rows))
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
    # Context parallel (ring attention): per layer, the local K/V block goes to each rank some of whose
    # queries see it (cp - 1 under a causal mask, fewer under a short window or attention chunks:
    # ``cp_blocks_per_layer``); the backward sends K/V again and each received block's float32
    # gradient back to its owner.
    if cp > 1:
        kv_block = 2 * tokens * kv / tp
        sends = chunks * L * cp_blocks_per_layer(c, seq_len, cp)
        out.append(Collective("cp", "send/recv", "K/V blocks", sends * (2 + recompute), kv_block * cb))
        out.append(Collective("cp", "send/recv", "K/V gradients", sends, kv_block * 4))
    # Pipeline: each micro-batch's activations go to the next stage and their gradients come back,
    # a (microbatch_size, seq/cp/tp, dim) tensor per tp rank and boundary.
    if pp > 1:
        boundary = tokens / tp * d * cb
        # Every stage but the last sends forward, every one but the first sends back: averaged per rank.
        hops = chunks * stages_per_rank * (pp * stages_per_rank - 1) / (pp * stages_per_rank)
        out.append(Collective("pp", "send", "activations", hops, boundary))
        out.append(Collective("pp", "send", "activation gradients", hops, boundary))
    return out
