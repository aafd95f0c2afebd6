"""swiglu on DTensor: 2 and 4 gloo CPU ranks.

Checks: results and gradients equal the unsharded computation; CommDebugMode counts no collective
inside the op or its backward when gate and up are split the same way on any dim (batch, sequence,
or the hidden dim as tensor parallel gives it), and the outputs keep that placement; mismatched and
Partial inputs are redistributed, never wrong; double backward works on DTensors; a 2-D mesh
(dp x tp) runs locally. The same for GPT-OSS's clamped variant (alpha, limit, up_offset), including
gate and up as the interleaved columns of one sharded gate_up tensor.
"""
from __future__ import annotations

import pytest
import torch

from tests.distributed.dtensor_checks import assert_gathered_close
from tests.distributed.launcher import run_distributed


def _backends():
    from titan_kernels import backend

    return [b for b in ("reference", "triton", "cpu") if backend.backend_status(b, "cpu").available]


GPT_OSS = {"alpha": 1.702, "limit": 7.0, "up_offset": 1.0}


def _unsharded(gate, up, dy, **scalars):
    import titan_kernels as tk

    g = gate.clone().requires_grad_()
    u = up.clone().requires_grad_()
    y = tk.swiglu(g, u, **scalars)
    dg, du = torch.autograd.grad(y, (g, u), dy)
    return y.detach(), dg, du


def _check_1d(rank: int, world: int) -> None:
    import titan_kernels as tk
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)  # same full tensors on every rank
    gate = torch.randn(4, 6, 34) * 2
    up = torch.randn(4, 6, 34)
    dy = torch.randn(4, 6, 34)
    gate_up = torch.randn(4, 6, 68) * 6  # GPT-OSS's interleaved gate/up, a third beyond +-7

    assert _backends(), "no backend runs on the CPU"
    for be in _backends():
        with tk.use_backend(be):
            y_ref, dg_ref, du_ref = _unsharded(gate, up, dy)
            for placement in (Shard(0), Shard(1), Shard(2), Replicate()):  # batch, sequence, hidden
                gd = distribute_tensor(gate, mesh, [placement]).requires_grad_()
                ud = distribute_tensor(up, mesh, [placement]).requires_grad_()
                dyd = distribute_tensor(dy, mesh, [placement])
                with CommDebugMode() as comm:
                    y = tk.swiglu(gd, ud)
                    dg, du = torch.autograd.grad(y, (gd, ud), dyd)
                assert comm.get_total_counts() == 0, (be, placement, comm.get_comm_counts())
                assert y.placements == (placement,) and dg.placements == (placement,), (be, placement)
                assert du.placements == (placement,)
                assert_gathered_close((y, y_ref), (dg, dg_ref), (du, du_ref), rtol=1e-6, atol=1e-6)

            # Different splits: DTensor redistributes one input (a collective), the answer is right.
            gd = distribute_tensor(gate, mesh, [Shard(0)])
            ud = distribute_tensor(up, mesh, [Shard(2)])
            with CommDebugMode() as comm:
                y = tk.swiglu(gd, ud)
            assert comm.get_total_counts() > 0
            assert_gathered_close((y, y_ref), rtol=1e-6, atol=1e-6)

            # A Partial gate (a pending sum) is reduced first: silu is not linear.
            gp = DTensor.from_local(gate / world, mesh, [Partial()])  # the ranks' shares sum to gate
            with CommDebugMode() as comm:
                y = tk.swiglu(gp, distribute_tensor(up, mesh, [Replicate()]))
            assert comm.get_total_counts() > 0
            assert_gathered_close((y, y_ref), rtol=1e-5, atol=1e-6)

            # The clamped variant, gate and up split alike on batch, sequence or hidden (TP): local.
            g_var, u_var = gate * 4, up * 8  # a good share beyond +-7
            y_ref, dg_ref, du_ref = _unsharded(g_var, u_var, dy, **GPT_OSS)
            for placement in (Shard(0), Shard(1), Shard(2)):
                gd = distribute_tensor(g_var, mesh, [placement]).requires_grad_()
                ud = distribute_tensor(u_var, mesh, [placement]).requires_grad_()
                dyd = distribute_tensor(dy, mesh, [placement])
                with CommDebugMode() as comm:
                    y = tk.swiglu(gd, ud, **GPT_OSS)
                    dg, du = torch.autograd.grad(y, (gd, ud), dyd)
                assert comm.get_total_counts() == 0, (be, placement, comm.get_comm_counts())
                assert y.placements == (placement,) and dg.placements == (placement,), (be, placement)
                for a, b in ((y, y_ref), (dg, dg_ref), (du, du_ref)):
                    assert_gathered_close((a, b), rtol=1e-6, atol=1e-6)

            # GPT-OSS's interleaved gate_up split on tokens: its strided column views run locally. (Split
            # on the hidden dim, DTensor gathers a strided slice first: its slice rule, not the op's.)
            gu = distribute_tensor(gate_up, mesh, [Shard(0)]).requires_grad_()
            dyd = distribute_tensor(dy, mesh, [Shard(0)])
            with CommDebugMode() as comm:
                y = tk.swiglu(gu[..., ::2], gu[..., 1::2], **GPT_OSS)
                (dgu,) = torch.autograd.grad(y, gu, dyd)
            assert comm.get_total_counts() == 0, (be, comm.get_comm_counts())
            assert y.placements == (Shard(0),) and dgu.placements == (Shard(0),), be
            full = gate_up.clone().requires_grad_()
            y_var = tk.swiglu(full[..., ::2], full[..., 1::2], **GPT_OSS)
            (dgu_var,) = torch.autograd.grad(y_var, full, dy)
            assert_gathered_close((y, y_var), (dgu, dgu_var), rtol=1e-6, atol=1e-6)

    # Double backward on DTensors (the second derivatives are aten ops): equals the unsharded one,
    # plain and clamped.
    vg, vu = torch.randn(4, 6, 34), torch.randn(4, 6, 34)
    sh = [Shard(1)]
    for scalars in ({}, GPT_OSS):
        def hvp(g, u, d, vg, vu):
            dg, du = torch.autograd.grad(tk.swiglu(g, u, **scalars), (g, u), d, create_graph=True)
            return torch.autograd.grad((dg * vg).sum() + (du * vu).sum(), (g, u))

        g_in, u_in = (gate * 4, up * 8) if scalars else (gate, up)  # values beyond +-7 for the variant
        want = hvp(g_in.clone().requires_grad_(), u_in.clone().requires_grad_(), dy, vg, vu)
        gd, ud = (distribute_tensor(t, mesh, sh).requires_grad_() for t in (g_in, u_in))
        got = hvp(gd, ud, *(distribute_tensor(t, mesh, sh) for t in (dy, vg, vu)))
        for a, b in zip(got, want):
            assert_gathered_close((a, b), rtol=1e-5, atol=1e-6)


def _check_2d(rank: int, world: int) -> None:
    import titan_kernels as tk
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    gate, up, dy = torch.randn(4, 5, 24), torch.randn(4, 5, 24), torch.randn(4, 5, 24)
    y_ref, dg_ref, du_ref = _unsharded(gate, up, dy)
    # dp splits the batch, tp the hidden dim (the outputs of colwise w1 / w3).
    pl = [Shard(0), Shard(2)]
    gd = distribute_tensor(gate, mesh, pl).requires_grad_()
    ud = distribute_tensor(up, mesh, pl).requires_grad_()
    dyd = distribute_tensor(dy, mesh, pl)
    with CommDebugMode() as comm:
        y = tk.swiglu(gd, ud)
        dg, du = torch.autograd.grad(y, (gd, ud), dyd)
    assert comm.get_total_counts() == 0, comm.get_comm_counts()
    assert y.placements == tuple(pl) and dg.placements == tuple(pl)
    assert_gathered_close((y, y_ref), (dg, dg_ref), (du, du_ref), rtol=1e-6, atol=1e-6)


def test_dtensor_swiglu_1d_mesh():
    run_distributed(_check_1d, 2)


@pytest.mark.slow  # 4 ranks, ~13 s on 2 cores; by default the 1-D mesh above and rms_norm's 2-D mesh
# (test_dtensor_rms_norm.py) cover the sharding rules and their expansion over a 2-D mesh
def test_dtensor_swiglu_2d_mesh():
    run_distributed(_check_2d, 4)
