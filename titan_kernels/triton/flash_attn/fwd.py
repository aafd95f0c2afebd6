"""The portable FlashAttention forward kernel (any CUDA GPU Triton supports, and the interpreter).

Math: FlashAttention-2 (Dao 2023, "FlashAttention-2: Faster Attention with Better Parallelism and
Work Partitioning", Alg. 1): one program per (query block, batch, head) keeps its Q block on chip
and streams the K/V blocks of its (KV) head, with an online softmax (float32 running max, sum and
accumulator) and the log-sum-exp written for the backward.

  _fwd_inner    the loop over key blocks [lo, hi); MASKED adds the sequence-end and window/chunk masks;
                soft-capping (SOFTCAP) on the scores.
  _fwd_kernel   three passes over the key blocks the query block can see (tiles._kv_range; blocks
                outside a window or chunk are never loaded): a masked lower edge (windows, chunks),
                the blocks every query of the block fully sees (no mask), then those on the causal
                diagonal / upper edge or the sequence end (masked). GQA: head h reads
                KV head h // group, K/V never repeated. Any strides (head_dim's too); EVEN_D skips
                the head_dim mask when head_dim fills BLOCK_D (a power of two >= 16), EVEN_DV the same
                for v's head_dim (BLOCK_DV), which may differ from q/k's.
  _fwd_tuned    its autotuner (configs: tiles._configs; the launcher is ``flash_attn.attention_fwd``).
"""
from __future__ import annotations

import triton
import triton.language as tl

from titan_kernels.triton.flash_attn.tiles import (
    _AUTOTUNE_KEY,
    _configs,
    _doc_offset,
    _dot,
    _fwd_epilogue,
    _kv_range,
    _softmax_step,
)


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_ptrs, v_ptrs, lo, hi, rows, offs_n, mask_d, mask_dv, len_k, diag, qk_scale,
               sm_scale, softcap, left, right, chunk, stride_ks, stride_vs,
               MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_CHUNK: tl.constexpr,
               SOFTCAP: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
               BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if MASKED:
            kmask = (cols < len_k)[None, :]
            vmask = (cols < len_k)[:, None]
            if not EVEN_D:
                kmask = kmask & mask_d[:, None]
            if not EVEN_DV:
                vmask = vmask & mask_dv[None, :]
            k = tl.load(k_ptrs, mask=kmask, other=0.0)
        elif EVEN_D:
            k = tl.load(k_ptrs)
        else:
            k = tl.load(k_ptrs, mask=mask_d[:, None], other=0.0)
        p, acc, l_i, m_i = _softmax_step(_dot(q, k, None, PRECISION, DOT_F32), m_i, l_i, acc, rows, cols, len_k, diag,
                                         qk_scale, sm_scale, softcap, left, right, chunk, MASKED, IS_CAUSAL, HAS_LEFT,
                                         HAS_CHUNK, SOFTCAP)
        if MASKED:
            v = tl.load(v_ptrs, mask=vmask, other=0.0)
        elif EVEN_DV:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=mask_dv[None, :], other=0.0)
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
    o_off, _ = _doc_offset(CU_Q, b, seqlen_q, stride_ob, stride_os, IS_VARLEN)
    l_off, _ = _doc_offset(CU_Q, b, seqlen_q, stride_lb, stride_ls, IS_VARLEN)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < head_dim
    mask_dv = offs_dv < head_dim_v
    rows = m0 + offs_m
    m0_64 = m0.to(tl.int64)

    q_ptrs = Q + q_off + h * stride_qh + m0_64 * stride_qs + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=(rows < len_q)[:, None] & mask_d[None, :], other=0.0)
    k_ptrs = K + k_off + kvh * stride_kh + offs_n[None, :] * stride_ks + offs_d[:, None] * stride_kd  # K^T block
    v_ptrs = V + v_off + kvh * stride_vh + offs_n[:, None] * stride_vs + offs_dv[None, :] * stride_vd

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    lo, lo_full, hi_full, hi, diag = _kv_range(m0, len_q, len_k, left, right, chunk, IS_CAUSAL, HAS_LEFT, HAS_CHUNK,
                                               BLOCK_M, BLOCK_N)
    lo_64 = lo.to(tl.int64)
    k_ptrs += lo_64 * stride_ks
    v_ptrs += lo_64 * stride_vs
    # Three passes over the keys: masked at a window's or chunk's lower edge (only with one), every
    # key seen by every row (no mask), masked at the upper edge / causal diagonal and the end.
    if HAS_LEFT or HAS_CHUNK:
        acc, l_i, m_i, k_ptrs, v_ptrs = _fwd_inner(
            acc, l_i, m_i, q, k_ptrs, v_ptrs, lo, lo_full, rows, offs_n, mask_d, mask_dv, len_k, diag, qk_scale,
            sm_scale, softcap, left, right, chunk, stride_ks, stride_vs, True, IS_CAUSAL, HAS_LEFT, HAS_CHUNK,
            SOFTCAP, EVEN_D, EVEN_DV, BLOCK_N, PRECISION, DOT_F32)
    acc, l_i, m_i, k_ptrs, v_ptrs = _fwd_inner(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, lo_full, hi_full, rows, offs_n, mask_d, mask_dv, len_k, diag, qk_scale,
        sm_scale, softcap, left, right, chunk, stride_ks, stride_vs, False, IS_CAUSAL, HAS_LEFT, HAS_CHUNK,
        SOFTCAP, EVEN_D, EVEN_DV, BLOCK_N, PRECISION, DOT_F32)
    acc, l_i, m_i, k_ptrs, v_ptrs = _fwd_inner(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, hi_full, hi, rows, offs_n, mask_d, mask_dv, len_k, diag, qk_scale,
        sm_scale, softcap, left, right, chunk, stride_ks, stride_vs, True, IS_CAUSAL, HAS_LEFT, HAS_CHUNK,
        SOFTCAP, EVEN_D, EVEN_DV, BLOCK_N, PRECISION, DOT_F32)
    _fwd_epilogue(acc, l_i, m_i, O, o_off + h * stride_oh + m0_64 * stride_os, stride_os, stride_od,
                  LSE, l_off + h * stride_lh, stride_ls, m0, len_q, head_dim_v, BLOCK_M, BLOCK_DV)


_fwd_tuned = triton.autotune(
    _configs([(128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 4)]),
    key=_AUTOTUNE_KEY,
)(_fwd_kernel)
