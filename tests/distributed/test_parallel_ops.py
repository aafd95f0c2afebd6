"""The pieces under the layouts, on gloo ranks, against float64:

* ring attention (context parallel) over 2 and 3 ranks: output and q/k/v gradients of the zigzag
  shards equal causal attention on the whole sequence in float64 (GQA, odd head_dim, fp32 to 1e-5,
  bf16 to 1e-2);
* the tensor + sequence parallel plan of a block communicates exactly 2 all-gathers and 2
  reduce-scatters of the activation in the forward (``CommDebugMode``): the norms run on the local
  rows through our rms_norm / add_rms_norm DTensor rules, with no redistribution around them; a
  whole step issues the collectives ``trainer.estimate.comm.communication_per_step`` plans;
* TP with Float8Linear layers (the fp8_linear DTensor rules): logits and weight gradients as close
  to the float32 model as the unsharded float8 model is (within 10%; logits within the fp8 e4m3
  tolerance 7e-2). The titan ops take no float64; float32's error is orders below fp8's.
About 15 s (two process launches).
"""
import collections
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.distributed.launcher import run_distributed

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def _attention64(q, k, v):
    """Causal GQA attention in float64 (the reference)."""
    h, hkv, s, d = q.shape[2], k.shape[2], q.shape[1], q.shape[3]
    k, v = k.repeat_interleave(h // hkv, 2), v.repeat_interleave(h // hkv, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


def _check_ring_attention(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from trainer.parallel.context_parallel import ContextParallel

    cp = ContextParallel(init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"])
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        g = torch.Generator().manual_seed(7)
        b, s, h, hkv, d = 2, 12 * world, 6, 2, 24
        q, k, v, dout = (torch.randn(b, s, n, d, generator=g, dtype=torch.float64) for n in (h, hkv, hkv, h))
        q64, k64, v64 = (t.clone().requires_grad_() for t in (q, k, v))
        ref = _attention64(q64, k64, v64)
        ref.backward(dout)
        ql, kl, vl = (cp.shard(t).to(dtype).requires_grad_() for t in (q, k, v))
        out = cp(ql, kl, vl)
        assert out.dtype == dtype and out.shape == ql.shape
        out.backward(cp.shard(dout).to(dtype))
        for got, want, name in ((out, ref, "out"), (ql.grad, q64.grad, "dq"), (kl.grad, k64.grad, "dk"),
                                (vl.grad, v64.grad, "dv")):
            err = _rel(got.detach(), cp.shard(want.detach()))
            assert err <= tol, (rank, str(dtype), name, err)


@pytest.mark.parametrize("world", [2, 3])
def test_ring_attention_equals_float64_attention(world):
    run_distributed(_check_ring_attention, world)


class _CountCollectives(TorchDispatchMode):
    """Counts the functional collectives DTensor issues (by op name)."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and name not in ("wait_tensor", "_wrap_tensor_autograd"):
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))


def _check_tp_block_and_float8(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from titan_kernels.nn import convert_to_float8
    from trainer.registry import build_model
    from tests.trainer.helpers import llama_model_args as model_args
    from trainer.parallel.tensor_parallel import apply_tp, loss_parallel_context

    tp = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))["tp"]
    args = model_args("debugmodel", 258, 32).replace(n_layers=2)
    tokens = torch.randint(0, 258, (2, 32), generator=torch.Generator().manual_seed(3))

    # One block's forward: all-gather before attention and before the FFN, reduce-scatter after each.
    model = build_model(args, "meta")
    apply_tp(model, tp)
    model.to_empty(device="cpu")
    model.init_weights(0)
    x = torch.randn(2, 32 // world, args.dim)  # this rank's sequence shard
    with CommDebugMode() as comm:
        model.layers["0"](x, model.rope)
    counts = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
    assert counts == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}, counts

    # A whole training step: the calls trainer.estimate.comm.communication_per_step plans (README formulas).
    from trainer.estimate.memory import Layout
    from trainer.estimate.comm import communication_per_step
    from trainer.models.common.losses import cross_entropy_loss
    from trainer.parallel.parallelize import reduce_partial_grads

    labels = torch.randint(0, 258, (2, 32), generator=torch.Generator().manual_seed(4))
    with _CountCollectives() as counted:
        with loss_parallel_context(True):
            cross_entropy_loss(model(tokens), labels).backward()
        reduce_partial_grads([p for n, p in model.named_parameters() if n.endswith("norm.weight")])
    planned = {(c.op, c.what): c.count for c in communication_per_step(args, Layout(tp=world), 2, 32)}
    assert counted.calls["all_gather_into_tensor"] == planned[("all-gather", "activations")] == 4 * args.n_layers + 2
    assert counted.calls["reduce_scatter_tensor"] == planned[("reduce-scatter", "activations")]
    assert counted.calls["all_reduce"] == planned[("all-reduce", "norm weight gradients")] == 2 * args.n_layers + 1

    # Float8Linear under TP: fp8_linear's DTensor rules run colwise/rowwise shards locally.
    ref = build_model(args, "cpu")  # float32: the titan ops take no float64; its error is far below fp8's
    ref.init_weights(0)
    logits_ref = ref(tokens)
    logits_ref.square().mean().backward()
    f8 = build_model(args, "meta")
    convert_to_float8(f8, "tensorwise", lambda m, fqn: "output" not in fqn)
    apply_tp(f8, tp, loss_parallel=False)
    f8.to_empty(device="cpu")
    f8.init_weights(0)
    with loss_parallel_context(False):
        logits = f8(tokens)
        logits.square().mean().backward()
    # The same float8 model unsharded: TP must add no error of its own beyond fp8's (the shards get
    # their own scales, so the two differ at fp8 accuracy, not bitwise).
    one = build_model(args, "cpu")
    convert_to_float8(one, "tensorwise", lambda m, fqn: "output" not in fqn)
    one.init_weights(0)
    logits_one = one(tokens)
    logits_one.square().mean().backward()
    w_tp = f8.layers["1"].feed_forward.w2.weight.grad.full_tensor()
    w_one, w_ref = one.layers["1"].feed_forward.w2.weight.grad, ref.layers["1"].feed_forward.w2.weight.grad
    err_one, err_tp = _rel(logits_one.detach(), logits_ref.detach()), _rel(logits.detach(), logits_ref.detach())
    assert 1e-3 < err_one <= 7e-2 and err_tp <= 1.1 * err_one, (err_tp, err_one)  # float8 really ran
    assert _rel(w_tp, w_ref) <= 1.1 * _rel(w_one, w_ref), (_rel(w_tp, w_ref), _rel(w_one, w_ref))


def test_tp_block_communication_and_float8_linear():
    run_distributed(_check_tp_block_and_float8, 2)
