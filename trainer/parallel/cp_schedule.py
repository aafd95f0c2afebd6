"""Which attention calls context parallel's ring makes, and which K/V blocks it therefore sends.

Torch-free plain integers, so that the communication estimate (``trainer.estimate.comm``, loaded by
``python -m trainer.plan`` without torch) counts exactly the blocks that
``trainer.parallel.context_parallel`` sends; that module runs these calls.

The zigzag split: the sequence is cut into ``2 n`` chunks of ``c`` tokens and rank r holds chunks
``r`` and ``2 n - 1 - r``. A layer's mask is ``flash_attn``'s: query i sees key j when
``-left <= j - i <= right`` (-1: unbounded; right 0 is causal) and, with ``chunk`` > 0, both lie in
the same attention chunk of ``chunk`` positions.
"""
from __future__ import annotations

from typing import NamedTuple


class Call(NamedTuple):
    """One attention call of a query chunk on a key chunk: the local rows and keys (slices of the
    rank's 2c tokens) and the mask of the call in its own frame (bottom-right aligned)."""

    rows: slice
    keys: slice
    left: int
    right: int
    chunk: int


def pair(q0: int, k0: int, c: int, left: int, right: int, chunk: int) -> tuple[slice, slice, int, int, int] | None:
    """The call of query chunk [q0, q0 + c) on key chunk [k0, k0 + c) (global starts), or None when
    it sees nothing: (rows, keys, left, right, chunk) in the chunks' local indices.

    Query i sees key j when ``e <= j - i <= f`` with e = D - left, f = D + right, D = q0 - k0 (and
    the attention chunk). A call on q[:i1], k[:j1] sees ``j - i`` in [Δ - left', Δ + right'] with
    Δ = j1 - i1 (bottom-right alignment), so Δ is clamped into [e, f] and the rows / keys past
    i1 / j1 (which see nothing) are trimmed.
    """
    big = 4 * c  # farther than any j - i in the pair: an unbounded side
    e = q0 - k0 - left if left >= 0 else -big
    f = q0 - k0 + right if right >= 0 else big
    if max(e, -(c - 1)) > min(f, c - 1):
        return None
    call_chunk = 0
    if chunk:
        if (chunk % c == 0 and q0 // chunk != k0 // chunk) or (c % chunk == 0 and q0 != k0):
            return None  # different attention chunks
        call_chunk = chunk if c % chunk == 0 else 0  # chunk % c == 0: both chunks in one attention chunk
    delta = min(max(0, e), f)
    i1, j1 = c - max(delta, 0), c + min(delta, 0)
    return (slice(0, i1), slice(0, j1), delta - e if left >= 0 else -1, f - delta if right >= 0 else -1,
            call_chunk)


def calls(r: int, j: int, n: int, c: int, left: int, right: int, chunk: int) -> list[Call]:
    """The calls of rank r's queries on rank j's K/V block (ring of n ranks, zigzag chunks of c)."""
    out = []
    for qi, qc in enumerate((r, 2 * n - 1 - r)):
        for ki, kc in enumerate((j, 2 * n - 1 - j)):
            p = pair(qc * c, kc * c, c, left, right, chunk)
            if p is not None:
                rows, keys, call_left, call_right, call_chunk = p
                out.append(Call(slice(qi * c + rows.start, qi * c + rows.stop),
                                slice(ki * c + keys.start, ki * c + keys.stop), call_left, call_right, call_chunk))
    return out


def blocks_sent(n: int, c: int, left: int, right: int, chunk: int) -> list[int]:
    """Per rank: how many other ranks need its K/V block in one ring pass (a forward), which is how
    many blocks it sends; over all ranks the total equals the blocks received, and in the backward
    each received block's gradient goes back. The causal mask needs every block on every rank
    (n - 1 each); a window shorter than the chunk distance or attention chunks need fewer.

    Raises ValueError for n < 1 or c < 1.
    """
    if n < 1 or c < 1:
        raise ValueError(f"n, c: expected integers >= 1, got {n}, {c}")
    return [sum(bool(calls((r + s) % n, r, n, c, left, right, chunk)) for s in range(1, n)) for r in range(n)]
