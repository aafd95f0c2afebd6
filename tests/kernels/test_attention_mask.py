"""The attention mask's definition in one place (titan_kernels/attention_mask.py) and the query-block
plan the CPU backends run (titan_kernels/ops/attention/blocks.py), without kernels:

* ``unmasked_score_count`` (for FLOPs / MFU) equals a brute-force count over random masks;
* normalization: a window side that cuts nothing becomes unbounded;
* the plan covers every visible (query, key) pair exactly once, skips rows that see nothing, and
  its pieces' modes and masks are right; a group of pieces shares one mask;
* a window of w at seq s plans about s * (w + block) scores, not s^2 / 2.
"""
from __future__ import annotations

import random

import pytest
import torch

import titan_kernels as tk
from titan_kernels.attention_mask import AttentionArgs, check_chunk, check_window
from titan_kernels.ops.attention.blocks import groups, piece_visible, plan
from tests.kernels.attention_ref import doc_mask


def _visible(sq, sk, left, right, chunk) -> torch.Tensor:
    return doc_mask([sq], [sk], False, (left, right), chunk)


def _random_masks(n, seed=0):
    rng = random.Random(seed)
    for _ in range(n):
        causal = rng.random() < 0.5
        window = (rng.choice([-1, 0, 1, 3, 9, 40]), 0 if causal else rng.choice([-1, 0, 2, 30]))
        yield (rng.randint(0, 40), rng.randint(0, 40), causal, window, rng.choice([None, 1, 3, 8, 50]))


def test_unmasked_score_count_equals_brute_force():
    for sq, sk, causal, window, chunk in _random_masks(600):
        left, right = check_window(window, causal)
        want = int(_visible(sq, sk, left, right, check_chunk(chunk)).sum())
        got = tk.unmasked_score_count(sq, sk, causal=causal, window_size=window, chunk_size=chunk)
        assert got == want, (sq, sk, causal, window, chunk)
    # Large: a window of 128 over 32k counts s * w - w (w - 1) / 2, instantly.
    s, w = 32768, 128
    assert tk.unmasked_score_count(s, s, window_size=(w - 1, 0)) == s * w - w * (w - 1) // 2
    assert tk.unmasked_score_count(s, s) == s * (s + 1) // 2
    assert tk.unmasked_score_count(s, s, chunk_size=8192) == 4 * 8192 * 8193 // 2
    with pytest.raises(ValueError, match="window_size: right = 1 contradicts causal=True"):
        tk.unmasked_score_count(8, 8, window_size=(-1, 1))


def test_normalization():
    a = AttentionArgs(1.0, 63, 0).normalized(64, 64)
    assert (a.left, a.right) == (-1, 0)  # a window as long as the sequence is causal
    a = AttentionArgs(1.0, 62, 5).normalized(64, 64)
    assert (a.left, a.right) == (62, 5)
    a = AttentionArgs(1.0, -1, 70, chunk=64).normalized(20, 64)
    assert (a.right, a.chunk) == (-1, 0)  # right >= seq_q - 1 cuts nothing; one chunk covers all
    assert AttentionArgs(1.0, chunk=64).normalized(20, 64, dense=False).chunk == 64  # varlen: per document


def test_plan_covers_every_visible_pair_once():
    for sq, sk, causal, window, chunk in _random_masks(300, seed=1):
        left, right = check_window(window, causal)
        a = AttentionArgs(1.0, left, right, chunk=check_chunk(chunk))
        want = _visible(sq, sk, left, right, a.chunk)
        for block in (4, 16):
            got = torch.zeros(sq, sk, dtype=torch.int32)
            seen_rows = torch.zeros(sq, dtype=torch.int32)
            pieces = plan(sq, sk, a, block)
            for pc in pieces:
                m = piece_visible(pc, sq, sk, a, None)
                if pc.mode == "full":
                    assert bool(m.all())
                elif pc.mode == "causal":
                    assert pc.r1 - pc.r0 == pc.k1 - pc.k0 and torch.equal(m, torch.ones_like(m).tril())
                got[pc.r0:pc.r1, pc.k0:pc.k1] += m.int()
                seen_rows[pc.r0:pc.r1] += 1
            assert torch.equal(got, want.int()), (sq, sk, window, chunk, block)
            # Every row that sees a key is in exactly one piece (no merge), the others in none.
            assert torch.equal(seen_rows, want.any(1).int()), (sq, sk, window, chunk, block)
            for g in groups(pieces, sq, sk, a):
                masks = [piece_visible(pc, sq, sk, a, None) for pc in g]
                assert all(torch.equal(m, masks[0]) for m in masks)


def test_window_plan_is_linear_in_the_window():
    s, w = 4096, 128
    a = AttentionArgs(1.0, w - 1, 0)
    planned = sum((pc.r1 - pc.r0) * (pc.k1 - pc.k0) for pc in plan(s, s, a, 64))
    assert planned < s * (w + 64), planned  # against s^2 / 2 = 8.4e6 for causal
    assert len(groups(plan(s, s, a, 64), s, s, a)) <= 3  # head, interior blocks, tail: batched calls


def test_blockwise_never_plans_the_whole_score_matrix():
    # The blockwise backend computes each piece's scores in memory: without the causal head piece
    # (an aten kernel call keeps no score matrix; a blockwise piece would), no piece exceeds a block.
    from titan_kernels.ops.attention import blockwise

    s = 4096
    for a in (AttentionArgs(1.0, -1, 0), AttentionArgs(1.0, -1, -1), AttentionArgs(1.0, 127, 0, softcap=30.0)):
        rows = blockwise._block_rows(1, 8, s, s, a)
        assert all(pc.r1 - pc.r0 <= rows for pc in plan(s, s, a, rows, causal_head=False))
        assert 1 * 8 * rows * s <= 2 * blockwise._BUDGET


@pytest.mark.parametrize("bad", [10.5, 10.0, "10", None, True, [10]])
def test_unmasked_score_count_refuses_a_length_that_is_not_an_int(bad):
    # 10.5 used to count 55 scores; a string or None raised deep inside. One line naming the argument.
    with pytest.raises(TypeError, match=r"^seq_q: expected an int >= 0, got "):
        tk.unmasked_score_count(bad, 10)
    with pytest.raises(TypeError, match=r"^seq_k: expected an int >= 0, got "):
        tk.unmasked_score_count(10, bad)


def test_unmasked_score_count_argument_errors():
    with pytest.raises(ValueError, match=r"^seq_k: expected an int >= 0, got -1$"):
        tk.unmasked_score_count(4, -1)
    with pytest.raises(TypeError, match=r"^causal: expected True or False, got 'False'"):
        tk.unmasked_score_count(4, 4, causal="False")  # a truthy string: it would count causal
    with pytest.raises(TypeError, match=r"^causal: expected True or False"):
        tk.flash_attn(*(torch.zeros(1, 4, 2, 8),) * 3, causal="False")
    with pytest.raises(ValueError, match=r"^chunk_size: expected None or an int >= 1"):
        tk.unmasked_score_count(4, 4, chunk_size=2.5)
    import numpy as np  # numpy's ints are ints
    assert tk.unmasked_score_count(np.int64(10), np.int32(10)) == 55
    assert tk.unmasked_score_count(10, 10, window_size=(np.int64(2), 0), chunk_size=np.int64(4)) == \
        tk.unmasked_score_count(10, 10, window_size=(2, 0), chunk_size=4)
    assert tk.unmasked_score_count(0, 0) == 0 and tk.unmasked_score_count(3, 0) == 0
