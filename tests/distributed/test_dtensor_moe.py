"""grouped_mm and the MoE routing ops on DTensor: 2 gloo CPU ranks, tensor parallel on the experts.

Checks: colwise (w split on N) and rowwise (x and w split on K) grouped GEMMs run with no collective,
forward and backward, with the placements the rules give (Shard(1) / Partial) and results and
gradients equal to the unsharded ones; a whole MoE feed-forward (permute -> colwise w1/w3 -> swiglu
-> rowwise w2 -> unpermute of the Partial buffer) runs its forward with no collective and its
backward with only the input-gradient reduction, and equals one process; a token-split x (which
would cut the groups) is redistributed, never wrong. fp8_grouped_mm shares the colwise / rowwise rules
(per-shard scales: colwise y and dw equal the unsharded op, the rest to float8 accuracy) and refuses a
Partial input (reduced first, not quantized summand by summand).
"""
from __future__ import annotations

import torch

from tests.distributed.dtensor_checks import assert_gathered_close
from tests.distributed.launcher import run_distributed


def _operands():
    """x (13, 16), w (4 experts, 16, 24), offsets with an empty expert, dy: the same on every rank."""
    torch.manual_seed(0)
    t, k, n, e = 13, 16, 24, 4
    x = torch.randn(t, k)
    w = torch.randn(e, k, n) * k**-0.5
    offsets = torch.tensor([3, 3, 10, 13], dtype=torch.int32)  # an empty expert
    return x, w, offsets, torch.randn(t, n)


def _check_tp(rank: int, world: int) -> None:
    import titan_kernels as tk
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh("cpu", (world,))
    x, w, offsets, dy = _operands()
    rep = Replicate()

    def unsharded():
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = tk.grouped_mm(xx, ww, offsets)
        return (y.detach(), *torch.autograd.grad(y, (xx, ww), dy))

    for backend in ("reference", "cpu"):  # "cpu": aten's torch._grouped_mm
        with tk.use_backend(backend):
            y_ref, dx_ref, dw_ref = unsharded()
            # colwise: x replicated, w split on N -> y split on N; dx Partial, dw split on N.
            for x_pl, w_pl, y_pl, dy_pl in (
                (rep, Shard(2), Shard(1), Shard(1)),
                (Shard(1), Shard(1), Partial(), rep),  # rowwise: K split -> y Partial
            ):
                xd = distribute_tensor(x, mesh, [x_pl]).requires_grad_()
                wd = distribute_tensor(w, mesh, [w_pl]).requires_grad_()
                od = distribute_tensor(offsets, mesh, [rep])
                dyd = distribute_tensor(dy, mesh, [dy_pl])
                with CommDebugMode() as comm:
                    y = tk.grouped_mm(xd, wd, od)
                    dx, dw = torch.autograd.grad(y, (xd, wd), dyd)
                assert comm.get_total_counts() == 0, (backend, w_pl, comm.get_comm_counts())
                assert y.placements == (y_pl,), (backend, w_pl, y.placements)
                assert dw.placements == (w_pl,), (backend, w_pl, dw.placements)
                assert_gathered_close((y, y_ref), (dx, dx_ref), (dw, dw_ref), rtol=1e-5, atol=1e-5)

            # Tokens split on dim 0 would cut groups: DTensor gathers x first (a collective), right answer.
            xd = distribute_tensor(x, mesh, [Shard(0)])
            with CommDebugMode() as comm:
                y = tk.grouped_mm(xd, distribute_tensor(w, mesh, [rep]), offsets)  # plain offsets: replicated
            assert comm.get_total_counts() > 0
            assert_gathered_close((y, y_ref), rtol=1e-5, atol=1e-5)


def _check_fp8_tp(rank: int, world: int) -> None:
    import titan_kernels as tk
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh("cpu", (world,))
    x, w, offsets, dy = _operands()
    rep = Replicate()

    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())

    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    y_ref = tk.fp8_grouped_mm(xx, ww, offsets)
    dx_ref, dw_ref = torch.autograd.grad(y_ref, (xx, ww), dy)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    bounds = [0, *offsets.tolist()]
    y64 = torch.cat([x64[a:b] @ w64[i] for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))])
    dx64, dw64 = torch.autograd.grad(y64, (x64, w64), dy.double())
    for x_pl, w_pl, y_pl, dy_pl in (
        (rep, Shard(2), Shard(1), Shard(1)),   # colwise: every forward / wgrad scale sees the whole K
        (Shard(1), Shard(1), Partial(), rep),  # rowwise: per-K-shard scales of x and w
    ):
        xd = distribute_tensor(x, mesh, [x_pl]).requires_grad_()
        wd = distribute_tensor(w, mesh, [w_pl]).requires_grad_()
        od, dyd = distribute_tensor(offsets, mesh, [rep]), distribute_tensor(dy, mesh, [dy_pl])
        with CommDebugMode() as comm:
            y = tk.fp8_grouped_mm(xd, wd, od)
            dx, dw = torch.autograd.grad(y, (xd, wd), dyd)
        assert comm.get_total_counts() == 0, (w_pl, comm.get_comm_counts())
        assert y.placements == (y_pl,) and dw.placements == (w_pl,), (w_pl, y.placements, dw.placements)
        if w_pl == Shard(2):
            assert rel(y.full_tensor(), y_ref) < 1e-6 and rel(dw.full_tensor(), dw_ref) < 1e-6
        for got, want in ((y, y64), (dx, dx64), (dw, dw64)):
            assert rel(got.full_tensor(), want) < 7e-2, (w_pl, rel(got.full_tensor(), want))
    # A Partial x is reduced before it is quantized (a collective), and the result is right.
    xd = DTensor.from_local(x / world, mesh, [Partial()], run_check=False)  # the sum over ranks is x
    wd = distribute_tensor(w, mesh, [rep])
    with CommDebugMode() as comm:
        y = tk.fp8_grouped_mm(xd, wd, offsets)
    assert comm.get_total_counts() > 0  # reduced (all-reduce or reduce-scatter onto a rowwise split)
    assert rel(y.full_tensor(), y64.detach()) < 7e-2


def _check_moe_ffn(rank: int, world: int) -> None:
    import titan_kernels as tk
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    t, dim, hidden, e, top_k = 11, 16, 8, 5, 2
    x = torch.randn(t, dim)
    w1, w3 = (torch.randn(e, dim, hidden) * dim**-0.5 for _ in range(2))
    w2 = torch.randn(e, hidden, dim) * hidden**-0.5
    idx = torch.stack([torch.randperm(e)[:top_k] for _ in range(t)])
    scores = torch.rand(t, top_k)

    def ffn(x, w1, w3, w2, scores):
        xp, routing = tk.moe_permute(x, idx, e, 4)
        h = tk.swiglu(tk.grouped_mm(xp, w1, routing.offsets), tk.grouped_mm(xp, w3, routing.offsets))
        return tk.moe_unpermute(tk.grouped_mm(h, w2, routing.offsets), routing, scores)

    params = [x, w1, w3, w2, scores]
    ref = [p.clone().requires_grad_() for p in params]
    out_ref = ffn(*ref)
    dout = torch.randn_like(out_ref)
    g_ref = torch.autograd.grad(out_ref, ref, dout)

    rep = Replicate()
    pls = [rep, Shard(2), Shard(2), Shard(1), rep]  # w1/w3 colwise on hidden, w2 rowwise on hidden
    dist_params = [distribute_tensor(p, mesh, [pl]).requires_grad_() for p, pl in zip(params, pls)]
    with CommDebugMode() as comm:
        out = ffn(*dist_params)
    assert comm.get_total_counts() == 0, comm.get_comm_counts()
    assert out.placements[0].is_partial(), out.placements  # combined before the reduction
    doutd = distribute_tensor(dout, mesh, [rep])
    with CommDebugMode() as comm:
        grads = torch.autograd.grad(out, dist_params, doutd)
    # dx's partial sums (the colwise GEMMs) go back through the permute unreduced: no collective.
    assert comm.get_total_counts() == 0, comm.get_comm_counts()
    assert grads[0].placements[0].is_partial() and grads[4].placements[0].is_partial()
    assert grads[1].placements == (Shard(2),) and grads[3].placements == (Shard(1),)
    assert_gathered_close((out, out_ref.detach()), rtol=1e-5, atol=1e-5)
    for g, gr in zip(grads, g_ref):
        assert_gathered_close((g, gr), rtol=1e-5, atol=1e-5)

    # Tokens split on the hidden dim: permute and unpermute are local, placements kept.
    xd = distribute_tensor(x, mesh, [Shard(1)]).requires_grad_()
    sd = distribute_tensor(scores, mesh, [rep]).requires_grad_()
    doutd = distribute_tensor(dout, mesh, [Shard(1)])
    with CommDebugMode() as comm:
        xp, routing = tk.moe_permute(xd, idx, e, 4)
        y = tk.moe_unpermute(xp * 2, routing, sd)
        dxd, dsd = torch.autograd.grad(y, (xd, sd), doutd)
    assert comm.get_total_counts() == 0, comm.get_comm_counts()
    assert xp.placements == (Shard(1),) and y.placements == (Shard(1),) and dxd.placements == (Shard(1),)
    xx, ss = x.clone().requires_grad_(), scores.clone().requires_grad_()
    xp0, r0 = tk.moe_permute(xx, idx, e, 4)
    y0 = tk.moe_unpermute(xp0 * 2, r0, ss)
    dx0, ds0 = torch.autograd.grad(y0, (xx, ss), dout)
    assert_gathered_close((y, y0.detach()), (dxd, dx0), rtol=1e-6, atol=1e-6)
    assert_gathered_close((dsd, ds0), rtol=1e-5, atol=1e-6)


def test_dtensor_grouped_mm_tensor_parallel():
    run_distributed(_check_tp, 2)


def test_dtensor_fp8_grouped_mm_tensor_parallel():
    run_distributed(_check_fp8_tp, 2)


def test_dtensor_moe_ffn_tensor_parallel():
    run_distributed(_check_moe_ffn, 2)
