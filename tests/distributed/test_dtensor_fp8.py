"""fp8_linear and Float8Linear on DTensor: 2 gloo CPU ranks.

Checks, for every recipe: tokens split on batch or sequence, colwise (weight split on out
features) and rowwise (input and weight split on in features) run with no collective inside the
op, forward and backward, with the expected output and gradient placements, and match the
unsharded result to fp8 accuracy (each shard is scaled on its own); a layout with no rule is
redistributed, never wrong; fp8_quantize refuses DTensor; Float8Linear under ColwiseParallel /
RowwiseParallel matches the unsharded model.
"""
from __future__ import annotations

from tests.distributed.launcher import run_distributed

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _check_ops(rank: int, world: int) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    import titan_kernels as tk

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)  # the same full tensors on every rank
    x = torch.randn(4, 6, 32)
    w = torch.randn(24, 32)
    g = torch.randn(4, 6, 24)
    x64, w64, g64 = x.double(), w.double(), g.double()
    y64, dx64, dw64 = x64 @ w64.t(), g64 @ w64, g64.reshape(-1, 24).t() @ x64.reshape(-1, 32)
    R = Replicate()
    #        name       x         w         dy (=g)   -> y          dx          dW
    cases = [("batch", Shard(0), R, Shard(0), Shard(0), Shard(0), Partial()),
             ("seq", Shard(1), R, Shard(1), Shard(1), Shard(1), Partial()),
             ("colwise", R, Shard(0), Shard(2), Shard(2), Partial(), Shard(0)),
             ("rowwise", Shard(2), Shard(1), R, Partial(), Shard(2), Shard(1))]
    for be in ("reference", "triton"):
        for recipe in RECIPES:
            tol_g = 1.2e-1 if recipe == "tensorwise" else 7e-2
            with tk.use_backend(be):
                for name, px, pw, pg, py, pdx, pdw in cases:
                    xd = distribute_tensor(x, mesh, [px]).requires_grad_()
                    wd = distribute_tensor(w, mesh, [pw]).requires_grad_()
                    gd = distribute_tensor(g, mesh, [pg])
                    with CommDebugMode() as comm:
                        y = tk.fp8_linear(xd, wd, recipe)
                        dx, dw = torch.autograd.grad(y, (xd, wd), gd)
                    where = (be, recipe, name)
                    assert comm.get_total_counts() == 0, (where, comm.get_comm_counts())
                    assert (y.placements, dx.placements, dw.placements) == ((py,), (pdx,), (pdw,)), where
                    assert _rel(y.full_tensor(), y64) < 7e-2, where
                    assert _rel(dx.full_tensor(), dx64) < tol_g, where
                    assert _rel(dw.full_tensor(), dw64) < (1e-5 if recipe == "rowwise_with_gw_hp" else tol_g), where
                    # Frozen weight: only dx, same placement (the dW placeholder is empty).
                    y = tk.fp8_linear(xd, wd.detach(), recipe)
                    (dx2,) = torch.autograd.grad(y, (xd,), gd)
                    torch.testing.assert_close(dx2.full_tensor(), dx.full_tensor())

    # The colwise layout of the rowwise recipe scales along K, which stays whole: bit-equal.
    xd = distribute_tensor(x, mesh, [R])
    wd = distribute_tensor(w, mesh, [Shard(0)])
    assert torch.equal(tk.fp8_linear(xd, wd, "rowwise").full_tensor(), tk.fp8_linear(x, w, "rowwise"))

    # x split on K with w split on N has no rule: DTensor moves data first, and the answer is right.
    xd = distribute_tensor(x, mesh, [Shard(2)])
    wd = distribute_tensor(w, mesh, [Shard(0)])
    with CommDebugMode() as comm:
        y = tk.fp8_linear(xd, wd, "rowwise")
    assert comm.get_total_counts() > 0
    assert _rel(y.full_tensor(), y64) < 7e-2

    # No rule for the quantize op (a tensorwise amax needs a collective): a clear refusal.
    try:
        tk.fp8_quantize(distribute_tensor(x, mesh, [Shard(0)]))
    except (NotImplementedError, RuntimeError) as e:
        assert "fp8_quantize" in str(e), e
    else:
        raise AssertionError("fp8_quantize on a DTensor should be refused")


def _check_tp_module(rank: int, world: int) -> None:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from titan_kernels.nn import Float8Linear, convert_to_float8

    mesh = init_device_mesh("cpu", (world,))
    # The FSDP2 float8 all-gather is for plain (FSDP-only) weights: a TP DTensor weight is refused.
    tp_lin = parallelize_module(nn.Linear(32, 64), mesh, ColwiseParallel())
    try:
        Float8Linear.from_float(tp_lin, enable_fsdp_float8_all_gather=True)
    except ValueError as e:
        assert "already a DTensor" in str(e), e
    else:
        raise AssertionError("enable_fsdp_float8_all_gather on a DTensor weight should be refused")
    for recipe in RECIPES:
        torch.manual_seed(0)
        full = nn.Sequential(nn.Linear(32, 64), nn.SiLU(), nn.Linear(64, 16))
        tp = nn.Sequential(nn.Linear(32, 64), nn.SiLU(), nn.Linear(64, 16))
        tp.load_state_dict(full.state_dict())
        convert_to_float8(full, recipe)
        convert_to_float8(tp, recipe)
        parallelize_module(tp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        x = torch.randn(5, 7, 32)
        y_full = full(x)
        y_tp = tp(x)
        y_full.square().sum().backward()
        y_tp.square().sum().backward()
        assert _rel(y_tp, y_full) < 5e-2, recipe
        for (name, p), q in zip(tp.named_parameters(), full.parameters()):
            tol = 1.5e-1 if recipe == "tensorwise" else 1e-1
            assert _rel(p.grad.full_tensor(), q.grad) < tol, (recipe, name)


def test_fp8_linear_dtensor_rules():
    run_distributed(_check_ops, 2)


def test_float8_linear_tensor_parallel():
    run_distributed(_check_tp_module, 2)
