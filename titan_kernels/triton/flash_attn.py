"""Triton FlashAttention: forward and backward, causal or not, dense or varlen, GQA, with the LSE.

Launchers have the contract of ``titan_kernels.reference.attention`` (same layouts, ``max_seqlen_*``
size the grids). Algorithm: FlashAttention-2 (Dao 2023, "FlashAttention-2", Alg. 1 forward and
Alg. 2 backward): online softmax over key blocks with float32 statistics and accumulator, the
log-sum-exp saved for the backward, which recomputes P block by block.

Kernels:
  _fwd_kernel       one program per (query block, batch, head); two passes over the key blocks:
                    the blocks every query of the block fully sees (no mask), then the blocks on
                    the causal diagonal or the sequence end (masked).
  _bwd_delta_kernel delta = rowsum(dO * O) (float32).
  _bwd_dkdv_kernel  one program per (key block, batch, KV head); loops over the query heads of its
                    GQA group and over query blocks, so dK/dV need no atomics and K/V are never
                    repeated.
  _bwd_dq_kernel    one program per (query block, batch, head); loops over key blocks.
  _fwd_kernel_sm90  Hopper-only forward (capability (9, 0), bf16/fp16, head_dim 64/128/256): Q/K/V
                    read through TMA tensor descriptors, the key loop warp-specialised when this
                    Triton offers it. Selected only on sm_90; the backward uses the portable kernels.

Indexing: batch/head/document bases are int64 and the key/query loops advance pointers, so tensors
over 2^31 elements index correctly. Inputs may have any strides (the head_dim stride too).
Masked-out scores are -inf; a row with no visible key gets O = 0 and lse = -inf; the backward treats
its lse as +inf so that P = 0 there.

On CUDA the block sizes are autotuned per (head_dim, causal, varlen, dtype, GQA group, sequence
length bucket); ``TITAN_KERNELS_AUTOTUNE=0`` uses each kernel's first (default) config instead (tests
on a GPU, where autotuning every small shape costs more than it saves). Under the interpreter
(``TRITON_INTERPRET=1``) fixed small blocks are used.
"""
from __future__ import annotations

import functools
import inspect
import os
import warnings

import torch
import triton
import triton.language as tl

from titan_kernels.backend import triton_interpret

LOG2E = 1.4426950408889634
# Globals read inside @triton.jit code must be constexpr.
_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(0.6931471805599453)

# ----------------------------------------------------------------------------- shared device helpers


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


# ----------------------------------------------------------------------------- forward (portable)


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_ptrs, v_ptrs, lo, hi, rows, offs_n, mask_d, len_k, diag, qk_scale,
               stride_ks, stride_vs,
               MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, EVEN_D: tl.constexpr,
               BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if MASKED:
            kmask = (cols < len_k)[None, :]
            vmask = (cols < len_k)[:, None]
            if not EVEN_D:
                kmask = kmask & mask_d[:, None]
                vmask = vmask & mask_d[None, :]
            k = tl.load(k_ptrs, mask=kmask, other=0.0)
        elif EVEN_D:
            k = tl.load(k_ptrs)
        else:
            k = tl.load(k_ptrs, mask=mask_d[:, None], other=0.0)
        s = _dot(q, k, None, PRECISION, DOT_F32) * qk_scale
        if MASKED:
            s = _score_mask(s, rows, cols, len_k, diag, IS_CAUSAL)
        p, acc, l_i, m_i = _softmax_update(s, m_i, l_i, acc, MASKED)
        if MASKED:
            v = tl.load(v_ptrs, mask=vmask, other=0.0)
        elif EVEN_D:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=mask_d[None, :], other=0.0)
        acc = _dot(p.to(v.dtype), v, acc, PRECISION, DOT_F32)
        k_ptrs += BLOCK_N * stride_ks
        v_ptrs += BLOCK_N * stride_vs
    return acc, l_i, m_i, k_ptrs, v_ptrs


@triton.jit
def _fwd_kernel(
    Q, K, V, O, LSE, CU_Q, CU_K,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_lb, stride_lh, stride_ls,
    seqlen_q, seqlen_k, n_heads, group, head_dim, qk_scale, seq_bucket,
    IS_VARLEN: tl.constexpr, IS_CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // n_heads
    h = bh % n_heads
    kvh = h // group
    q_off, len_q = _doc_offset(CU_Q, b, seqlen_q, stride_qb, stride_qs, IS_VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= len_q:
        return
    k_off, len_k = _doc_offset(CU_K, b, seqlen_k, stride_kb, stride_ks, IS_VARLEN)
    v_off, _ = _doc_offset(CU_K, b, seqlen_k, stride_vb, stride_vs, IS_VARLEN)
    o_off, _ = _doc_offset(CU_Q, b, seqlen_q, stride_ob, stride_os, IS_VARLEN)
    l_off, _ = _doc_offset(CU_Q, b, seqlen_q, stride_lb, stride_ls, IS_VARLEN)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    rows = m0 + offs_m
    m0_64 = m0.to(tl.int64)

    q_ptrs = Q + q_off + h * stride_qh + m0_64 * stride_qs + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=(rows < len_q)[:, None] & mask_d[None, :], other=0.0)
    k_ptrs = K + k_off + kvh * stride_kh + offs_n[None, :] * stride_ks + offs_d[:, None] * stride_kd  # K^T block
    v_ptrs = V + v_off + kvh * stride_vh + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    full, hi, diag = _kv_range(m0, len_q, len_k, IS_CAUSAL, BLOCK_M, BLOCK_N)
    acc, l_i, m_i, k_ptrs, v_ptrs = _fwd_inner(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, 0, full, rows, offs_n, mask_d, len_k, diag, qk_scale,
        stride_ks, stride_vs, False, IS_CAUSAL, EVEN_D, BLOCK_N, PRECISION, DOT_F32)
    acc, l_i, m_i, k_ptrs, v_ptrs = _fwd_inner(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, full, hi, rows, offs_n, mask_d, len_k, diag, qk_scale,
        stride_ks, stride_vs, True, IS_CAUSAL, EVEN_D, BLOCK_N, PRECISION, DOT_F32)
    _fwd_epilogue(acc, l_i, m_i, O, o_off + h * stride_oh + m0_64 * stride_os, stride_os, stride_od,
                  LSE, l_off + h * stride_lh, stride_ls, m0, len_q, head_dim, BLOCK_M, BLOCK_D)


# ----------------------------------------------------------------------------- forward (Hopper, sm_90 only)


@triton.jit
def _load_block(desc, row, head, b, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, IS_VARLEN: tl.constexpr):
    # Varlen descriptors are 3-D (total, heads, d); dense ones 4-D (batch, seq, heads, d), whose rows
    # past the sequence end are zero-filled by TMA instead of read from the next batch entry.
    # TMA coordinates are int32.
    row = tl.cast(row, tl.int32)
    head = tl.cast(head, tl.int32)
    if IS_VARLEN:
        x = desc.load([row, head, 0])
    else:
        x = desc.load([tl.cast(b, tl.int32), row, head, 0])
    return tl.reshape(x, [ROWS, HEAD_DIM])


@triton.jit
def _fwd_inner_sm90(acc, l_i, m_i, q, desc_k, desc_v, b, kvh, k_row0, lo, hi, rows, offs_n, len_k, diag,
                    qk_scale, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, IS_VARLEN: tl.constexpr,
                    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k = _load_block(desc_k, k_row0 + start_n, kvh, b, BLOCK_N, HEAD_DIM, IS_VARLEN)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        if MASKED:
            # Keys past len_k may belong to the next document (varlen): always masked here.
            s = _score_mask(s, rows, start_n + offs_n, len_k, diag, IS_CAUSAL)
        p, acc, l_i, m_i = _softmax_update(s, m_i, l_i, acc, MASKED)
        v = _load_block(desc_v, k_row0 + start_n, kvh, b, BLOCK_N, HEAD_DIM, IS_VARLEN)
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel_sm90(
    desc_q, desc_k, desc_v, O, LSE, CU_Q, CU_K,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_lb, stride_lh, stride_ls,
    seqlen_q, seqlen_k, n_heads, group, qk_scale, seq_bucket,
    IS_VARLEN: tl.constexpr, IS_CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // n_heads
    h = bh % n_heads
    kvh = h // group
    m0 = pid_m * BLOCK_M
    if IS_VARLEN:
        q_row0 = tl.load(CU_Q + b)
        len_q = tl.load(CU_Q + b + 1) - q_row0
        k_row0 = tl.load(CU_K + b)
        len_k = tl.load(CU_K + b + 1) - k_row0
    else:
        q_row0 = 0
        len_q = seqlen_q
        k_row0 = 0
        len_k = seqlen_k
    o_off, _ = _doc_offset(CU_Q, b, seqlen_q, stride_ob, stride_os, IS_VARLEN)
    l_off, _ = _doc_offset(CU_Q, b, seqlen_q, stride_lb, stride_ls, IS_VARLEN)
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q = _load_block(desc_q, q_row0 + m0, h, b, BLOCK_M, HEAD_DIM, IS_VARLEN)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    full, hi, diag = _kv_range(m0, len_q, len_k, IS_CAUSAL, BLOCK_M, BLOCK_N)
    # No early return here (Triton's Hopper warp specialization rejects the branch it makes): a
    # program past the end of a short document runs no iteration and stores nothing.
    full = tl.where(m0 < len_q, full, 0)
    hi = tl.where(m0 < len_q, hi, 0)
    acc, l_i, m_i = _fwd_inner_sm90(acc, l_i, m_i, q, desc_k, desc_v, b, kvh, k_row0, 0, full, rows, offs_n,
                                    len_k, diag, qk_scale, False, IS_CAUSAL, IS_VARLEN, BLOCK_N, HEAD_DIM,
                                    WARP_SPECIALIZE)
    acc, l_i, m_i = _fwd_inner_sm90(acc, l_i, m_i, q, desc_k, desc_v, b, kvh, k_row0, full, hi, rows, offs_n,
                                    len_k, diag, qk_scale, True, IS_CAUSAL, IS_VARLEN, BLOCK_N, HEAD_DIM,
                                    WARP_SPECIALIZE)
    # O is stored through pointers: a TMA store of a varlen block would overwrite the next document.
    _fwd_epilogue(acc, l_i, m_i, O, o_off + h * stride_oh + m0.to(tl.int64) * stride_os, stride_os, stride_od,
                  LSE, l_off + h * stride_lh, stride_ls, m0, len_q, HEAD_DIM, BLOCK_M, HEAD_DIM)


# ----------------------------------------------------------------------------- backward


@triton.jit
def _bwd_delta_kernel(
    O, DO, DELTA, CU_Q,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_dob, stride_dos, stride_doh, stride_dod,
    stride_lb, stride_lh, stride_ls,
    seqlen_q, n_heads, head_dim,
    IS_VARLEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // n_heads
    h = bh % n_heads
    o_off, len_q = _doc_offset(CU_Q, b, seqlen_q, stride_ob, stride_os, IS_VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= len_q:
        return
    do_off, _ = _doc_offset(CU_Q, b, seqlen_q, stride_dob, stride_dos, IS_VARLEN)
    l_off, _ = _doc_offset(CU_Q, b, seqlen_q, stride_lb, stride_ls, IS_VARLEN)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows = m0 + offs_m
    mask = (rows < len_q)[:, None] & (offs_d < head_dim)[None, :]
    m0_64 = m0.to(tl.int64)
    o = tl.load(O + o_off + h * stride_oh + m0_64 * stride_os + offs_m[:, None] * stride_os + offs_d[None, :] * stride_od,
                mask=mask, other=0.0)
    do = tl.load(DO + do_off + h * stride_doh + m0_64 * stride_dos + offs_m[:, None] * stride_dos
                 + offs_d[None, :] * stride_dod, mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + l_off + h * stride_lh + rows * stride_ls, delta, mask=rows < len_q)


@triton.jit
def _load_lse(ptrs, rmask):
    # Padding rows and rows with no visible key (lse = -inf) get +inf, so that P = exp(S - lse) = 0.
    lse = tl.load(ptrs, mask=rmask, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse) * _LOG2E


@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, lo, hi, offs_m, cols, mask_d,
                    len_q, diag, qk_scale, stride_qs, stride_dos, stride_ls,
                    MASKED: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        rmask = rows < len_q
        if EVEN_D:
            ld_mask = rmask[:, None]
        else:
            ld_mask = rmask[:, None] & mask_d[None, :]
        q = tl.load(q_ptrs, mask=ld_mask, other=0.0)
        do = tl.load(do_ptrs, mask=ld_mask, other=0.0)
        lse2 = _load_lse(lse_ptrs, rmask)
        delta = tl.load(delta_ptrs, mask=rmask, other=0.0)
        s_t = _dot(k, tl.trans(q), None, PRECISION, DOT_F32) * qk_scale  # (BLOCK_N, BLOCK_M), log2 units
        p_t = tl.math.exp2(s_t - lse2[None, :])
        if MASKED:
            p_t = tl.where(cols[:, None] <= rows[None, :] + diag, p_t, 0.0)
        dv = _dot(p_t.to(do.dtype), do, dv, PRECISION, DOT_F32)
        dp_t = _dot(v, tl.trans(do), None, PRECISION, DOT_F32)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = _dot(ds_t.to(q.dtype), q, dk, PRECISION, DOT_F32)
        q_ptrs += BLOCK_M * stride_qs
        do_ptrs += BLOCK_M * stride_dos
        lse_ptrs += BLOCK_M * stride_ls
        delta_ptrs += BLOCK_M * stride_ls
    return dk, dv, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, CU_Q, CU_K,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_dob, stride_dos, stride_doh, stride_dod,
    stride_dkb, stride_dks, stride_dkh, stride_dkd,
    stride_dvb, stride_dvs, stride_dvh, stride_dvd,
    stride_lb, stride_lh, stride_ls,
    seqlen_q, seqlen_k, n_kv_heads, group, head_dim, qk_scale, sm_scale, seq_bucket,
    IS_VARLEN: tl.constexpr, IS_CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
):
    pid_n = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // n_kv_heads
    kvh = bh % n_kv_heads
    k_off, len_k = _doc_offset(CU_K, b, seqlen_k, stride_kb, stride_ks, IS_VARLEN)
    n0 = pid_n * BLOCK_N
    if n0 >= len_k:
        return
    q_off, len_q = _doc_offset(CU_Q, b, seqlen_q, stride_qb, stride_qs, IS_VARLEN)
    v_off, _ = _doc_offset(CU_K, b, seqlen_k, stride_vb, stride_vs, IS_VARLEN)
    do_off, _ = _doc_offset(CU_Q, b, seqlen_q, stride_dob, stride_dos, IS_VARLEN)
    dk_off, _ = _doc_offset(CU_K, b, seqlen_k, stride_dkb, stride_dks, IS_VARLEN)
    dv_off, _ = _doc_offset(CU_K, b, seqlen_k, stride_dvb, stride_dvs, IS_VARLEN)
    l_off, _ = _doc_offset(CU_Q, b, seqlen_q, stride_lb, stride_ls, IS_VARLEN)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    cols = n0 + offs_n
    n0_64 = n0.to(tl.int64)
    kv_mask = (cols < len_k)[:, None] & mask_d[None, :]
    k = tl.load(K + k_off + kvh * stride_kh + n0_64 * stride_ks + offs_n[:, None] * stride_ks + offs_d[None, :] * stride_kd,
                mask=kv_mask, other=0.0)
    v = tl.load(V + v_off + kvh * stride_vh + n0_64 * stride_vs + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    diag = len_k - len_q
    if IS_CAUSAL:
        # Rows below n0 - diag see none of this key block; rows from n0 + BLOCK_N - 1 - diag see all of it.
        lo = (tl.maximum(n0 - diag, 0) // BLOCK_M) * BLOCK_M
        mid = tl.maximum(((tl.maximum(n0 + BLOCK_N - 1 - diag, 0) + BLOCK_M - 1) // BLOCK_M) * BLOCK_M, lo)
        mid_hi = tl.minimum(mid, len_q)
    else:
        lo = 0
        mid = 0
        mid_hi = 0
    lo_64 = tl.cast(lo, tl.int64)
    for g in range(group):
        h = kvh * group + g
        q_ptrs = Q + q_off + h * stride_qh + lo_64 * stride_qs + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd
        do_ptrs = DO + do_off + h * stride_doh + lo_64 * stride_dos + offs_m[:, None] * stride_dos + offs_d[None, :] * stride_dod
        lse_ptrs = LSE + l_off + h * stride_lh + (lo + offs_m) * stride_ls
        delta_ptrs = DELTA + l_off + h * stride_lh + (lo + offs_m) * stride_ls
        # The masked pass ends at a multiple of BLOCK_M >= mid_hi, where the unmasked pass begins (or
        # the unmasked pass is empty), so the advanced pointers carry over.
        dk, dv, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs = _bwd_dkdv_inner(
            dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, lo, mid_hi, offs_m, cols, mask_d,
            len_q, diag, qk_scale, stride_qs, stride_dos, stride_ls, True, EVEN_D, BLOCK_M, PRECISION, DOT_F32)
        dk, dv, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs = _bwd_dkdv_inner(
            dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, mid, len_q, offs_m, cols, mask_d,
            len_q, diag, qk_scale, stride_qs, stride_dos, stride_ls, False, EVEN_D, BLOCK_M, PRECISION, DOT_F32)
    dk = dk * sm_scale
    tl.store(DK + dk_off + kvh * stride_dkh + n0_64 * stride_dks + offs_n[:, None] * stride_dks + offs_d[None, :] * stride_dkd,
             dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + dv_off + kvh * stride_dvh + n0_64 * stride_dvs + offs_n[:, None] * stride_dvs + offs_d[None, :] * stride_dvd,
             dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _bwd_dq_inner(dq, q, do, lse2, delta, k_ptrs, v_ptrs, lo, hi, rows, offs_n, mask_d, len_k, diag, qk_scale,
                  stride_ks, stride_vs,
                  MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, EVEN_D: tl.constexpr,
                  BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if MASKED:
            kmask = (cols < len_k)[None, :]
            if not EVEN_D:
                kmask = kmask & mask_d[:, None]
            k_t = tl.load(k_ptrs, mask=kmask, other=0.0)
            v_t = tl.load(v_ptrs, mask=kmask, other=0.0)
        elif EVEN_D:
            k_t = tl.load(k_ptrs)
            v_t = tl.load(v_ptrs)
        else:
            k_t = tl.load(k_ptrs, mask=mask_d[:, None], other=0.0)
            v_t = tl.load(v_ptrs, mask=mask_d[:, None], other=0.0)
        s = _dot(q, k_t, None, PRECISION, DOT_F32) * qk_scale
        p = tl.math.exp2(s - lse2[:, None])
        if MASKED:
            valid = cols[None, :] < len_k
            if IS_CAUSAL:
                valid = valid & (cols[None, :] <= rows[:, None] + diag)
            p = tl.where(valid, p, 0.0)
        dp = _dot(do, v_t, None, PRECISION, DOT_F32)
        ds = p * (dp - delta[:, None])
        dq = _dot(ds.to(k_t.dtype), tl.trans(k_t), dq, PRECISION, DOT_F32)
        k_ptrs += BLOCK_N * stride_ks
        v_ptrs += BLOCK_N * stride_vs
    return dq, k_ptrs, v_ptrs


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, CU_Q, CU_K,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_dob, stride_dos, stride_doh, stride_dod,
    stride_dqb, stride_dqs, stride_dqh, stride_dqd,
    stride_lb, stride_lh, stride_ls,
    seqlen_q, seqlen_k, n_heads, group, head_dim, qk_scale, sm_scale, seq_bucket,
    IS_VARLEN: tl.constexpr, IS_CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // n_heads
    h = bh % n_heads
    kvh = h // group
    q_off, len_q = _doc_offset(CU_Q, b, seqlen_q, stride_qb, stride_qs, IS_VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= len_q:
        return
    k_off, len_k = _doc_offset(CU_K, b, seqlen_k, stride_kb, stride_ks, IS_VARLEN)
    v_off, _ = _doc_offset(CU_K, b, seqlen_k, stride_vb, stride_vs, IS_VARLEN)
    do_off, _ = _doc_offset(CU_Q, b, seqlen_q, stride_dob, stride_dos, IS_VARLEN)
    dq_off, _ = _doc_offset(CU_Q, b, seqlen_q, stride_dqb, stride_dqs, IS_VARLEN)
    l_off, _ = _doc_offset(CU_Q, b, seqlen_q, stride_lb, stride_ls, IS_VARLEN)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    rows = m0 + offs_m
    rmask = rows < len_q
    m0_64 = m0.to(tl.int64)
    ld_mask = rmask[:, None] & mask_d[None, :]
    q = tl.load(Q + q_off + h * stride_qh + m0_64 * stride_qs + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                mask=ld_mask, other=0.0)
    do = tl.load(DO + do_off + h * stride_doh + m0_64 * stride_dos + offs_m[:, None] * stride_dos
                 + offs_d[None, :] * stride_dod, mask=ld_mask, other=0.0)
    lse2 = _load_lse(LSE + l_off + h * stride_lh + rows * stride_ls, rmask)
    delta = tl.load(DELTA + l_off + h * stride_lh + rows * stride_ls, mask=rmask, other=0.0)
    k_ptrs = K + k_off + kvh * stride_kh + offs_n[None, :] * stride_ks + offs_d[:, None] * stride_kd  # K^T block
    v_ptrs = V + v_off + kvh * stride_vh + offs_n[None, :] * stride_vs + offs_d[:, None] * stride_vd  # V^T block
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    full, hi, diag = _kv_range(m0, len_q, len_k, IS_CAUSAL, BLOCK_M, BLOCK_N)
    dq, k_ptrs, v_ptrs = _bwd_dq_inner(dq, q, do, lse2, delta, k_ptrs, v_ptrs, 0, full, rows, offs_n, mask_d,
                                       len_k, diag, qk_scale, stride_ks, stride_vs, False, IS_CAUSAL, EVEN_D,
                                       BLOCK_N, PRECISION, DOT_F32)
    dq, k_ptrs, v_ptrs = _bwd_dq_inner(dq, q, do, lse2, delta, k_ptrs, v_ptrs, full, hi, rows, offs_n, mask_d,
                                       len_k, diag, qk_scale, stride_ks, stride_vs, True, IS_CAUSAL, EVEN_D,
                                       BLOCK_N, PRECISION, DOT_F32)
    dq = dq * sm_scale
    tl.store(DQ + dq_off + h * stride_dqh + m0_64 * stride_dqs + offs_m[:, None] * stride_dqs + offs_d[None, :] * stride_dqd,
             dq.to(DQ.dtype.element_ty), mask=ld_mask)


# ----------------------------------------------------------------------------- tiling and autotuning

# Fixed tiles under the interpreter: unequal, small tiles so the tests cross block, diagonal and
# sequence-end boundaries at small sizes.
INTERPRET_TILES = {"fwd": (64, 32), "dkdv": (32, 64), "dq": (64, 32)}
_AUTOTUNE_KEY = ["BLOCK_D", "IS_CAUSAL", "IS_VARLEN", "group", "seq_bucket"]


def _configs(pairs):
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in pairs]


# Kernels write every output element exactly once (no accumulation), so autotuning reruns are safe.
# The tiles were checked by compiling for sm_90a with Triton 3.9 (no GPU here): at head_dim 64 and
# 128 none spills registers except where noted; head_dim 256 spills in every tile (as expected for
# one-kernel FlashAttention-2 tiles), and autotuning picks the least bad one.
_fwd_tuned = triton.autotune(
    _configs([(128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 4)]),
    key=_AUTOTUNE_KEY,
)(_fwd_kernel)
_dkdv_tuned = triton.autotune(
    # (32, 128, 8, 3) spills a little at head_dim 128 but is the usual winner at 64.
    _configs([(32, 64, 8, 3), (16, 128, 8, 3), (32, 128, 8, 3), (64, 128, 8, 2), (64, 64, 8, 3), (32, 64, 4, 3)]),
    key=_AUTOTUNE_KEY,
)(_bwd_dkdv_kernel)
_dq_tuned = triton.autotune(
    _configs([(128, 32, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3)]),
    key=_AUTOTUNE_KEY,
)(_bwd_dq_kernel)


def _sm90_pre_hook(nargs):
    bm, bn, d = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["HEAD_DIM"]
    varlen = nargs["IS_VARLEN"]
    nargs["desc_q"].block_shape = [bm, 1, d] if varlen else [1, bm, 1, d]
    nargs["desc_k"].block_shape = [bn, 1, d] if varlen else [1, bn, 1, d]
    nargs["desc_v"].block_shape = [bn, 1, d] if varlen else [1, bn, 1, d]


# Checked by compiling for sm_90a with Triton 3.9 (no GPU run): warp specialization partitions the
# key loop only with 4 warps and 64x64 tiles (128-row tiles fail in its pass); the other tiles fit
# the 227 KiB of shared memory without spills.
_SM90_TILES = [  # (BLOCK_M, BLOCK_N, num_warps, num_stages, warp_specialize); the first is the default
    (128, 128, 8, 2, False), (64, 64, 4, 2, True), (64, 64, 4, 3, True), (128, 64, 8, 3, False), (64, 64, 4, 3, False),
]


def _sm90_configs():
    ws_ok = _tl_range_has_warp_specialize()
    seen, out = set(), []
    for m, n, w, s, ws in _SM90_TILES:
        key = (m, n, w, s, ws and ws_ok)
        if key not in seen:
            seen.add(key)
            out.append(triton.Config({"BLOCK_M": m, "BLOCK_N": n, "WARP_SPECIALIZE": key[-1]}, num_warps=w,
                                     num_stages=s, pre_hook=_sm90_pre_hook))
    return out


AUTOTUNE_ENV = "TITAN_KERNELS_AUTOTUNE"


def _launch(tuned, grid, args, meta) -> None:
    """Launch an autotuned kernel, or with its first config when ``TITAN_KERNELS_AUTOTUNE=0``."""
    if os.environ.get(AUTOTUNE_ENV, "1") != "0":
        tuned[grid](*args, **meta)
        return
    cfg = tuned.configs[0]
    kw = {**meta, **cfg.kwargs}
    if cfg.pre_hook is not None:
        cfg.pre_hook({**dict(zip(tuned.fn.arg_names, args)), **kw})
    tuned.fn[grid(kw)](*args, **kw, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _seq_bucket(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs: full-precision products (TF32 would cost ~1e-3 relative error on CUDA).
    return "ieee" if dtype == torch.float32 else "tf32"


def _dot_f32(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and triton_interpret()


def _strides4(t: torch.Tensor, varlen: bool) -> tuple[int, int, int, int]:
    """(batch, seq, head, dim) strides; a varlen (total, head, dim) tensor has no batch stride."""
    return (0, *t.stride()) if varlen else tuple(t.stride())


def _lse_strides(lse: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    return (0, *lse.stride()) if varlen else tuple(lse.stride())


def _dims(q: torch.Tensor, k: torch.Tensor, cu_seqlens_q: torch.Tensor | None, max_seqlen_q: int, max_seqlen_k: int):
    """(varlen, batch, seq_q, seq_k, n_heads, n_kv_heads, head_dim); seq_* are the grid extents."""
    if cu_seqlens_q is not None:
        return True, cu_seqlens_q.numel() - 1, int(max_seqlen_q), int(max_seqlen_k), q.shape[1], k.shape[1], q.shape[2]
    return False, q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3]


def _dummy_cu(t: torch.Tensor, cu: torch.Tensor | None) -> torch.Tensor:
    return cu if cu is not None else t  # never read when IS_VARLEN is False


# ----------------------------------------------------------------------------- Hopper path selection


@functools.lru_cache(maxsize=None)
def _tl_range_has_warp_specialize() -> bool:
    try:
        return "warp_specialize" in inspect.signature(tl.range.__init__).parameters
    except (TypeError, ValueError):
        return False


@functools.lru_cache(maxsize=None)
def _tensor_descriptor_cls():
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None
    return TensorDescriptor


_sm90_disabled_reason: str | None = None


def _aligned16(t: torch.Tensor) -> bool:
    es = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all((s * es) % 16 == 0 for s in t.stride()[:-1])


def sm90_eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """True when the Hopper forward kernel takes this case: an sm_90 device, bf16/fp16, head_dim 64,
    128 or 256, unit stride on head_dim and 16-byte aligned strides (TMA descriptor rules)."""
    if _sm90_disabled_reason is not None or _tensor_descriptor_cls() is None:
        return False
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or q.shape[-1] not in (64, 128, 256):
        return False
    return all(_aligned16(t) for t in (q, k, v))


def _descriptor(t: torch.Tensor, varlen: bool, rows: int, head_dim: int):
    cls = _tensor_descriptor_cls()
    block = [rows, 1, head_dim] if varlen else [1, rows, 1, head_dim]
    return cls(t, list(t.shape), list(t.stride()), block)


@functools.lru_cache(maxsize=None)
def _fwd_sm90_tuned():
    return triton.autotune(_sm90_configs(), key=_AUTOTUNE_KEY[1:] + ["HEAD_DIM"])(_fwd_kernel_sm90)


def _launch_fwd_sm90(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dims, causal, qk_scale, tiles=None):
    varlen, batch, seq_q, seq_k, h, hkv, d = dims
    so, sl = _strides4(out, varlen), _lse_strides(lse, varlen)
    args = (
        out, lse, _dummy_cu(lse, cu_seqlens_q), _dummy_cu(lse, cu_seqlens_k), *so, *sl,
        seq_q, seq_k, h, h // hkv, qk_scale, _seq_bucket(seq_q),
    )
    if tiles is not None:  # fixed tiles (the interpreter, in tests)
        bm, bn = tiles
        ws = _tl_range_has_warp_specialize()
        descs = (_descriptor(q, varlen, bm, d), _descriptor(k, varlen, bn, d), _descriptor(v, varlen, bn, d))
        _fwd_kernel_sm90[(triton.cdiv(seq_q, bm), batch * h)](
            *descs, *args, IS_VARLEN=varlen, IS_CAUSAL=causal, BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=d,
            WARP_SPECIALIZE=ws)
        return
    descs = (_descriptor(q, varlen, 64, d), _descriptor(k, varlen, 64, d), _descriptor(v, varlen, 64, d))
    grid = lambda meta: (triton.cdiv(seq_q, meta["BLOCK_M"]), batch * h)  # noqa: E731
    _launch(_fwd_sm90_tuned(), grid, (*descs, *args), dict(IS_VARLEN=varlen, IS_CAUSAL=causal, HEAD_DIM=d))


# ----------------------------------------------------------------------------- launchers


def _launch_fwd_portable(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dims, causal, qk_scale):
    varlen, batch, seq_q, seq_k, h, hkv, d = dims
    block_d = max(16, triton.next_power_of_2(d))
    args = (
        q, k, v, out, lse, _dummy_cu(q, cu_seqlens_q), _dummy_cu(q, cu_seqlens_k),
        *_strides4(q, varlen), *_strides4(k, varlen), *_strides4(v, varlen), *_strides4(out, varlen),
        *_lse_strides(lse, varlen),
        seq_q, seq_k, h, h // hkv, d, qk_scale, _seq_bucket(seq_q),
    )
    meta = dict(IS_VARLEN=varlen, IS_CAUSAL=causal, BLOCK_D=block_d, EVEN_D=block_d == d,
                PRECISION=_precision(q.dtype), DOT_F32=_dot_f32(q.dtype))
    if triton_interpret():
        bm, bn = INTERPRET_TILES["fwd"]
        _fwd_kernel[(triton.cdiv(seq_q, bm), batch * h)](*args, BLOCK_M=bm, BLOCK_N=bn, **meta)
    else:
        grid = lambda m: (triton.cdiv(seq_q, m["BLOCK_M"]), batch * h)  # noqa: E731
        _launch(_fwd_tuned, grid, args, meta)


def attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton forward; same contract as ``titan_kernels.reference.attention.attention_fwd``.

    Returns a contiguous out in q.dtype and a contiguous float32 lse. On an sm_90 device the Hopper
    kernel runs where it takes the case (``sm90_eligible``); if it fails to compile there, a warning
    is issued once and the portable kernel is used from then on.
    """
    global _sm90_disabled_reason
    dims = _dims(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    varlen, batch, seq_q, seq_k, h, hkv, d = dims
    if varlen:
        # Rows outside every document (only possible with unvalidated cu_seqlens) read as 0 / -inf.
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.full((h, q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    else:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty((batch, h, seq_q), dtype=torch.float32, device=q.device)
    if batch == 0 or h == 0 or seq_q == 0 or out.numel() == 0:
        return out, lse
    qk_scale = float(softmax_scale) * LOG2E
    if sm90_eligible(q, k, v):
        try:
            _launch_fwd_sm90(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dims, causal, qk_scale)
            return out, lse
        except Exception as e:  # a compiler without this Hopper support: keep working, loudly
            _sm90_disabled_reason = f"{type(e).__name__}: {e}"
            warnings.warn(
                f"titan flash_attn: the sm_90 Triton forward kernel failed ({_sm90_disabled_reason}); "
                "using the portable Triton kernel from now on",
                RuntimeWarning,
                stacklevel=2,
            )
    _launch_fwd_portable(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dims, causal, qk_scale)
    return out, lse


def attention_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    softmax_scale: float,
    dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton backward; same contract as ``titan_kernels.reference.attention.attention_bwd``.

    dq, dk, dv are fresh contiguous tensors in the dtypes of q, k, v (float32 accumulation).
    """
    dims = _dims(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    varlen, batch, seq_q, seq_k, h, hkv, d = dims
    alloc = torch.zeros if varlen else torch.empty  # varlen rows outside every document stay 0
    dq = alloc(q.shape, dtype=q.dtype, device=q.device)
    dk = alloc(k.shape, dtype=k.dtype, device=k.device)
    dv = alloc(v.shape, dtype=v.dtype, device=v.device)
    if batch == 0 or h == 0 or dq.numel() + dk.numel() == 0:
        return dq, dk, dv
    if seq_q == 0 or seq_k == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    lse = lse.contiguous()
    delta = torch.empty_like(lse)
    cu_q, cu_k = _dummy_cu(q, cu_seqlens_q), _dummy_cu(q, cu_seqlens_k)
    sl = _lse_strides(lse, varlen)
    block_d = max(16, triton.next_power_of_2(d))
    precision = _precision(q.dtype)
    qk_scale = float(softmax_scale) * LOG2E
    group = h // hkv
    interp = triton_interpret()

    bm = 64
    _bwd_delta_kernel[(triton.cdiv(seq_q, bm), batch * h)](
        out, dout, delta, cu_q, *_strides4(out, varlen), *_strides4(dout, varlen), *sl,
        seq_q, h, d, IS_VARLEN=varlen, BLOCK_M=bm, BLOCK_D=block_d,
    )
    if dlse is not None:
        delta.sub_(dlse)  # dS = P * (dP - delta + dlse): an LSE gradient only shifts delta
    meta = dict(IS_VARLEN=varlen, IS_CAUSAL=causal, BLOCK_D=block_d, EVEN_D=block_d == d, PRECISION=precision,
                DOT_F32=_dot_f32(q.dtype))
    qkv_strides = (*_strides4(q, varlen), *_strides4(k, varlen), *_strides4(v, varlen), *_strides4(dout, varlen))
    dkdv_args = (
        q, k, v, dout, lse, delta, dk, dv, cu_q, cu_k, *qkv_strides,
        *_strides4(dk, varlen), *_strides4(dv, varlen), *sl,
        seq_q, seq_k, hkv, group, d, qk_scale, float(softmax_scale), _seq_bucket(seq_k),
    )
    dq_args = (
        q, k, v, dout, lse, delta, dq, cu_q, cu_k, *qkv_strides, *_strides4(dq, varlen), *sl,
        seq_q, seq_k, h, group, d, qk_scale, float(softmax_scale), _seq_bucket(seq_q),
    )
    if interp:
        bm, bn = INTERPRET_TILES["dkdv"]
        _bwd_dkdv_kernel[(triton.cdiv(seq_k, bn), batch * hkv)](*dkdv_args, BLOCK_M=bm, BLOCK_N=bn, **meta)
        bm, bn = INTERPRET_TILES["dq"]
        _bwd_dq_kernel[(triton.cdiv(seq_q, bm), batch * h)](*dq_args, BLOCK_M=bm, BLOCK_N=bn, **meta)
    else:
        _launch(_dkdv_tuned, lambda m: (triton.cdiv(seq_k, m["BLOCK_N"]), batch * hkv), dkdv_args, meta)
        _launch(_dq_tuned, lambda m: (triton.cdiv(seq_q, m["BLOCK_M"]), batch * h), dq_args, meta)
    return dq, dk, dv
