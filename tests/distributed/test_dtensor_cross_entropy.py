"""linear_cross_entropy under tensor parallel: 2 gloo CPU ranks, the weight split on the vocabulary.

Checks, for every reduction, fp32, on the reference and Triton backends: with weight
``Shard(0)`` (V = 503, an uneven split 252 / 251) and hidden replicated or split on the sequence
(sequence parallel), the loss and the gradients of hidden and weight equal the single-process
results on the full tensors (1e-5); the gradients keep the inputs' placements (hidden's back on
its sequence split, weight Shard(0)). No logits are gathered: ``CommDebugMode`` sees no all-gather
with replicated hidden and exactly one, of hidden itself, with sequence-split hidden; inside the op
only all-reduces of token-sized statistics run (recorded from the functional collectives). A weight
split on the hidden dim is redistributed first and gives the same result.
"""
from __future__ import annotations

import collections

import torch

from tests.distributed.launcher import run_distributed


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _check(rank: int, world: int) -> None:
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    import titan_kernels as tk

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)  # the same full tensors on every rank
    b, s, d, v = 3, 10, 16, 503
    hidden = torch.randn(b, s, d)
    weight = torch.randn(v, d) / d**0.5
    labels = torch.randint(0, v, (b, s))
    labels[:, ::4] = -100

    # Token-sized collectives inside the op, recorded by element count.
    inner = collections.Counter()
    real_all_reduce = funcol.all_reduce

    def recording_all_reduce(t, *args, **kwargs):
        inner[t.numel()] += 1
        return real_all_reduce(t, *args, **kwargs)

    funcol.all_reduce = recording_all_reduce
    try:
        for be in ("reference", "triton"):
            for reduction in ("mean", "sum", "none"):
                gout = torch.rand(b, s) + 0.5 if reduction == "none" else torch.tensor(1.3)
                with tk.use_backend(be):
                    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
                    loss1 = tk.linear_cross_entropy(h1, w1, labels, reduction=reduction)
                    loss1.backward(gout)
                    for seq_split in (False, True):
                        hp = [Shard(1)] if seq_split else [Replicate()]
                        hd = distribute_tensor(hidden, mesh, hp).requires_grad_()
                        wd = distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_()
                        inner.clear()
                        with CommDebugMode() as comm:
                            loss = tk.linear_cross_entropy(hd, wd, labels, reduction=reduction)
                        counts = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
                        # The only all-gather is hidden's (b * s / world rows of d per rank) under
                        # sequence parallel; the logits (b * s * v) never move.
                        assert counts.get("all_gather_into_tensor", 0) == (1 if seq_split else 0), counts
                        assert all(op == "all_reduce" or "gather" in op for op in counts), counts
                        # The forward's all-reduces (inside the op): a MAX of (tokens,) and a SUM of
                        # (2, tokens) per chunk, nothing larger.
                        assert inner and all(n <= 2 * b * s for n in inner), inner
                        assert isinstance(loss, DTensor) and loss.placements == (Replicate(),)
                        loss.backward(distribute_tensor(gout, mesh, [Replicate()]))
                        assert _rel(loss.full_tensor(), loss1) < 1e-5, (be, reduction, seq_split)
                        assert hd.grad.placements == tuple(hp) and wd.grad.placements == (Shard(0),)
                        assert _rel(hd.grad.full_tensor(), h1.grad) < 1e-5, (be, reduction, seq_split)
                        assert _rel(wd.grad.full_tensor(), w1.grad) < 1e-5, (be, reduction, seq_split)

        # The weight split on the hidden dim: redistributed to the vocabulary split, same answer.
        wd = distribute_tensor(weight, mesh, [Shard(1)]).requires_grad_()
        hd = distribute_tensor(hidden, mesh, [Replicate()])
        loss = tk.linear_cross_entropy(hd, wd, labels)
        loss.backward()
        h1, w1 = hidden.clone(), weight.clone().requires_grad_()
        loss1 = tk.linear_cross_entropy(h1, w1, labels)
        loss1.backward()
        assert _rel(loss.full_tensor(), loss1) < 1e-5
        assert _rel(wd.grad.full_tensor(), w1.grad) < 1e-5
    finally:
        funcol.all_reduce = real_all_reduce


def test_vocab_parallel_equals_one_process_without_gathering_logits():
    run_distributed(_check, 2)
