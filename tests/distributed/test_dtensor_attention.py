"""flash_attn on DTensor: 2 gloo CPU ranks.

Checks: q/k/v split on batch or on heads (GQA groups kept whole), and varlen split on heads with
cu_seqlens replicated, run with no collective inside the op, forward and backward (with an LSE
gradient), with the expected output/gradient placements, and match float64 on the full tensors
(also with a sliding window, sinks and soft-capping: sinks follow q's heads);
under MQA, k/v may stay replicated while q is split on heads, and dk/dv come out Partial; a split
sequence has no local rule, so DTensor gathers it and the answer is still right. Both the reference
and the Triton (interpreted) backends run. About 30 s.
"""
from __future__ import annotations

from tests.distributed.launcher import run_distributed


def _check(rank: int, world: int) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    import titan_kernels as tk
    from tests.kernels.attention_ref import attention64, dense64, doc_mask, rel

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)  # the same full tensors on every rank
    R = Replicate()

    def run(fn, inputs, placements, douts):
        dts = [distribute_tensor(t, mesh, [p]).requires_grad_() for t, p in zip(inputs, placements)]
        with CommDebugMode() as comm:
            outs = fn(*dts)
        n = comm.get_total_counts()
        cotangents = [distribute_tensor(g, mesh, [o.placements[0]]) for g, o in zip(douts, outs)]
        with CommDebugMode() as comm:
            grads = torch.autograd.grad(outs, dts, cotangents)
        # A replicated input's gradient may come out Partial: its sum over ranks is a collective of
        # the caller's, not of the op (counted apart).
        return outs, grads, n + comm.get_total_counts()

    def reference_grads(fn64, inputs, douts):
        xs = [t.double().requires_grad_() for t in inputs]
        outs = fn64(*xs)
        return outs, torch.autograd.grad(outs, xs, [g.double() for g in douts])

    for be in ("reference", "triton"):
        with tk.use_backend(be):
            # Dense, GQA 4:2: batch or heads.
            q, k, v = torch.randn(4, 24, 4, 16), torch.randn(4, 30, 2, 16), torch.randn(4, 30, 2, 16)
            dout, dlse = torch.randn(4, 24, 4, 16), torch.randn(4, 4, 24)
            fn = lambda q, k, v: tk.flash_attn(q, k, v, causal=True, return_lse=True)  # noqa: E731
            (o64, l64), g64 = reference_grads(lambda q, k, v: dense64(q, k, v, True, 0.25), (q, k, v), (dout, dlse))
            for name, p, po, pl in (("batch", Shard(0), Shard(0), Shard(0)), ("heads", Shard(2), Shard(2), Shard(1))):
                (o, l), g, comms = run(fn, (q, k, v), (p, p, p), (dout, dlse))
                where = (be, name)
                assert comms == 0, where
                assert (o.placements, l.placements) == ((po,), (pl,)), where
                assert all(x.placements == (p,) for x in g), where
                assert rel(o.full_tensor(), o64) < 1e-5 and rel(l.full_tensor(), l64) < 1e-5, where
                for a, e in zip(g, g64):
                    assert rel(a.full_tensor(), e) < 1e-5, where

            # A sliding window, sinks and soft-capping: the sinks follow q's heads (replicated when the
            # batch is split); their gradient sums over batch and rows.
            sinks, window = torch.randn(4), (5, 0)
            fn = lambda q, k, v, s: tk.flash_attn(q, k, v, window_size=window, sinks=s, softcap=3.0,  # noqa: E731
                                                  return_lse=True)
            (o64, l64), g64 = reference_grads(
                lambda q, k, v, s: dense64(q, k, v, True, 0.25, window=window, sinks=s, softcap=3.0),
                (q, k, v, sinks), (dout, dlse))
            for name, p, ps in (("batch", Shard(0), R), ("heads", Shard(2), Shard(0))):
                (o, l), g, comms = run(fn, (q, k, v, sinks), (p, p, p, ps), (dout, dlse))
                where = (be, "variants", name)
                assert comms == 0, where
                assert rel(o.full_tensor(), o64) < 1e-5 and rel(l.full_tensor(), l64) < 1e-5, where
                for a, e in zip(g, g64):
                    assert rel(a.full_tensor(), e) < 1e-5, where

            # MQA: q split on heads, the single k/v head replicated; dk/dv are per-rank partial sums.
            q, k, v = torch.randn(2, 20, 4, 16), torch.randn(2, 20, 1, 16), torch.randn(2, 20, 1, 16)
            dout = torch.randn(2, 20, 4, 16)
            fn = lambda q, k, v: (tk.flash_attn(q, k, v, causal=False),)  # noqa: E731
            (o64,), g64 = reference_grads(lambda q, k, v: (dense64(q, k, v, False, 0.25)[0],), (q, k, v), (dout,))
            (o,), g, comms = run(fn, (q, k, v), (Shard(2), R, R), (dout,))
            assert comms == 0 and o.placements == (Shard(2),), be
            assert [x.placements for x in g] == [(Shard(2),), (Partial(),), (Partial(),)], be
            assert rel(o.full_tensor(), o64) < 1e-5
            for a, e in zip(g, g64):
                assert rel(a.full_tensor(), e) < 1e-5, be

            # Varlen on heads, cu_seqlens replicated; an empty document in the middle.
            lens = [9, 0, 14, 5]
            cu = torch.tensor([0, 9, 9, 23, 28], dtype=torch.int32)
            q, k, v = torch.randn(28, 4, 16), torch.randn(28, 2, 16), torch.randn(28, 2, 16)
            dout = torch.randn(28, 4, 16)
            cud = distribute_tensor(cu, mesh, [R])
            fn = lambda q, k, v: (tk.flash_attn_varlen(q, k, v, cud, cud, 14, 14),)  # noqa: E731
            mask = doc_mask(lens, lens, True)
            (o64,), g64 = reference_grads(lambda q, k, v: (attention64(q, k, v, mask, 0.25)[0],), (q, k, v), (dout,))
            (o,), g, comms = run(fn, (q, k, v), (Shard(1), Shard(1), Shard(1)), (dout,))
            assert comms == 0 and o.placements == (Shard(1),), be
            assert rel(o.full_tensor(), o64) < 1e-5
            for a, e in zip(g, g64):
                assert rel(a.full_tensor(), e) < 1e-5, be

    # A split sequence is not local: DTensor gathers first, and the answer is right.
    q = torch.randn(2, 16, 2, 16)
    qd = distribute_tensor(q, mesh, [Shard(1)])
    with CommDebugMode() as comm:
        o = tk.flash_attn(qd, qd, qd)
    assert comm.get_total_counts() > 0
    assert rel(o.full_tensor(), dense64(q, q, q, True, 0.25)[0]) < 1e-5


def test_flash_attn_dtensor_rules():
    run_distributed(_check, 2)
