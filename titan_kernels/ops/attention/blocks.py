"""The query-block plan of a masked attention call: which keys each block of query rows needs, and
whether they need a mask. The CPU paths run it (aten's kernel per piece, ``aten_cpu``; the blockwise
online softmax, ``blockwise``), so a window of w over seq_q queries costs O(seq_q * (w + block)),
not O(seq_q * seq_k), and memory is O(block * keys of the block).

A plan is a list of ``Piece(r0, r1, k0, k1, mode)``: query rows [r0, r1) against keys [k0, k1), every
query row in exactly one piece with every key it sees (so no merge of partial softmaxes is needed),
rows that see no key in none. Modes:
  "full"    every row sees every key of the piece: no mask.
  "causal"  a square piece on the diagonal (k0 = the position of row r0): row r0 + t sees keys
            k0 .. k0 + t, i.e. aten's top-left ``is_causal`` on the piece.
  "mask"    anything else: the piece's own mask (``piece_mask``), (r1 - r0) x (k1 - k0).
Positions and the mask's definition: ``titan_kernels.attention_mask``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_kernels.attention_mask import AttentionArgs, fully_visible, key_range
from titan_kernels.reference.attention import seen


@dataclass(frozen=True)
class Piece:
    r0: int
    r1: int
    k0: int
    k1: int
    mode: str


def _first_row(sq: int, sk: int, a: AttentionArgs) -> int:
    """The first query row that sees a key (the rows before it see none: only leading rows can be
    empty, since a row at position p >= 0 sees at least key p or its chunk's keys)."""
    diag = sk - sq
    lo = 0
    if a.right >= 0:
        lo = max(lo, -a.right - diag)  # p + right >= 0
    if a.chunk > 0:
        lo = max(lo, -diag)  # p >= 0
    return min(lo, sq)


def _causal_square(p0: int, p1: int, k0: int, k1: int, a: AttentionArgs) -> bool:
    # Row at position p sees keys k0..p, and keys start at the first row's position.
    if a.right != 0 or k0 != p0 or k1 != p1 + 1:
        return False
    if a.left >= 0 and p1 - a.left > k0:
        return False
    return a.chunk == 0 or (p0 // a.chunk == p1 // a.chunk and k0 >= (p0 // a.chunk) * a.chunk)


def plan(sq: int, sk: int, a: AttentionArgs, block: int, causal_head: bool = True) -> list[Piece]:
    """The pieces of a dense (seq_q, seq_k) call with mask ``a``, query blocks of ``block`` rows (cut
    at chunk boundaries, so that a block lies in one chunk). ``causal_head`` (a kernel whose causal
    call keeps no score matrix): with right = 0, no chunk and seq_q == seq_k, the leading rows that
    no left bound cuts form one causal piece."""
    diag = sk - sq
    r = _first_row(sq, sk, a)
    pieces = []
    if causal_head and a.right == 0 and a.chunk == 0 and diag == 0 and r < sq:
        head = sq if a.left < 0 else min(sq, a.left + 1)  # rows whose window starts at key 0
        pieces.append(Piece(0, head, 0, head, "causal"))
        r = head
    while r < sq:
        r1 = min(sq, r + block)
        if a.chunk > 0:  # a block ends at its chunk's end
            p = r + diag
            r1 = min(r1, (p // a.chunk + 1) * a.chunk - diag)
        p0, p1 = r + diag, r1 - 1 + diag
        k0, k1 = key_range(p0, p1, sk, a.left, a.right, a.chunk)
        if k0 < k1:
            if fully_visible(p0, p1, k0, k1, a.left, a.right, a.chunk):
                mode = "full"
            elif _causal_square(p0, p1, k0, k1, a):
                mode = "causal"
            else:
                mode = "mask"
            pieces.append(Piece(r, r1, k0, k1, mode))
        r = r1
    return pieces


def piece_visible(piece: Piece, sq: int, sk: int, a: AttentionArgs, device) -> torch.Tensor:
    """(r1 - r0, k1 - k0) bool: True where the piece's query row sees the key."""
    p = torch.arange(piece.r0, piece.r1, device=device).unsqueeze(1) + (sk - sq)
    return seen(p, torch.arange(piece.k0, piece.k1, device=device).unsqueeze(0), a)


def piece_mask(piece: Piece, sq: int, sk: int, a: AttentionArgs, dtype, device) -> torch.Tensor:
    """The piece's additive mask: 0 where seen, -inf elsewhere, in ``dtype``."""
    m = piece_visible(piece, sq, sk, a, device)
    return torch.zeros(m.shape, dtype=dtype, device=device).masked_fill_(~m, float("-inf"))



def groups(pieces: list[Piece], sq: int, sk: int, a: AttentionArgs) -> list[list[Piece]]:
    """The pieces in groups of one geometry and one mask (same rows, keys, mode and, for a mask, the
    same offset between the rows' positions and the first key; with chunks, the same place in the
    chunk), in plan order: a group runs as one batched kernel call (a sliding window's interior
    blocks are one group)."""
    out: dict[tuple, list[Piece]] = {}
    diag = sk - sq
    for pc in pieces:
        key = (pc.r1 - pc.r0, pc.k1 - pc.k0, pc.mode)
        if pc.mode == "mask":
            p0 = pc.r0 + diag
            key += (p0 - pc.k0,) + ((p0 % a.chunk, pc.k0 % a.chunk) if a.chunk else ())
        out.setdefault(key, []).append(pc)
    return list(out.values())
