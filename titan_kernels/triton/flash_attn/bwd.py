"""The FlashAttention backward kernels: preprocess (delta), dK/dV and dQ.

Math: FlashAttention-2 (Dao 2023, Alg. 2): P is recomputed block by block from Q, K and the
forward's log-sum-exp, never stored; with delta = rowsum(dO * O) (the preprocess),
dV = P^T dO, dP = dO V^T, dS = P * (dP - delta) (soft-capping: times 1 - tanh^2 of the capped score),
dK = dS^T Q * scale, dQ = dS K * scale. The paper's single kernel adds dQ atomically; here dQ has its
own kernel (a second pass over the key blocks), so nothing is accumulated atomically and every
output element is written once. Blocks outside a window or chunk are never visited.

  _bwd_delta_kernel  delta = rowsum(dO * O) in float32, one program per (query block, batch, head).
  _bwd_dkdv_kernel   one program per (key block, batch, KV head); loops over the query heads of its
                     GQA group and over the query blocks that see the key block (tiles._q_range:
                     masked near the causal diagonal, then unmasked; with a window or chunk one loop
                     that masks only its two edge regions), so dK/dV need no atomics and K/V are never
                     repeated.
  _bwd_dq_kernel     one program per (query block, batch, head); loops over key blocks
                     (tiles._kv_range splits them into masked and unmasked passes).
  _dkdv_tuned, _dq_tuned   their autotuners (configs: tiles._configs; the launcher is
                     ``flash_attn.attention_bwd``).

A row with no visible key has lse = -inf; it is read as +inf, so that P = 0 there.
"""
from __future__ import annotations

import triton
import triton.language as tl

from titan_kernels.triton.flash_attn.tiles import (
    _AUTOTUNE_KEY,
    _LOG2E,
    _configs,
    _doc_offset,
    _dot,
    _kv_range,
    _q_range,
    _scores,
    _visible,
)


@triton.jit
def _bwd_delta_kernel(
    O, DO, DELTA, CU_Q,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_dob, stride_dos, stride_doh, stride_dod,
    stride_lb, stride_lh, stride_ls,
    seqlen_q, n_heads, head_dim_v,
    IS_VARLEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
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
    offs_d = tl.arange(0, BLOCK_DV)
    rows = m0 + offs_m
    mask = (rows < len_q)[:, None] & (offs_d < head_dim_v)[None, :]
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
def _bwd_dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, lo, hi, lo_full, hi_full, offs_m, cols,
                    mask_d, mask_dv, len_q, diag, qk_scale, sm_scale, softcap, left, right, chunk, stride_qs,
                    stride_dos, stride_ls,
                    MASKED: tl.constexpr, DYNAMIC: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr,
                    HAS_CHUNK: tl.constexpr, SOFTCAP: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
                    BLOCK_M: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    # MASKED: every block masked. DYNAMIC: one loop over [lo, hi) that masks only the blocks outside
    # [lo_full, hi_full) (a window's or chunk's two edges in one loop: three loops spill registers).
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        rmask = rows < len_q
        if EVEN_D:
            q_mask = rmask[:, None]
        else:
            q_mask = rmask[:, None] & mask_d[None, :]
        if EVEN_DV:
            do_mask = rmask[:, None]
        else:
            do_mask = rmask[:, None] & mask_dv[None, :]
        q = tl.load(q_ptrs, mask=q_mask, other=0.0)
        do = tl.load(do_ptrs, mask=do_mask, other=0.0)
        lse2 = _load_lse(lse_ptrs, rmask)
        delta = tl.load(delta_ptrs, mask=rmask, other=0.0)
        # (BLOCK_N, BLOCK_M), log2 units
        s_t, t_t = _scores(_dot(k, tl.trans(q), None, PRECISION, DOT_F32), sm_scale, qk_scale, softcap, SOFTCAP)
        p_t = tl.math.exp2(s_t - lse2[None, :])
        if MASKED:
            p_t = tl.where(_visible(rows[None, :] + diag, cols[:, None], left, right, chunk, IS_CAUSAL, HAS_LEFT,
                                    HAS_CHUNK), p_t, 0.0)
        elif DYNAMIC:
            if (start_m < lo_full) | (start_m >= hi_full):
                p_t = tl.where(_visible(rows[None, :] + diag, cols[:, None], left, right, chunk, IS_CAUSAL,
                                        HAS_LEFT, HAS_CHUNK), p_t, 0.0)
        p_lo = p_t.to(do.dtype)
        if SOFTCAP:
            # The tanh's derivative folded into P for dS at once, so the tanh tile dies here (registers).
            p_t = p_t * (1.0 - t_t * t_t)
        dv = _dot(p_lo, do, dv, PRECISION, DOT_F32)
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
    seqlen_q, seqlen_k, n_kv_heads, group, head_dim, head_dim_v, qk_scale, sm_scale, softcap, left, right, chunk,
    seq_bucket,
    IS_VARLEN: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_CHUNK: tl.constexpr,
    SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, EVEN_DV: tl.constexpr,
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
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < head_dim
    mask_dv = offs_dv < head_dim_v
    cols = n0 + offs_n
    n0_64 = n0.to(tl.int64)
    k_mask = (cols < len_k)[:, None] & mask_d[None, :]
    v_mask = (cols < len_k)[:, None] & mask_dv[None, :]
    k = tl.load(K + k_off + kvh * stride_kh + n0_64 * stride_ks + offs_n[:, None] * stride_ks + offs_d[None, :] * stride_kd,
                mask=k_mask, other=0.0)
    v = tl.load(V + v_off + kvh * stride_vh + n0_64 * stride_vs + offs_n[:, None] * stride_vs + offs_dv[None, :] * stride_vd,
                mask=v_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    # The query rows that see this key block (tiles._q_range): [lo, lo_full) a masked edge at the
    # causal diagonal / a window's upper bound, [lo_full, hi_full) rows that see every key of the block
    # (no mask), [hi_full, hi) a masked edge at a window's lower bound / chunk end. Consecutive
    # passes, so the advanced pointers carry over.
    lo, lo_full, hi_full, hi = _q_range(n0, len_q, len_k, left, right, chunk, IS_CAUSAL, HAS_LEFT, HAS_CHUNK,
                                        BLOCK_N, BLOCK_M)
    diag = len_k - len_q
    lo_64 = tl.cast(lo, tl.int64)
    for g in range(group):
        h = kvh * group + g
        q_ptrs = Q + q_off + h * stride_qh + lo_64 * stride_qs + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd
        do_ptrs = DO + do_off + h * stride_doh + lo_64 * stride_dos + offs_m[:, None] * stride_dos + offs_dv[None, :] * stride_dod
        lse_ptrs = LSE + l_off + h * stride_lh + (lo + offs_m) * stride_ls
        delta_ptrs = DELTA + l_off + h * stride_lh + (lo + offs_m) * stride_ls
        if HAS_LEFT or HAS_CHUNK:
            dk, dv, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs = _bwd_dkdv_inner(
                dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, lo, hi, lo_full, hi_full, offs_m, cols, mask_d,
                mask_dv, len_q, diag, qk_scale, sm_scale, softcap, left, right, chunk, stride_qs, stride_dos,
                stride_ls, False, True, IS_CAUSAL, HAS_LEFT, HAS_CHUNK, SOFTCAP, EVEN_D, EVEN_DV, BLOCK_M,
                PRECISION, DOT_F32)
        else:  # masked near the diagonal, then unmasked to the end (padding rows have P = 0)
            dk, dv, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs = _bwd_dkdv_inner(
                dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, lo, lo_full, lo_full, hi_full, offs_m, cols,
                mask_d, mask_dv, len_q, diag, qk_scale, sm_scale, softcap, left, right, chunk, stride_qs,
                stride_dos, stride_ls, True, False, IS_CAUSAL, HAS_LEFT, HAS_CHUNK, SOFTCAP, EVEN_D, EVEN_DV,
                BLOCK_M, PRECISION, DOT_F32)
            dk, dv, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs = _bwd_dkdv_inner(
                dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, lo_full, hi, lo_full, hi_full, offs_m, cols,
                mask_d, mask_dv, len_q, diag, qk_scale, sm_scale, softcap, left, right, chunk, stride_qs,
                stride_dos, stride_ls, False, False, IS_CAUSAL, HAS_LEFT, HAS_CHUNK, SOFTCAP, EVEN_D, EVEN_DV,
                BLOCK_M, PRECISION, DOT_F32)
    dk = dk * sm_scale
    tl.store(DK + dk_off + kvh * stride_dkh + n0_64 * stride_dks + offs_n[:, None] * stride_dks + offs_d[None, :] * stride_dkd,
             dk.to(DK.dtype.element_ty), mask=k_mask)
    tl.store(DV + dv_off + kvh * stride_dvh + n0_64 * stride_dvs + offs_n[:, None] * stride_dvs + offs_dv[None, :] * stride_dvd,
             dv.to(DV.dtype.element_ty), mask=v_mask)


@triton.jit
def _bwd_dq_inner(dq, q, do, lse2, delta, k_ptrs, v_ptrs, lo, hi, rows, offs_n, mask_d, mask_dv, len_k, diag,
                  qk_scale, sm_scale, softcap, left, right, chunk, stride_ks, stride_vs,
                  MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_CHUNK: tl.constexpr,
                  SOFTCAP: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
                  BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if MASKED:
            kmask = (cols < len_k)[None, :]
            vmask = kmask
            if not EVEN_D:
                kmask = kmask & mask_d[:, None]
            if not EVEN_DV:
                vmask = vmask & mask_dv[:, None]
            k_t = tl.load(k_ptrs, mask=kmask, other=0.0)
            v_t = tl.load(v_ptrs, mask=vmask, other=0.0)
        else:
            if EVEN_D:
                k_t = tl.load(k_ptrs)
            else:
                k_t = tl.load(k_ptrs, mask=mask_d[:, None], other=0.0)
            if EVEN_DV:
                v_t = tl.load(v_ptrs)
            else:
                v_t = tl.load(v_ptrs, mask=mask_dv[:, None], other=0.0)
        s, t = _scores(_dot(q, k_t, None, PRECISION, DOT_F32), sm_scale, qk_scale, softcap, SOFTCAP)
        p = tl.math.exp2(s - lse2[:, None])
        if MASKED:
            valid = (cols[None, :] < len_k) & _visible(rows[:, None] + diag, cols[None, :], left, right, chunk,
                                                       IS_CAUSAL, HAS_LEFT, HAS_CHUNK)
            p = tl.where(valid, p, 0.0)
        dp = _dot(do, v_t, None, PRECISION, DOT_F32)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
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
    seqlen_q, seqlen_k, n_heads, group, head_dim, head_dim_v, qk_scale, sm_scale, softcap, left, right, chunk,
    seq_bucket,
    IS_VARLEN: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_CHUNK: tl.constexpr,
    SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, EVEN_DV: tl.constexpr,
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
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < head_dim
    mask_dv = offs_dv < head_dim_v
    rows = m0 + offs_m
    rmask = rows < len_q
    m0_64 = m0.to(tl.int64)
    ld_mask = rmask[:, None] & mask_d[None, :]
    q = tl.load(Q + q_off + h * stride_qh + m0_64 * stride_qs + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                mask=ld_mask, other=0.0)
    do = tl.load(DO + do_off + h * stride_doh + m0_64 * stride_dos + offs_m[:, None] * stride_dos
                 + offs_dv[None, :] * stride_dod, mask=rmask[:, None] & mask_dv[None, :], other=0.0)
    lse2 = _load_lse(LSE + l_off + h * stride_lh + rows * stride_ls, rmask)
    delta = tl.load(DELTA + l_off + h * stride_lh + rows * stride_ls, mask=rmask, other=0.0)
    k_ptrs = K + k_off + kvh * stride_kh + offs_n[None, :] * stride_ks + offs_d[:, None] * stride_kd  # K^T block
    v_ptrs = V + v_off + kvh * stride_vh + offs_n[None, :] * stride_vs + offs_dv[:, None] * stride_vd  # V^T block
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, lo_full, hi_full, hi, diag = _kv_range(m0, len_q, len_k, left, right, chunk, IS_CAUSAL, HAS_LEFT, HAS_CHUNK,
                                               BLOCK_M, BLOCK_N)
    lo_64 = lo.to(tl.int64)
    k_ptrs += lo_64 * stride_ks
    v_ptrs += lo_64 * stride_vs
    if HAS_LEFT or HAS_CHUNK:
        dq, k_ptrs, v_ptrs = _bwd_dq_inner(dq, q, do, lse2, delta, k_ptrs, v_ptrs, lo, lo_full, rows, offs_n, mask_d,
                                           mask_dv, len_k, diag, qk_scale, sm_scale, softcap, left, right, chunk,
                                           stride_ks, stride_vs, True, IS_CAUSAL, HAS_LEFT, HAS_CHUNK, SOFTCAP,
                                           EVEN_D, EVEN_DV, BLOCK_N, PRECISION, DOT_F32)
    dq, k_ptrs, v_ptrs = _bwd_dq_inner(dq, q, do, lse2, delta, k_ptrs, v_ptrs, lo_full, hi_full, rows, offs_n, mask_d,
                                       mask_dv, len_k, diag, qk_scale, sm_scale, softcap, left, right, chunk,
                                       stride_ks, stride_vs, False, IS_CAUSAL, HAS_LEFT, HAS_CHUNK, SOFTCAP,
                                       EVEN_D, EVEN_DV, BLOCK_N, PRECISION, DOT_F32)
    dq, k_ptrs, v_ptrs = _bwd_dq_inner(dq, q, do, lse2, delta, k_ptrs, v_ptrs, hi_full, hi, rows, offs_n, mask_d,
                                       mask_dv, len_k, diag, qk_scale, sm_scale, softcap, left, right, chunk,
                                       stride_ks, stride_vs, True, IS_CAUSAL, HAS_LEFT, HAS_CHUNK, SOFTCAP,
                                       EVEN_D, EVEN_DV, BLOCK_N, PRECISION, DOT_F32)
    dq = dq * sm_scale
    tl.store(DQ + dq_off + h * stride_dqh + m0_64 * stride_dqs + offs_m[:, None] * stride_dqs + offs_d[None, :] * stride_dqd,
             dq.to(DQ.dtype.element_ty), mask=ld_mask)


_dkdv_tuned = triton.autotune(
    # (32, 128, 8, 3) spills a little at head_dim 128 but is the usual winner at 64.
    _configs([(32, 64, 8, 3), (16, 128, 8, 3), (32, 128, 8, 3), (64, 128, 8, 2), (64, 64, 8, 3), (32, 64, 4, 3)]),
    key=_AUTOTUNE_KEY,
)(_bwd_dkdv_kernel)
_dq_tuned = triton.autotune(
    _configs([(128, 32, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3)]),
    key=_AUTOTUNE_KEY,
)(_bwd_dq_kernel)
