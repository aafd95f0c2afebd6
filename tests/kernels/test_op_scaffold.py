"""A toy op through the scaffold (titan_kernels/ops/_scaffold.py) gets the whole op contract."""
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from titan_kernels import backend
from titan_kernels.ops._scaffold import Op
from tests.distributed.launcher import run_distributed

toy = Op("toy_scale")  # y = alpha * x
toy.register("reference", (lambda x, a: x.double().mul(a).to(x.dtype), lambda dy, a: dy.double().mul(a).to(dy.dtype)))
toy.register("cpu", (torch.mul, torch.mul))


def forward(x: torch.Tensor, alpha: float, backend: str | None = None) -> torch.Tensor:
    return toy.kernels(x.device, backend).forward(x, alpha)


def backward(dy: torch.Tensor, alpha: float, backend: str | None = None) -> torch.Tensor:
    return toy.kernels(dy.device, backend).backward(dy, alpha)


def rule(x, alpha, backend=None):  # elementwise: any placement stays local
    return [([p], [p, None, None]) for p in [Replicate(), Partial(), *map(Shard, range(x.ndim))]]


toy.define(forward, lambda x, alpha, backend=None: torch.empty_like(x), grads=lambda ctx, dy: (toy.backward(dy, ctx.alpha, ctx.backend), None),
           setup=lambda ctx, inputs, out: setattr(ctx, "alpha", inputs[1]), backward=backward,
           backward_fake=lambda dy, alpha, backend=None: torch.empty_like(dy), sharding=rule, backward_sharding=rule,
           backward_setup=lambda ctx, inputs, out: setattr(ctx, "alpha", inputs[1]),
           backward_grads=lambda ctx, ddx: (toy.backward(ddx, ctx.alpha, ctx.backend), None))


def test_the_contract():
    x = torch.randn(3, 5, dtype=torch.float64)[:, ::2].requires_grad_()  # non-contiguous
    torch.library.opcheck(toy.op, (x, 1.5, None))
    with backend.replace_impl("toy_scale", "cpu", (lambda x, a: x * a + 1, torch.mul)):  # the eager path chooses
        assert torch.equal(toy(x, 2.0), x * 2 + 1) and torch.equal(toy.call(x, 2.0, "reference"), x * 2)
    (dx,) = torch.autograd.grad(toy(x, 3.0).sum(), x, create_graph=True)  # eager fast path
    assert torch.equal(dx, torch.full_like(x, 3.0)) and toy(x.detach(), 3.0).grad_fn is None
    compiled = torch.compile(lambda x: toy(x, 0.5), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(torch.autograd.grad(compiled(x).sum(), x)[0], torch.full_like(x, 0.5))
    with backend.use_backend("reference"):
        assert backend.resolve("toy_scale", "cpu") == "reference"
        y = toy(x.float(), 2.0)
    torch.testing.assert_close(y, x.float() * 2)


def _dtensor(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh("cpu", (world,))
    x, dy = (distribute_tensor(t, mesh, [Shard(0)]) for t in (torch.arange(12.0).view(4, 3), torch.ones(4, 3)))
    with CommDebugMode() as comm:
        y = toy(x.requires_grad_(), 2.0)
        (dx,) = torch.autograd.grad(y, x, dy)
    assert comm.get_total_counts() == 0, comm.get_comm_counts()
    assert y.placements == (Shard(0),) and dx.placements == (Shard(0),), (y.placements, dx.placements)
    assert torch.equal(y.full_tensor(), torch.arange(12.0).view(4, 3) * 2)


def test_dtensor_rule():
    run_distributed(_dtensor, 2)
