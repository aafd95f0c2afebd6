"""A toy op through the scaffold (titan_kernels/ops/_scaffold.py) gets the whole op contract."""
import torch
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

from titan_kernels import backend
from titan_kernels.ops._scaffold import Op
from tests.distributed.launcher import run_distributed

toy = Op("toy_scale")  # y = alpha * x: reference in float64, "cpu" aten's mul
toy.register("reference", (lambda x, a: x.double().mul(a).to(x.dtype), lambda dy, a: dy.double().mul(a).to(dy.dtype)))
toy.register("cpu", (torch.mul, torch.mul))


def forward(x: torch.Tensor, alpha: float, backend: str | None = None) -> torch.Tensor:
    return toy.kernels(x.device, backend).forward(x, alpha)


def backward(dy: torch.Tensor, alpha: float, backend: str | None = None) -> torch.Tensor:
    return toy.kernels(dy.device, backend).backward(dy, alpha)


grads = lambda ctx, dy: (toy.backward(dy, ctx.alpha, ctx.backend), None)  # noqa (double backward: the same map)
save = lambda ctx, inputs, output: setattr(ctx, "alpha", inputs[1])  # noqa
rule = lambda x, *rest: [([p], [p, None, None]) for p in (Replicate(), Partial(), *map(Shard, range(x.ndim)))]  # noqa
toy.define(forward, lambda x, *rest: torch.empty_like(x), setup=save, grads=grads, backward=backward,
           backward_fake=lambda dy, *rest: torch.empty_like(dy), backward_setup=save, backward_grads=grads,
           sharding=rule, backward_sharding=rule)  # elementwise and linear: every placement stays local


def test_the_contract():
    x = torch.randn(3, 5, dtype=torch.float64)[:, ::2].requires_grad_()  # non-contiguous
    torch.library.opcheck(toy.op, (x, 1.5, None)), torch.library.opcheck(toy.backward_op, (x, 1.5, "reference"))
    plus_one = (lambda x, a: x * a + 1, lambda dy, a: dy * a + 1)  # the eager fast path chooses through the registry
    with backend.replace_impl("toy_scale", "cpu", plus_one):
        assert torch.equal(toy(x, 2.0), x * 2 + 1) and toy(x.detach(), 2.0).grad_fn is None
        with backend.use_backend("reference"):
            y = toy(x, 2.0)
        (dx,) = torch.autograd.grad(y, x, dy := torch.ones_like(y, requires_grad=True), create_graph=True)
        (ddy,) = torch.autograd.grad(dx.sum(), dy)  # double backward, through titan::toy_scale_backward
    assert torch.equal(y, x * 2) and torch.equal(dx, torch.full_like(x, 2.0)) and torch.equal(ddy, dx)  # reference
    compiled = torch.compile(lambda x: toy(x, 0.5), fullgraph=True, backend="aot_eager")
    assert torch.equal(torch.autograd.grad(compiled(x).sum(), x)[0], torch.full_like(x, 0.5))


def _dtensor(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    x, dy = (distribute_tensor(t, mesh, [Shard(0)]) for t in (torch.arange(12.0).view(4, 3), torch.ones(4, 3)))
    with CommDebugMode() as comm:
        y = toy(x.requires_grad_(), 2.0)
        (dx,) = torch.autograd.grad(y, x, dy)
    assert comm.get_total_counts() == 0 and y.placements == dx.placements == (Shard(0),)
    assert torch.equal(y.full_tensor(), 2 * torch.arange(12.0).view(4, 3)) and dx.full_tensor().eq(2).all()


def test_dtensor_rule():
    run_distributed(_dtensor, 2)
