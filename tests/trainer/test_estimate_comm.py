"""The communication estimate (``trainer.estimate.comm``) against what the code sends.

Context parallel: the ring (``trainer.parallel.context_parallel``) runs forward and backward on every
rank of a 4-rank ring in one process, its point-to-point sends recorded instead of posted, under a
causal, a sliding-window and a chunked layer; the estimate's K/V bytes per rank equal the recorded
mean exactly. (The TP collectives of a whole step are counted against a real run in
tests/distributed/test_parallel_ops.py.)
"""
from __future__ import annotations

import pytest
import torch

from titan_kernels.attention_mask import AttentionArgs
from trainer.estimate.memory import Layout, model_costs
from trainer.estimate.comm import communication_per_step, cp_blocks_per_layer
from trainer.models.llama3.args import Llama3Args
from trainer.parallel.context_parallel import _RingAttention
from trainer.parallel.cp_schedule import blocks_sent

CP, CHUNK_TOKENS, BATCH = 4, 8, 2  # zigzag chunks of 8 tokens: a sequence of 2 * 4 * 8 = 64
SEQ = 2 * CP * CHUNK_TOKENS


class _RecordingRing:
    """Rank ``rank`` of a ring of ``size`` (what ``_RingAttention`` reads of a ``ContextParallel``):
    counts the bytes each point-to-point send would move and zero-fills the receive buffers, whose
    values do not matter to the count."""

    def __init__(self, size: int, rank: int) -> None:
        self.size, self.rank, self.sent = size, rank, 0

    def _p2p(self, sends: list, recvs: list) -> list:
        self.sent += sum(t.numel() * t.element_size() for t, _ in sends)
        for buf, _ in recvs:
            buf.zero_()
        return []


def _ring_bytes(args: Llama3Args, layer: int) -> tuple[float, float]:
    """(forward, forward + backward) bytes one rank sends for ``layer``, the mean over the ring's ranks."""
    (left, right), chunk = args.attention_window(layer)
    a = AttentionArgs(args.qk_head_dim ** -0.5, left, right, 0.0, chunk)
    forward = both = 0
    for rank in range(CP):
        ring = _RecordingRing(CP, rank)
        local = SEQ // CP
        q = torch.randn(BATCH, local, args.n_heads, args.qk_head_dim, requires_grad=True)
        k = torch.randn(BATCH, local, args.kv_heads, args.qk_head_dim, requires_grad=True)
        v = torch.randn(BATCH, local, args.kv_heads, args.v_head_dim, requires_grad=True)
        out = _RingAttention.apply(q, k, v, None, a, ring)
        forward += ring.sent
        out.sum().backward()
        both += ring.sent
    return forward / CP, both / CP


@pytest.fixture
def mixed_args() -> Llama3Args:
    # a window of 4 keys (within the neighbouring chunk), causal, attention chunks of two zigzag chunks
    return Llama3Args(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=SEQ,
                      layer_types=("sliding_attention", "full_attention", "chunked_attention", "sliding_attention"),
                      sliding_window=4, attention_chunk=2 * CHUNK_TOKENS)


def test_cp_bytes_equal_what_the_ring_sends(mixed_args):
    per_layer = [_ring_bytes(mixed_args, i) for i in range(mixed_args.n_layers)]
    for ac_mode, recompute in (("none", 0), ("full", 1)):
        rows = [c for c in communication_per_step(mixed_args, Layout(cp=CP), BATCH, SEQ, compute_bytes=4,
                                                  ac_mode=ac_mode) if c.dim == "cp"]
        want = sum(both + recompute * fwd for fwd, both in per_layer)
        got = sum(c.bytes for c in rows)
        assert got == pytest.approx(want, rel=1e-12), (ac_mode, got, want)
    # the mask matters: the causal layer sends every block to every other rank, the window and the
    # attention chunks less
    block = BATCH * SEQ // CP * mixed_args.kv_heads * (mixed_args.qk_head_dim + mixed_args.v_head_dim) * 4
    assert per_layer[1][0] == (CP - 1) * block
    assert 0 < per_layer[0][0] < per_layer[1][0] and 0 < per_layer[2][0] < per_layer[1][0]


def test_blocks_per_layer_follow_the_masks(mixed_args):
    costs = model_costs(mixed_args)
    assert blocks_sent(CP, CHUNK_TOKENS, -1, 0, 0) == [CP - 1] * CP  # causal: everything
    assert blocks_sent(CP, CHUNK_TOKENS, -1, -1, 0) == [CP - 1] * CP  # bidirectional
    assert blocks_sent(CP, CHUNK_TOKENS, 0, 0, 0) == [0] * CP  # a window of one key: the diagonal only
    # a window of 4: only the ranks holding the neighbouring chunks (zigzag: r - 1 and r + 1, and the
    # middle pair); never more than causal
    short = blocks_sent(CP, CHUNK_TOKENS, 3, 0, 0)
    assert 0 < sum(short) < CP * (CP - 1)
    mean = cp_blocks_per_layer(costs, SEQ, CP)
    assert mean == pytest.approx((2 * sum(short) / CP + (CP - 1) + sum(blocks_sent(CP, CHUNK_TOKENS, -1, 0, 16)) / CP) / 4)
    assert cp_blocks_per_layer(costs, SEQ, 1) == 0.0
    dense = model_costs(mixed_args.replace(layer_types=(), sliding_window=0, attention_chunk=0))
    assert cp_blocks_per_layer(dense, SEQ, CP) == CP - 1
