"""Shared device helpers of the FlashAttention kernels, and the autotuning configs they share.

Used by the portable forward (``fwd``), the Hopper forward (``fwd_sm90``) and the backward (``bwd``):
  _doc_offset       where sequence b starts and how long it is: dense (b * stride_b) or varlen (row
                    CU[b] of the packed tensor); int64 offsets, so tensors over 2^31 elements index
                    correctly.
  _kv_range         for a block of query rows, the key range that needs no mask and the masked one
                    (causal diagonal, bottom-right aligned, and the sequence end).
  _softmax_update   one online-softmax step in log2 units with float32 statistics: the inner-loop
                    update of FlashAttention-2 (Dao 2023, Alg. 1): running max m, running sum l,
                    rescaled accumulator.
  _dot              tl.dot with the interpreter's bfloat16 workaround.
  _score_mask       -inf on scores past the sequence end or above the causal diagonal.
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
def _kv_range(m0, len_q, len_k, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key ranges for query rows [m0, m0 + BLOCK_M): [0, full) needs no mask, [full, hi) is masked.

    Causal, bottom-right: row i sees key j when j <= i + diag, diag = len_k - len_q.
    """
    if IS_CAUSAL:
        diag = len_k - len_q
        hi = tl.maximum(tl.minimum(len_k, m0 + BLOCK_M + diag), 0)
        full = tl.maximum(tl.minimum(len_k, m0 + diag + 1), 0)
    else:
        diag = len_k - len_q
        hi = len_k
        full = len_k
    full = (full // BLOCK_N) * BLOCK_N  # full >= 0, so // is a floor in both compiled and interpreted code
    return full, hi, diag


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
def _score_mask(s, rows, cols, len_k, diag, IS_CAUSAL: tl.constexpr):
    valid = cols[None, :] < len_k
    if IS_CAUSAL:
        valid = valid & (cols[None, :] <= rows[:, None] + diag)
    return tl.where(valid, s, float("-inf"))


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

_AUTOTUNE_KEY = ["BLOCK_D", "BLOCK_DV", "IS_CAUSAL", "IS_VARLEN", "group", "seq_bucket"]

# Kernels write every output element exactly once (no accumulation), so autotuning reruns are safe.
# The tiles were checked by compiling for sm_90a with Triton 3.9 (no GPU here): at head_dim 64 and
# 128 none spills registers except where noted; head_dim 256 spills in every tile (as expected for
# one-kernel FlashAttention-2 tiles), and autotuning picks the least bad one.
# (The tuned kernels: fwd._fwd_tuned, bwd._dkdv_tuned, bwd._dq_tuned; their first config is the default.)


def _configs(pairs):
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in pairs]
