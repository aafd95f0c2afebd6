"""Expert parallel: the routed experts of every MoE layer split over the ``ep`` ranks, tokens sent to
the ranks of their experts by all-to-all and back (GShard, Lepikhin et al. 2020; torchtitan's
token-choice dispatch).

Layout. ``ep`` borrows data-parallel shard ranks (``ParallelDims``): each ep rank reads its own
batch and holds ``E / ep`` consecutive experts: w1, w2, w3 become DTensors ``Shard(0)`` on the
``ep`` mesh (with tensor parallel also, on the 2-D ``(ep, tp)`` mesh, split on the hidden size on
tp: w1/w3 ``Shard(2)``, w2 ``Shard(1)``). FSDP2 shards each rank's experts over the remaining
``dp_shard_mod_ep`` ranks (``trainer.parallel.fsdp``); checkpoints see whole (E, ., .) tensors, so
any layout resumes any other.

Dispatch, per MoE layer and micro-batch (``ExpertParallel.__call__``), on rows already sorted by
expert (``trainer.models.common.moe.MoE``):

1. the per-expert counts (E,) are exchanged first (one all-to-all of E integers): rank r learns
   how many rows each rank sends to each of its local experts; the split sizes are read on the host;
2. the rows go by ``all_to_all_single_autograd`` (a functional collective: its backward is the
   reverse all-to-all) with uneven splits;
3. received rows come grouped by source rank, then local expert; one gather puts them in local
   expert order for the grouped GEMMs, and the inverse gather undoes it;
4. the outputs return by the reverse all-to-all, in the order the rows left.

Gradients. Each expert's gradient sums the contributions of the tokens of all ep ranks, each
scaled like the loss by ``dp / global tokens``; FSDP2 then averages over the ``dp / ep`` ranks
holding the same experts, so the result is ``ep`` times the mean-loss gradient.
``ParallelModel.scale_expert_grads`` divides by ep before clipping.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


class ExpertParallel:
    """The token exchange of one ep group: ``self(x, counts, fn) -> out``.

    x (N, dim): this rank's (token, expert) rows sorted by expert; counts (E,) int64 rows per global
    expert; ``fn(rows, local_counts)`` runs this rank's ``E / ep`` experts on rows sorted by local
    expert. Returns (N, dim), the expert outputs of x's rows in x's order.
    """

    def __init__(self, ep_mesh: DeviceMesh) -> None:
        self.mesh = ep_mesh
        self.group = ep_mesh.get_group()
        self.size = ep_mesh.size()

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, fn) -> torch.Tensor:
        ep = self.size
        n_local = counts.numel() // ep
        # 1. counts first: recv[s, e] = rows rank s sends to this rank's local expert e.
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=self.group)
        recv = recv.view(ep, n_local)
        send_splits = counts.view(ep, n_local).sum(1).tolist()
        recv_splits = recv.sum(1).tolist()
        # 2. rows out.
        rows = all_to_all_single_autograd(x.contiguous(), recv_splits, send_splits, self.group)
        # 3. (source, local expert) order -> (local expert, source) order.
        perm = _expert_major(recv)
        out = fn(rows[perm], recv.sum(0))
        back = torch.empty_like(out)
        back = back.index_copy(0, perm, out) if perm.numel() else out
        # 4. outputs back where the rows came from.
        return all_to_all_single_autograd(back, send_splits, recv_splits, self.group)


def _expert_major(recv: torch.Tensor) -> torch.Tensor:
    """Row indices that reorder blocks laid out source-major (``recv[s, e]`` rows each) into
    expert-major order: for e, for s, the rows of block (s, e). int64 (recv.sum(),)."""
    ep, n_local = recv.shape
    flat = recv.flatten()
    starts = torch.cumsum(flat, 0) - flat  # start of block (s, e) in source-major order
    lengths = recv.t().flatten()  # block lengths in expert-major order
    block_starts = starts.view(ep, n_local).t().flatten()
    total = int(lengths.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64, device=recv.device)
    out_starts = torch.cumsum(lengths, 0) - lengths
    shift = torch.repeat_interleave(block_starts - out_starts, lengths)
    return torch.arange(total, device=recv.device) + shift


def check_ep_divisibility(args, ep: int, tp: int) -> None:
    """Raise ValueError naming the parallelism key unless the model has experts to split: MoE
    layers, num_experts divisible by ep, the expert hidden size divisible by tp."""
    moe = args.moe
    if ep > 1 and moe is None:
        raise ValueError("parallelism.expert_parallel_degree: the model has no mixture-of-experts layers "
                         "(use a MoE flavor, e.g. --model.name qwen3 --flavor debugmodel_moe)")
    if moe is None:
        return
    if moe.num_experts % ep:
        raise ValueError(f"parallelism.expert_parallel_degree: {ep} does not divide the model's num_experts = "
                         f"{moe.num_experts}")
    if tp > 1 and moe.hidden_dim % tp:
        raise ValueError(f"parallelism.tensor_parallel_degree: {tp} does not divide the experts' hidden_dim = "
                         f"{moe.hidden_dim}")


def shard_experts(model: nn.Module, world_mesh: DeviceMesh, ep: int, tp: int) -> list[nn.Parameter]:
    """Turn the routed experts of every MoE layer of ``model`` into DTensors for expert and/or tensor
    parallel (module docstring), install the token exchange when ep > 1, and return the expert
    parameters (for ``scale_expert_grads`` and FSDP2). Works on the meta device."""
    from trainer.models.common.moe import moe_modules

    if ep == 1 and tp == 1:
        return []
    # The projections' biases (GPT-OSS) follow their weights' expert and hidden splits; w2's bias
    # (E, dim) is replicated over tp (``GroupedExperts`` adds 1/tp of it on each rank).
    if ep > 1 and tp > 1:
        mesh = world_mesh["ep", "tp"]
        in_out = {"w1": [Shard(0), Shard(2)], "w3": [Shard(0), Shard(2)], "w2": [Shard(0), Shard(1)],
                  "w1_bias": [Shard(0), Shard(1)], "w3_bias": [Shard(0), Shard(1)], "w2_bias": [Shard(0), Replicate()]}
    elif ep > 1:
        mesh = world_mesh["ep"]
        in_out = {"w1": [Shard(0)], "w3": [Shard(0)], "w2": [Shard(0)],
                  "w1_bias": [Shard(0)], "w3_bias": [Shard(0)], "w2_bias": [Shard(0)]}
    else:
        mesh = world_mesh["tp"]
        in_out = {"w1": [Shard(2)], "w3": [Shard(2)], "w2": [Shard(1)],
                  "w1_bias": [Shard(1)], "w3_bias": [Shard(1)], "w2_bias": [Replicate()]}
    params = []
    for _, moe in moe_modules(model):
        experts = moe.experts
        for name, placements in in_out.items():
            p = getattr(experts, name)
            if p is None:  # experts without biases
                continue
            dt = nn.Parameter(distribute_tensor(p.data, mesh, placements, src_data_rank=None),
                              requires_grad=p.requires_grad)
            setattr(experts, name, dt)
            params.append(dt)
        if ep > 1:
            experts.expert_parallel = ExpertParallel(world_mesh["ep"])
    return params if ep > 1 else []
