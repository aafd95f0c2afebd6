"""Ring attention (context parallel, zigzag) with the attention variants the model families use.

* On 2 gloo ranks, equal to attention on the whole sequence in float64, forward and gradients
  (q, k, v, sinks): v's head_dim different from q/k's (multi-head latent attention); a sliding
  window shorter than the zigzag chunk with sinks and soft-capping; chunked attention. The plain
  causal case over 2 and 3 ranks is in test_parallel_ops.py.
* The schedule, without processes: the calls of every rank on every block see exactly the (query,
  key) pairs of the global mask, and a block no pair sees is neither computed on nor sent.
About 10 s (one process launch).
"""
from __future__ import annotations

import itertools

import pytest
import torch

from tests.distributed.launcher import run_distributed
from tests.kernels.attention_ref import doc_mask
from titan_kernels.attention_mask import AttentionArgs
from trainer.parallel.context_parallel import _calls

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# (head_dim, head_dim_v, flash_attn keywords)
VARIANTS = [
    (24, 16, {}),
    (16, 16, dict(window_size=(5, 0), softcap=3.0, sinks=True)),
    (16, 8, dict(chunk_size=16)),
]


def _check(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from tests.kernels.attention_ref import dense64, rel
    from trainer.parallel.context_parallel import ContextParallel

    cp = ContextParallel(init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"])
    for d, dv, kw in VARIANTS:
        g = torch.Generator().manual_seed(3)
        b, s, h, hkv = 1, 16 * world, 4, 2  # zigzag chunks of 8 tokens
        q, k = torch.randn(b, s, h, d, generator=g), torch.randn(b, s, hkv, d, generator=g)
        v, dout = torch.randn(b, s, hkv, dv, generator=g), torch.randn(b, s, h, dv, generator=g)
        sinks = torch.randn(h, generator=g) if kw.get("sinks") else None
        opts = {key: val for key, val in kw.items() if key != "sinks"}
        inputs = (q, k, v) + ((sinks,) if sinks is not None else ())
        x64 = [t.double().requires_grad_() for t in inputs]
        ref = dense64(*x64[:3], True, d ** -0.5, window=opts.get("window_size", (-1, -1)),
                      chunk=opts.get("chunk_size"), sinks=x64[3] if sinks is not None else None,
                      softcap=opts.get("softcap", 0.0))[0]
        want = torch.autograd.grad(ref, x64, dout.double())
        local = [cp.shard(t).requires_grad_() for t in (q, k, v)] + ([sinks.clone().requires_grad_()] if sinks is not None else [])
        out = cp(*local[:3], sinks=local[3] if sinks is not None else None, **opts)
        assert out.shape == (b, s // world, h, dv)
        got = torch.autograd.grad(out, local, cp.shard(dout))
        where = (rank, kw)
        assert rel(out, cp.shard(ref.detach())) < 1e-5, where
        for i, (a, e) in enumerate(zip(got, want)):
            # q, k, v gradients are this rank's shard; the sinks' gradient is this rank's partial sum.
            e = cp.shard(e) if i < 3 else e
            if i == 3:
                torch.distributed.all_reduce(a)
            assert rel(a, e) < 1e-5, (where, i, rel(a, e))


def test_ring_attention_variants_equal_one_process():
    run_distributed(_check, 2)


def _mask(nq: int, nk: int, a: AttentionArgs) -> torch.Tensor:
    """(nq, nk) bool of a call on nq queries and nk keys with mask ``a`` (positions bottom-right)."""
    return doc_mask([nq], [nk], False, (a.left, a.right), a.chunk or None)


@pytest.mark.parametrize("n,c", [(2, 4), (3, 4), (4, 3)])
def test_schedule_sees_exactly_the_mask(n, c):
    masks = [((-1, 0), 0), ((2, 0), 0), ((5, 0), 0), ((0, 0), 0), ((3, 2), 0), ((-1, -1), 0), ((-1, 0), c),
             ((-1, 0), 2 * c), ((2, 0), c), ((-1, -1), 2 * c)]
    if c % 2 == 0:
        masks.append(((-1, 0), c // 2))
    for (left, right), chunk in masks:
        a = AttentionArgs(0.1, left, right, 0.0, chunk)
        full = _mask(2 * n * c, 2 * n * c, a)
        for r, j in itertools.product(range(n), range(n)):
            # Local rows / keys of rank r / rank j as global positions (zigzag).
            pos = lambda x: torch.cat([torch.arange(x * c, (x + 1) * c), torch.arange((2 * n - 1 - x) * c, (2 * n - x) * c)])  # noqa: E731
            want = full[pos(r)][:, pos(j)]
            got = torch.zeros_like(want)
            for rows, keys, pa in _calls(r, j, n, c, a):
                assert not got[rows, keys].any(), "a (query, key) pair computed twice"
                got[rows, keys] = _mask(rows.stop - rows.start, keys.stop - keys.start, pa)
            assert torch.equal(got, want), (n, c, left, right, chunk, r, j)
            assert bool(_calls(r, j, n, c, a)) == bool(want.any())  # nothing seen: nothing computed or sent
