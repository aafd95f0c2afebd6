"""rms_norm / add_rms_norm on DTensor: 2 and 4 gloo CPU ranks.

Checks: results equal the unsharded computation; CommDebugMode counts no collective inside the ops
when inputs are sharded on a batch or sequence dim; the weight gradient comes out Partial; a 2-D
mesh (dp x tp) and a frozen weight work; a sharded hidden dim is redistributed, never wrong.
"""
from __future__ import annotations

import pytest
import torch

from tests.distributed.launcher import run_distributed


def _check_1d(rank: int, world: int) -> None:
    import titan_kernels as tk
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)  # same full tensors on every rank
    x = torch.randn(4, 6, 40, dtype=torch.float64).float()
    r = torch.randn(4, 6, 40)
    w = torch.randn(40)
    g = torch.randn(4, 6, 40)

    for be in ("reference", "triton"):
        with tk.use_backend(be):
            xr = x.clone().requires_grad_()
            wr = w.clone().requires_grad_()
            y_ref = tk.rms_norm(xr, wr)
            dx_ref, dw_ref = torch.autograd.grad(y_ref, (xr, wr), g)
            for dim in (0, 1):  # batch, sequence
                xd = distribute_tensor(x, mesh, [Shard(dim)]).requires_grad_()
                wd = distribute_tensor(w, mesh, [Replicate()]).requires_grad_()
                gd = distribute_tensor(g, mesh, [Shard(dim)])
                with CommDebugMode() as comm:
                    y = tk.rms_norm(xd, wd)
                    dx, dw = torch.autograd.grad(y, (xd, wd), gd)
                assert comm.get_total_counts() == 0, comm.get_comm_counts()
                assert y.placements == (Shard(dim),)
                assert dx.placements == (Shard(dim),)
                assert dw.placements == (Partial(),), dw.placements
                torch.testing.assert_close(y.full_tensor(), y_ref, rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(dx.full_tensor(), dx_ref, rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(dw.full_tensor(), dw_ref, rtol=1e-5, atol=1e-5)

                # add_rms_norm: same rules, the residual sum comes out sharded like x.
                rd = distribute_tensor(r, mesh, [Shard(dim)])
                with CommDebugMode() as comm:
                    yd, hd = tk.add_rms_norm(xd.detach(), rd, wd.detach())
                assert comm.get_total_counts() == 0
                y2, h2 = tk.add_rms_norm(x, r, w)
                torch.testing.assert_close(yd.full_tensor(), y2, rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(hd.full_tensor(), h2)

            # Hidden dim sharded: DTensor must redistribute (a collective), and the answer is right.
            xh = distribute_tensor(x, mesh, [Shard(2)])
            wd = distribute_tensor(w, mesh, [Replicate()])
            with CommDebugMode() as comm:
                yh = tk.rms_norm(xh, wd)
            assert comm.get_total_counts() > 0
            torch.testing.assert_close(yh.full_tensor(), y_ref.detach(), rtol=1e-5, atol=1e-6)


def _check_2d(rank: int, world: int) -> None:
    import titan_kernels as tk
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    x = torch.randn(4, 6, 24)
    w = torch.randn(24)
    g = torch.randn(4, 6, 24)
    xr = x.clone().requires_grad_()
    wr = w.clone().requires_grad_()
    dx_ref, dw_ref = torch.autograd.grad(tk.rms_norm(xr, wr), (xr, wr), g)

    # dp shards the batch, tp shards the sequence (sequence parallel).
    xd = distribute_tensor(x, mesh, [Shard(0), Shard(1)]).requires_grad_()
    gd = distribute_tensor(g, mesh, [Shard(0), Shard(1)])
    for frozen in (False, True):
        wd = distribute_tensor(w, mesh, [Replicate(), Replicate()]).requires_grad_(not frozen)
        with CommDebugMode() as comm:
            y = tk.rms_norm(xd, wd)
            grads = torch.autograd.grad(y, (xd,) if frozen else (xd, wd), gd)
        assert comm.get_total_counts() == 0
        torch.testing.assert_close(grads[0].full_tensor(), dx_ref, rtol=1e-5, atol=1e-6)
        if not frozen:
            torch.testing.assert_close(grads[1].full_tensor(), dw_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # ~11 s (2 ranks); by default the 2-D mesh test below runs the same rules on each mesh dim
def test_dtensor_rms_norm_1d_mesh():
    run_distributed(_check_1d, 2)


def test_dtensor_rms_norm_2d_mesh_and_frozen_weight():
    run_distributed(_check_2d, 4)
