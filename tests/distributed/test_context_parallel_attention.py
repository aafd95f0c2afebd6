"""Ring attention (context parallel, zigzag) on 2 gloo ranks equals attention on the whole sequence
in float64, forward and gradients, for the attention variants the model families use: v's head_dim
different from q/k's (multi-head latent attention). The plain causal case over 2 and 3 ranks is in
test_parallel_ops.py. About 10 s (one process launch).
"""
from __future__ import annotations

import pytest

from tests.distributed.launcher import run_distributed

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _check(rank: int, world: int) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from tests.kernels.test_attention import dense64, rel
    from trainer.parallel.context_parallel import ContextParallel

    cp = ContextParallel(init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"])
    g = torch.Generator().manual_seed(3)
    b, s, h, hkv, d, dv = 1, 8 * world, 4, 2, 24, 16
    q, k = torch.randn(b, s, h, d, generator=g), torch.randn(b, s, hkv, d, generator=g)
    v, dout = torch.randn(b, s, hkv, dv, generator=g), torch.randn(b, s, h, dv, generator=g)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref = dense64(q64, k64, v64, True, d ** -0.5)[0]
    want = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    ql, kl, vl = (cp.shard(t).requires_grad_() for t in (q, k, v))
    out = cp(ql, kl, vl)
    assert out.shape == (b, s // world, h, dv)
    got = torch.autograd.grad(out, (ql, kl, vl), cp.shard(dout))
    assert rel(out, cp.shard(ref.detach())) < 1e-5, rank
    for name, a, e in zip("qkv", got, want):
        assert rel(a, cp.shard(e)) < 1e-5, (rank, "d" + name, rel(a, cp.shard(e)))


def test_ring_attention_variants_equal_one_process():
    run_distributed(_check, 2)
