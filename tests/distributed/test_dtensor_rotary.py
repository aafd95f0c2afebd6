"""apply_rotary_emb on DTensor: 2 gloo CPU ranks.

Checks, on the reference and Triton backends: q/k sharded on batch (2-D position_ids sharded alike,
1-D or no position_ids replicated), on heads (k sharded too, or replicated with one kv head), and
on seq with explicit position_ids sharded alike, all run with no collective (CommDebugMode) in the
forward and the backward, keep their placements, and equal the unsharded results. A sharded
head_dim, or seq sharded without position_ids, is redistributed and still right.
"""
from __future__ import annotations

import torch

from tests.distributed.launcher import run_distributed


def _check(rank: int, world: int) -> None:
    import titan_kernels as tk
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.experimental import implicit_replication

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)  # the same full tensors on every rank
    batch, seq, head_dim = 4, 6, 12
    cos, sin = tk.rope_cos_sin(head_dim, 16, scaling=None, rotary_dim=8)
    pos2 = torch.randint(0, 16, (batch, seq))
    pos1 = torch.randperm(16)[:seq]
    rep = [Replicate()]

    def dt(t, placement):
        return None if t is None else distribute_tensor(t, mesh, [placement])

    def case(n_heads, n_kv_heads, q_pl, k_pl, pos, pos_pl, interleaved, collectives):
        q = torch.randn(batch, seq, n_heads, head_dim)
        k = torch.randn(batch, seq, n_kv_heads, head_dim)
        gq, gk = torch.randn(q.shape), torch.randn(k.shape)
        qr, kr = q.clone().requires_grad_(), k.clone().requires_grad_()
        qo_ref, ko_ref = tk.apply_rotary_emb(qr, kr, cos, sin, interleaved=interleaved, position_ids=pos)
        dq_ref, dk_ref = torch.autograd.grad((qo_ref, ko_ref), (qr, kr), (gq, gk))

        qd = dt(q, q_pl).requires_grad_()
        kd = dt(k, k_pl).requires_grad_()
        cosd, sind, posd = dt(cos, Replicate()), dt(sin, Replicate()), dt(pos, pos_pl)
        gqd, gkd = dt(gq, q_pl), dt(gk, k_pl)
        with CommDebugMode() as comm:
            qo, ko = tk.apply_rotary_emb(qd, kd, cosd, sind, interleaved=interleaved, position_ids=posd)
            if collectives:  # outputs come out in whatever placement DTensor chose
                gqd, gkd = gqd.redistribute(mesh, qo.placements), gkd.redistribute(mesh, ko.placements)
            dq, dk = torch.autograd.grad((qo, ko), (qd, kd), (gqd, gkd))
        label = (n_heads, n_kv_heads, q_pl, k_pl, pos_pl)
        if collectives:
            assert comm.get_total_counts() > 0, label
        else:
            assert comm.get_total_counts() == 0, (label, comm.get_comm_counts())
            assert qo.placements == (q_pl,) and ko.placements == (k_pl,), (label, qo.placements, ko.placements)
            assert dq.placements == (q_pl,) and dk.placements == (k_pl,), label
        torch.testing.assert_close(qo.full_tensor(), qo_ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ko.full_tensor(), ko_ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(dq.full_tensor(), dq_ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(dk.full_tensor(), dk_ref, rtol=1e-6, atol=1e-6)

    for be in ("reference", "triton"):
        with tk.use_backend(be):
            for interleaved in (True, False):
                # batch: positions per row sharded with q, shared positions replicated
                case(4, 2, Shard(0), Shard(0), pos2, Shard(0), interleaved, False)
                case(4, 2, Shard(0), Shard(0), pos1, Replicate(), interleaved, False)
                case(4, 2, Shard(0), Shard(0), None, None, interleaved, False)
                # heads (tensor parallel): k split too, or replicated when there is one kv head
                case(4, 2, Shard(2), Shard(2), pos2, Replicate(), interleaved, False)
                case(6, 1, Shard(2), Replicate(), None, None, interleaved, False)
                # seq (context parallel): each shard brings its own positions
                case(4, 2, Shard(1), Shard(1), pos1, Shard(0), interleaved, False)
                case(4, 2, Shard(1), Shard(1), pos2, Shard(1), interleaved, False)
            # Never a silent wrong answer: head_dim split, or seq split without positions.
            case(4, 2, Shard(3), Shard(3), None, None, True, True)
            case(4, 2, Shard(1), Shard(1), None, None, False, True)

            # Plain cos/sin tables next to DTensor q/k, under implicit replication.
            q = torch.randn(batch, seq, 4, head_dim)
            k = torch.randn(batch, seq, 2, head_dim)
            qd, kd = dt(q, Shard(2)), dt(k, Shard(2))
            with implicit_replication(), CommDebugMode() as comm:
                qo, ko = tk.apply_rotary_emb(qd, kd, cos, sin)
            assert comm.get_total_counts() == 0
            q_ref, k_ref = tk.apply_rotary_emb(q, k, cos, sin)
            torch.testing.assert_close(qo.full_tensor(), q_ref)
            torch.testing.assert_close(ko.full_tensor(), k_ref)

            # Out-of-range positions on a shard are caught on that shard, before any kernel.
            bad = pos2.clone()
            bad[-1, -1] = 16
            try:
                tk.apply_rotary_emb(dt(q, Shard(0)), dt(k, Shard(0)), dt(cos, Replicate()), dt(sin, Replicate()),
                                    position_ids=dt(bad, Shard(0)))
            except ValueError as e:
                assert rank == world - 1 and "position_ids" in str(e), (rank, e)
            else:
                assert rank != world - 1, "out-of-range position_ids not reported"


def test_dtensor_rotary_two_ranks():
    run_distributed(_check, 2)
