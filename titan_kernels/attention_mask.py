"""The attention mask, in one place: which keys a query sees, and how many scores that leaves.

Positions are aligned bottom-right, as FlashAttention >= 2.1 aligns causal masks: query row i of a
sequence (or document) of seq_q queries over seq_k keys sits at position ``p = i + seq_k - seq_q``
(the queries are the last seq_q of the keys' positions; with seq_q == seq_k, p = i). Query i sees
key j when all of these hold:

  window (left, right)   ``p - left <= j <= p + right``; -1 leaves that side unbounded. causal is
                         ``right = 0``. A sliding window of W tokens (GPT-OSS, Mistral) is
                         ``(W - 1, 0)``: the query and the W - 1 keys before it.
  chunk_size c           ``j // c == p // c`` (floor division): keys in the query's own chunk of
                         absolute positions (Llama 4's chunked local attention). Rows at negative
                         positions (seq_q > seq_k) are in chunk -1 and see no key. Varlen: per document,
                         positions counted from the document's start.
  always                 ``0 <= j < seq_k``.

A row that sees no key has out = 0 and lse = -inf (with sinks: lse = the sink's logit).

Normalization (``normalize_window``): a bound that cannot cut anything is unbounded (left >= seq_k - 1,
right >= seq_q - 1), so a window as long as the sequence is plain causal and runs causal's path.

``AttentionArgs`` is the non-tensor arguments of one attention call as one frozen record. The public
functions validate and normalize them once; the record then travels unchanged through the eager
fast path, the ``titan::flash_attn`` op (whose schema stays flat: ``op_args`` / ``from_op``), the
dispatch key, every backend's forward and backward, and the saved context of the backward. Tensors
(q, k, v, cu_seqlens, sinks) travel beside it.

This module imports nothing (no torch): it sits below the ops and the kernels that share it, and
``unmasked_score_count`` serves FLOPs / MFU counts.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field


def check_flag(value, name: str) -> bool:
    """``value`` as a bool when it equals True or False (numpy's bools, 0 and 1 too); TypeError naming
    ``name`` for anything else: a string such as "False" is truthy, read as a bool it would silently
    mean True."""
    if isinstance(value, bool):
        return value
    try:
        ok = value in (True, False)
    except (TypeError, ValueError, RuntimeError):  # e.g. an array of several values
        ok = False
    if not ok:
        raise TypeError(f"{name}: expected True or False, got {value!r} ({type(value).__name__})")
    return bool(value)


def check_causal(causal) -> bool:
    return check_flag(causal, "causal")


def check_length(value, name: str) -> int:
    """A sequence length: an int >= 0 (numpy's ints too); TypeError for anything else (floats such as
    10.5, strings, None, bools), ValueError for a negative one."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int >= 0, got {value!r} ({type(value).__name__})")
    if value < 0:
        raise ValueError(f"{name}: expected an int >= 0, got {value}")
    return int(value)


def check_window(window_size, causal: bool) -> tuple[int, int]:
    """(left, right) from the public ``window_size`` and ``causal``; ValueError/TypeError naming the
    argument for anything else. causal means right = 0; a right bound > 0 contradicts it."""
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or any(isinstance(x, bool) or not isinstance(x, numbers.Integral) for x in window_size)):
        raise TypeError(f"window_size: expected a pair of ints (left, right), got {window_size!r}")
    left, right = (int(x) for x in window_size)
    if left < -1 or right < -1:
        raise ValueError(f"window_size: expected ints >= -1 (-1 = unbounded), got ({left}, {right})")
    if causal:
        if right > 0:
            raise ValueError(f"window_size: right = {right} contradicts causal=True (causal means right = 0); "
                             "pass causal=False for a window that looks ahead")
        right = 0
    return left, right


def check_chunk(chunk_size) -> int:
    """0 (off) for None or 0, else the chunk length (an int >= 1)."""
    if chunk_size is None:
        return 0
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral) or chunk_size < 0:
        raise ValueError(f"chunk_size: expected None or an int >= 1, got {chunk_size!r}")
    return int(chunk_size)


def check_softcap(softcap) -> float:
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap: expected a float (0 = off), got {type(softcap).__name__}")
    s = float(softcap)
    if not math.isfinite(s) or s < 0:
        raise ValueError(f"softcap: expected a finite value >= 0 (0 = off), got {s}")
    return s


def normalize_window(left: int, right: int, seq_q: int, seq_k: int) -> tuple[int, int]:
    """Unbounded (-1) for a side that cuts no key of any row: left >= seq_k - 1, right >= seq_q - 1."""
    if left >= max(seq_k - 1, 0):
        left = -1
    if right >= max(seq_q - 1, 0):
        right = -1
    return left, right


def key_range(p0: int, p1: int, seq_k: int, left: int, right: int, chunk: int) -> tuple[int, int]:
    """[lo, hi): the keys that any query at positions p0..p1 (inclusive) may see (the union of their
    visible ranges, within [0, seq_k)); lo >= hi when none."""
    lo, hi = 0, seq_k
    if left >= 0:
        lo = max(lo, p0 - left)
    if right >= 0:
        hi = min(hi, p1 + right + 1)
    if chunk > 0:
        lo = max(lo, (p0 // chunk) * chunk) if p0 >= 0 else max(lo, 0)
        hi = min(hi, (p1 // chunk + 1) * chunk) if p1 >= 0 else 0
    return lo, hi


def row_range(p: int, seq_k: int, left: int, right: int, chunk: int) -> tuple[int, int]:
    """[lo, hi) of the keys the query at position p sees."""
    if chunk > 0 and p < 0:
        return 0, 0
    return key_range(p, p, seq_k, left, right, chunk)


def fully_visible(p0: int, p1: int, k0: int, k1: int, left: int, right: int, chunk: int) -> bool:
    """True when every query at positions p0..p1 sees every key of [k0, k1) (no mask needed)."""
    if left >= 0 and k0 < p1 - left:
        return False
    if right >= 0 and k1 - 1 > p0 + right:
        return False
    if chunk > 0 and (p0 < 0 or p0 // chunk != p1 // chunk or k0 < (p0 // chunk) * chunk
                      or k1 > (p0 // chunk + 1) * chunk):
        return False
    return True


def _sum_pos(a: int, b: int, c0: int, c1: int) -> int:
    """sum over integers x in [a, b] of max(0, c0 + c1 * x), c1 in {-1, 0, 1}."""
    if a > b:
        return 0
    if c1 == 0:
        return (b - a + 1) * max(0, c0)
    if c1 > 0:  # positive from x > -c0
        a = max(a, -c0 + 1)
    else:  # positive while x < c0
        b = min(b, c0 - 1)
    if a > b:
        return 0
    n = b - a + 1
    return n * c0 + c1 * (a + b) * n // 2


def _window_count(p_lo: int, p_hi: int, k_lo: int, k_hi: int, left: int, right: int) -> int:
    """sum over positions p in [p_lo, p_hi] of |[max(k_lo, p - left), min(k_hi, p + right + 1))|."""
    if p_lo > p_hi or k_lo >= k_hi:
        return 0
    big = (k_hi - k_lo) + abs(p_lo) + abs(p_hi) + 1  # a bound no row reaches: unbounded
    left = big if left < 0 else left
    right = big if right < 0 else right
    # count(p) = max(0, min(k_hi, p + right + 1) - max(k_lo, p - left)): piecewise linear in p with
    # breaks where p + right + 1 = k_hi and p - left = k_lo; sum each linear piece.
    breaks = sorted({p_lo, p_hi + 1, min(max(k_hi - right - 1, p_lo), p_hi + 1), min(max(k_lo + left + 1, p_lo), p_hi + 1)})
    total = 0
    for a, b in zip(breaks[:-1], breaks[1:]):
        if a >= b:
            continue
        # On [a, b): hi(p) = k_hi or p + right + 1; lo(p) = k_lo or p - left (decided at p = a).
        hi_lin = a + right + 1 < k_hi
        lo_lin = a - left > k_lo
        c1 = int(hi_lin) - int(lo_lin)
        c0 = (right + 1 if hi_lin else k_hi) - (-left if lo_lin else k_lo)
        total += _sum_pos(a, b - 1, c0, c1)
    return total


def unmasked_score_count(seq_q: int, seq_k: int, *, causal: bool = True, window_size=(-1, -1),
                         chunk_size: int | None = None) -> int:
    """How many (query, key) scores of one (sequence, head) attention are not masked out, counted
    analytically (no tensors; O(seq_k / chunk_size) work with chunks, O(1) without).

    Args are ``flash_attn``'s: the mask of this module's docstring (bottom-right aligned). FLOPs of
    attention are proportional to this count: forward ``2 * count * (head_dim + head_dim_v)``
    per head (Q K^T and P V), the backward 2.5x that, so a sliding window of W over a sequence s
    counts about ``s * W``, not ``s^2 / 2``. For varlen, sum the count over the documents.

    Raises:
        TypeError: seq_q / seq_k not an int (a float such as 10.5, a string, None, a bool), causal
            not a bool; window_size / chunk_size as ``flash_attn``.
        ValueError: a negative length; window_size / chunk_size out of range as ``flash_attn``.
    """
    seq_q, seq_k = check_length(seq_q, "seq_q"), check_length(seq_k, "seq_k")
    left, right = check_window(window_size, check_causal(causal))
    chunk = check_chunk(chunk_size)
    p_lo, p_hi = seq_k - seq_q, seq_k - 1  # the rows' positions
    if chunk == 0:
        return _window_count(p_lo, p_hi, 0, seq_k, left, right)
    total = 0
    for c0 in range(max(0, (max(p_lo, 0) // chunk) * chunk), seq_k, chunk):  # positions >= 0 only
        total += _window_count(max(p_lo, c0), min(p_hi, c0 + chunk - 1), c0, min(seq_k, c0 + chunk), left, right)
    return total


@dataclass(frozen=True)
class AttentionArgs:
    """One attention call's options (mask semantics: the module docstring).

    scale       the softmax scale of Q K^T (> 0).
    left, right the window, normalized: -1 = unbounded; right = 0 is causal.
    softcap     scores -> softcap * tanh(scores / softcap) (after the scale); 0 = off.
    chunk       chunked local attention's chunk length; 0 = off.
    max_q, max_k  varlen: bounds of the document lengths (they size kernel grids); 0 when dense.
    return_lse  whether the caller sees the LSE (only then is its gradient used).
    """

    scale: float
    left: int = -1
    right: int = -1
    softcap: float = 0.0
    chunk: int = 0
    max_q: int = 0
    max_k: int = 0
    return_lse: bool = False
    # Derived once (this record is read on every call): see __post_init__.
    causal: bool = field(init=False, compare=False, repr=False)
    local: bool = field(init=False, compare=False, repr=False)
    plain: bool = field(init=False, compare=False, repr=False)
    key: tuple = field(init=False, compare=False, repr=False)
    flat: tuple = field(init=False, compare=False, repr=False)

    def __post_init__(self):
        # causal: the upper bound is the diagonal (right == 0), with or without a left bound or chunks.
        # local: a mask beyond full / causal (a left bound, a right bound > 0, or chunks).
        # plain: full or causal only, no soft-capping (what every backend takes).
        # key: what a backend's capability depends on (the dispatch key's part), not the exact sizes.
        local = self.left >= 0 or self.right > 0 or self.chunk > 0
        for name, value in (("causal", self.right == 0), ("local", local),
                            ("plain", not local and self.softcap == 0.0),
                            ("key", (self.left >= 0, (self.right > 0) - (self.right < 0), self.chunk > 0,
                                     self.softcap > 0.0))):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "flat", (self.max_q, self.max_k, self.scale, self.left, self.right, self.softcap,
                                          self.chunk, self.return_lse))

    def kind(self) -> tuple:
        """What a backend's capability depends on (the dispatch key's part): not the exact sizes."""
        return self.key

    def op_args(self) -> tuple:
        """The flat arguments of ``titan::flash_attn`` after the tensors (see ``from_op``)."""
        return self.flat

    @classmethod
    def from_op(cls, max_q, max_k, scale, left, right, softcap, chunk, return_lse) -> "AttentionArgs":
        return cls(float(scale), int(left), int(right), float(softcap), int(chunk), int(max_q), int(max_k),
                   bool(return_lse))

    def normalized(self, seq_q: int, seq_k: int, dense: bool = True) -> "AttentionArgs":
        """This record with the bounds that cut nothing made unbounded (``normalize_window``; dense:
        a chunk covering the whole sequence is off); seq_* are the lengths (varlen: the maxima)."""
        left, right = normalize_window(self.left, self.right, seq_q, seq_k)
        chunk = 0 if dense and self.chunk >= seq_k and seq_q <= seq_k else self.chunk
        if (left, right, chunk) == (self.left, self.right, self.chunk):
            return self
        return AttentionArgs(self.scale, left, right, self.softcap, chunk, self.max_q, self.max_k, self.return_lse)
