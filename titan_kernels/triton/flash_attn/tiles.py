"""Shared device helpers of the FlashAttention kernels, and the autotuning configs they share.

Used by the portable forward (``fwd``), the Hopper forward (``fwd_sm90``) and the backward (``bwd``):
  _doc_offset       where sequence b starts and how long it is: dense (b * stride_b) or varlen (row
                    CU[b] of the packed tensor); int64 offsets, so tensors over 2^31 elements index
                    correctly.
  _kv_range         for a block of query rows, the keys it needs in three passes (masked at a window's
                    or chunk's lower edge, unmasked, masked at the causal diagonal / upper edge and the
                    sequence end); keys outside are skipped. _q_range: the same for the query rows
                    of a key block (the backward). _align, _floordiv, _visible: their pieces.
  _scores           the scores in log2 units, soft-capped when asked.
  _softmax_update   one online-softmax step in log2 units with float32 statistics: the inner-loop
                    update of FlashAttention-2 (Dao 2023, Alg. 1): running max m, running sum l,
                    rescaled accumulator.
  _dot              tl.dot with the interpreter's bfloat16 workaround.
  _score_mask       -inf on scores past the sequence end or outside the mask (window, chunk).
  _softmax_step     the forward's step on one key block (both forward kernels): _scores, _score_mask
                    when masked, _softmax_update.
  _fwd_epilogue     Alg. 1's epilogue for the query block: O = acc / l and lse = (m + log2 l) * ln 2
                    stored; a row with no visible key gets O = 0, lse = -inf (O has v's head_dim).
  _configs, _AUTOTUNE_KEY   the autotuning configs' constructor and the key shared by the kernels.
"""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# Globals read inside @triton.jit code must be constexpr.
_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(0.6931471805599453)

# ----------------------------------------------------------------------------- device helpers


@triton.jit
def _doc_offset(CU, b, seqlen, stride_b, stride_s, IS_VARLEN: tl.constexpr):
    """(int64 element offset of sequence b's first row, its length): dense rows start at b * stride_b;
    varlen documents start at row CU[b] of the packed tensor."""
    if IS_VARLEN:
        start = tl.load(CU + b)
        length = tl.load(CU + b + 1) - start
        off = start.to(tl.int64) * stride_s
    else:
        length = seqlen
        off = b * stride_b
    return off, length


@triton.jit
def _floordiv(a, b):
    # Floor division for either sign (compiled integer division truncates; the interpreter floors).
    return tl.where(a >= 0, a // b, -((b - 1 - a) // b))


@triton.jit
def _align(lo, lo_full, hi_full, hi, BLOCK: tl.constexpr):
    """Block-aligned (lo, lo_full, hi_full) for the three passes over [lo, hi): masked [lo, lo_full),
    unmasked [lo_full, hi_full), masked [hi_full, hi); lo <= lo_full <= hi_full, all >= 0."""
    hi = tl.maximum(hi, 0)
    lo = tl.minimum(tl.maximum(lo, 0), hi)
    lo_full = tl.maximum(lo_full, lo)
    hi_full = tl.maximum(tl.minimum(hi_full, hi), 0)
    lo_a = (lo // BLOCK) * BLOCK  # all >= 0: // is a floor in compiled and interpreted code alike
    lo_full_a = tl.maximum(tl.minimum((lo_full + BLOCK - 1) // BLOCK, (hi + BLOCK - 1) // BLOCK) * BLOCK, lo_a)
    hi_full_a = tl.maximum((hi_full // BLOCK) * BLOCK, lo_full_a)
    return lo_a, lo_full_a, hi_full_a, hi


@triton.jit
def _kv_range(m0, len_q, len_k, left, right, chunk, IS_CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr,
              HAS_CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The keys of query rows [m0, m0 + BLOCK_M) (``_align``'s three passes; keys outside [lo, hi)
    are never loaded, so a window of w costs O(w) per row) and diag = len_k - len_q.

    Row i sits at position p = i + diag (bottom-right aligned) and sees key j when j <= p + right
    (IS_CAUSAL; right = 0 is causal), j >= p - left (HAS_LEFT) and j // chunk == p // chunk (HAS_CHUNK).
    """
    diag = len_k - len_q
    p0 = m0 + diag
    p1 = tl.minimum(m0 + BLOCK_M, len_q) - 1 + diag  # the block's last real row
    lo = p0 * 0
    lo_full = lo
    hi = len_k + lo
    hi_full = hi
    if IS_CAUSAL:
        hi = tl.minimum(hi, p1 + right + 1)
        hi_full = tl.minimum(hi_full, p0 + right + 1)
    if HAS_LEFT:
        lo = tl.maximum(lo, p0 - left)
        lo_full = tl.maximum(lo_full, p1 - left)
    if HAS_CHUNK:
        c0 = _floordiv(p0, chunk)
        c1 = _floordiv(p1, chunk)
        lo = tl.maximum(lo, c0 * chunk)
        hi = tl.minimum(hi, (c1 + 1) * chunk)
        lo_full = tl.maximum(lo_full, c1 * chunk)  # empty unless the rows share one chunk
        hi_full = tl.minimum(hi_full, (c0 + 1) * chunk)
    lo, lo_full, hi_full, hi = _align(lo, lo_full, hi_full, hi, BLOCK_N)
    return lo, lo_full, hi_full, hi, diag


@triton.jit
def _q_range(n0, len_q, len_k, left, right, chunk, IS_CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr,
             HAS_CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """The query rows that see any key of [n0, n0 + BLOCK_N) (the backward's dK/dV kernel), in
    ``_align``'s three passes: rows in [lo_full, hi_full) see every key of the block."""
    diag = len_k - len_q
    n1 = tl.minimum(n0 + BLOCK_N, len_k) - 1  # the block's last real key
    lo = n0 * 0
    lo_full = lo
    hi = len_q + lo
    hi_full = hi
    if IS_CAUSAL:  # j <= p + right
        lo = tl.maximum(lo, n0 - right - diag)
        lo_full = tl.maximum(lo_full, n1 - right - diag)
    if HAS_LEFT:  # j >= p - left
        hi = tl.minimum(hi, n1 + left - diag + 1)
        hi_full = tl.minimum(hi_full, n0 + left - diag + 1)
    if HAS_CHUNK:
        c0 = _floordiv(n0, chunk)
        c1 = _floordiv(n1, chunk)
        lo = tl.maximum(lo, c0 * chunk - diag)
        hi = tl.minimum(hi, (c1 + 1) * chunk - diag)
        lo_full = tl.maximum(lo_full, c1 * chunk - diag)
        hi_full = tl.minimum(hi_full, (c0 + 1) * chunk - diag)
    return _align(lo, lo_full, hi_full, hi, BLOCK_M)


@triton.jit
def _visible(p, cols, left, right, chunk, IS_CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_CHUNK: tl.constexpr):
    """True where the query at position p sees key cols (broadcast shapes); bounds by the caller."""
    valid = cols >= 0
    if IS_CAUSAL:
        valid = valid & (cols <= p + right)
    if HAS_LEFT:
        valid = valid & (cols >= p - left)
    if HAS_CHUNK:
        valid = valid & (_floordiv(cols, chunk) == _floordiv(p, chunk))
    return valid


@triton.jit
def _scores(qk, sm_scale, qk_scale, softcap, SOFTCAP: tl.constexpr):
    """(scores in log2 units, tanh of the soft-capped scores / softcap or None): without soft-capping
    qk * scale * log2(e); with it softcap * tanh(qk * scale / softcap) * log2(e) (Gemma 2), tanh
    written with a sigmoid (2 sigmoid(2x) - 1) so the interpreter and every GPU compute it alike."""
    if SOFTCAP:
        t = 2.0 * tl.sigmoid((2.0 * sm_scale / softcap) * qk) - 1.0
        return t * (softcap * _LOG2E), t
    else:
        return qk * qk_scale, qk


@triton.jit
def _softmax_update(s, m_i, l_i, acc, MASKED: tl.constexpr):
    """One online-softmax step on scores s (log2 units): returns (p, rescaled acc, l_i, m_i)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:
        # A row with every key masked so far has m = -inf; shift by 0 so exp2 gives 0, not nan.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    return p, acc, l_i, m_new


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    # DOT_F32: the interpreter multiplies bfloat16 blocks as raw bits (numpy has no bfloat16), so it
    # gets float32 copies; the products of bf16 values are exact in float32, as on tensor cores.
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _score_mask(s, rows, cols, len_k, diag, left, right, chunk, IS_CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr,
                HAS_CHUNK: tl.constexpr):
    valid = (cols[None, :] < len_k) & _visible(rows[:, None] + diag, cols[None, :], left, right, chunk, IS_CAUSAL,
                                               HAS_LEFT, HAS_CHUNK)
    return tl.where(valid, s, float("-inf"))


@triton.jit
def _softmax_step(qk, m_i, l_i, acc, rows, cols, len_k, diag, qk_scale, sm_scale, softcap, left, right, chunk,
                  MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_CHUNK: tl.constexpr,
                  SOFTCAP: tl.constexpr):
    """The forward's step on the raw scores qk = q k^T of key block cols: (p, rescaled acc, l_i, m_i)."""
    s, _ = _scores(qk, sm_scale, qk_scale, softcap, SOFTCAP)
    if MASKED:
        s = _score_mask(s, rows, cols, len_k, diag, left, right, chunk, IS_CAUSAL, HAS_LEFT, HAS_CHUNK)
    return _softmax_update(s, m_i, l_i, acc, MASKED)


@triton.jit
def _fwd_epilogue(acc, l_i, m_i, O, o_base, stride_os, stride_od, LSE, l_base, stride_ls,
                  m0, len_q, head_dim, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    empty = l_i == 0.0  # no visible key: O = 0, lse = -inf
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * _LN2)
    rmask = rows < len_q
    o_ptrs = O + o_base + tl.arange(0, BLOCK_M)[:, None] * stride_os + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=rmask[:, None] & (offs_d < head_dim)[None, :])
    tl.store(LSE + l_base + rows * stride_ls, lse, mask=rmask)


# ----------------------------------------------------------------------------- autotuning

_AUTOTUNE_KEY = ["BLOCK_D", "BLOCK_DV", "IS_CAUSAL", "HAS_LEFT", "HAS_CHUNK", "SOFTCAP", "IS_VARLEN", "group",
                 "seq_bucket"]

# Kernels write every output element exactly once (no accumulation), so autotuning reruns are safe.
# The tiles were checked by compiling for sm_90a with Triton 3.9 (no GPU here): at head_dim 64 and
# 128 none spills registers except where noted; head_dim 256 spills in every tile (as expected for
# one-kernel FlashAttention-2 tiles), and autotuning picks the least bad one.
# (The tuned kernels: fwd._fwd_tuned, bwd._dkdv_tuned, bwd._dq_tuned; their first config is the default.)


def _configs(pairs):
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in pairs]
