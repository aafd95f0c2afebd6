"""The Hopper (sm_90) FlashAttention forward: TMA loads and, where Triton offers it, warp specialization.

Selected only on capability (9, 0) with bf16/fp16, q/k and v head_dims each 64/128/256 (they may
differ) and 16-byte-aligned strides
(``flash_attn.sm90_eligible``); the backward uses the portable kernels. The math is the
FlashAttention-2 forward (Dao 2023, Alg. 1, as in ``fwd``); what is Hopper's comes from
FlashAttention-3 (Shah et al. 2024, "FlashAttention-3: Fast and Accurate Attention with Asynchrony
and Low-precision"): Q/K/V blocks arrive through TMA tensor descriptors, and the key loop is
warp-specialised (producer warps load while consumer warps compute) when this Triton's ``tl.range``
takes ``warp_specialize``. FA3's pingpong scheduling, intra-warpgroup GEMM/softmax overlap and FP8
path are not implemented here.

  _load_block          a (rows, head_dim) block through a 3-D varlen or 4-D dense descriptor.
  _fwd_inner_sm90      the key-block loop (masked or not), as fwd._fwd_inner.
  _fwd_kernel_sm90     one program per (query block, batch, head); O is stored through pointers.
  _fwd_sm90_tuned      its autotuner, built on first use (configs: _SM90_TILES).
  _descriptor, _aligned16, _tensor_descriptor_cls, _tl_range_has_warp_specialize   host-side TMA
                       descriptors and what this Triton and these tensors allow.
"""
from __future__ import annotations

import functools
import inspect

import torch
import triton
import triton.language as tl

from titan_kernels.triton.flash_attn.tiles import _AUTOTUNE_KEY, _doc_offset, _fwd_epilogue, _kv_range, _softmax_step

# ----------------------------------------------------------------------------- kernel


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
def _fwd_step_sm90(acc, l_i, m_i, q, desc_k, desc_v, b, kvh, k_row0, start_n, rows, offs_n, len_k, diag,
                   qk_scale, sm_scale, softcap, left, right, chunk,
                   MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_CHUNK: tl.constexpr,
                   SOFTCAP: tl.constexpr, IS_VARLEN: tl.constexpr,
                   BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr):
    k = _load_block(desc_k, k_row0 + start_n, kvh, b, BLOCK_N, HEAD_DIM, IS_VARLEN)
    # Masked blocks mask keys past len_k too: in varlen they belong to the next document.
    p, acc, l_i, m_i = _softmax_step(tl.dot(q, tl.trans(k)), m_i, l_i, acc, rows, start_n + offs_n, len_k, diag,
                                     qk_scale, sm_scale, softcap, left, right, chunk, MASKED, IS_CAUSAL, HAS_LEFT,
                                     HAS_CHUNK, SOFTCAP)
    v = _load_block(desc_v, k_row0 + start_n, kvh, b, BLOCK_N, HEAD_DIM_V, IS_VARLEN)
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_i


@triton.jit
def _fwd_inner_sm90(acc, l_i, m_i, q, desc_k, desc_v, b, kvh, k_row0, lo, hi, rows, offs_n, len_k, diag,
                    qk_scale, sm_scale, softcap, left, right, chunk,
                    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_CHUNK: tl.constexpr,
                    SOFTCAP: tl.constexpr, IS_VARLEN: tl.constexpr,
                    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                    WARP_SPECIALIZE: tl.constexpr, EDGE: tl.constexpr):
    # EDGE: a window's or chunk's lower edge, a few blocks: one stage, no specialization (a third
    # pipelined loop's buffers would not fit the shared memory).
    if EDGE:
        for start_n in tl.range(lo, hi, BLOCK_N, num_stages=1):
            acc, l_i, m_i = _fwd_step_sm90(acc, l_i, m_i, q, desc_k, desc_v, b, kvh, k_row0, start_n, rows, offs_n,
                                           len_k, diag, qk_scale, sm_scale, softcap, left, right, chunk, MASKED,
                                           IS_CAUSAL, HAS_LEFT, HAS_CHUNK, SOFTCAP, IS_VARLEN, BLOCK_N, HEAD_DIM,
                                           HEAD_DIM_V)
    else:
        for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
            acc, l_i, m_i = _fwd_step_sm90(acc, l_i, m_i, q, desc_k, desc_v, b, kvh, k_row0, start_n, rows, offs_n,
                                           len_k, diag, qk_scale, sm_scale, softcap, left, right, chunk, MASKED,
                                           IS_CAUSAL, HAS_LEFT, HAS_CHUNK, SOFTCAP, IS_VARLEN, BLOCK_N, HEAD_DIM,
                                           HEAD_DIM_V)
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel_sm90(
    desc_q, desc_k, desc_v, O, LSE, CU_Q, CU_K,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_lb, stride_lh, stride_ls,
    seqlen_q, seqlen_k, n_heads, group, qk_scale, sm_scale, softcap, left, right, chunk, seq_bucket,
    IS_VARLEN: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_CHUNK: tl.constexpr,
    SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
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
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V], dtype=tl.float32)
    lo, lo_full, hi_full, hi, diag = _kv_range(m0, len_q, len_k, left, right, chunk, IS_CAUSAL, HAS_LEFT, HAS_CHUNK,
                                               BLOCK_M, BLOCK_N)
    # No early return here (Triton's Hopper warp specialization rejects the branch it makes): a
    # program past the end of a short document runs no iteration and stores nothing.
    live = m0 < len_q
    lo = tl.where(live, lo, 0)
    lo_full = tl.where(live, lo_full, 0)
    hi_full = tl.where(live, hi_full, 0)
    hi = tl.where(live, hi, 0)
    if HAS_LEFT or HAS_CHUNK:  # the masked lower edge of a window or chunk
        acc, l_i, m_i = _fwd_inner_sm90(acc, l_i, m_i, q, desc_k, desc_v, b, kvh, k_row0, lo, lo_full, rows, offs_n,
                                        len_k, diag, qk_scale, sm_scale, softcap, left, right, chunk, True,
                                        IS_CAUSAL, HAS_LEFT, HAS_CHUNK, SOFTCAP, IS_VARLEN, BLOCK_N, HEAD_DIM,
                                        HEAD_DIM_V, False, True)
    acc, l_i, m_i = _fwd_inner_sm90(acc, l_i, m_i, q, desc_k, desc_v, b, kvh, k_row0, lo_full, hi_full, rows, offs_n,
                                    len_k, diag, qk_scale, sm_scale, softcap, left, right, chunk, False, IS_CAUSAL,
                                    HAS_LEFT, HAS_CHUNK, SOFTCAP, IS_VARLEN, BLOCK_N, HEAD_DIM, HEAD_DIM_V,
                                    WARP_SPECIALIZE, False)
    acc, l_i, m_i = _fwd_inner_sm90(acc, l_i, m_i, q, desc_k, desc_v, b, kvh, k_row0, hi_full, hi, rows, offs_n,
                                    len_k, diag, qk_scale, sm_scale, softcap, left, right, chunk, True, IS_CAUSAL,
                                    HAS_LEFT, HAS_CHUNK, SOFTCAP, IS_VARLEN, BLOCK_N, HEAD_DIM, HEAD_DIM_V,
                                    WARP_SPECIALIZE, False)
    # O is stored through pointers: a TMA store of a varlen block would overwrite the next document.
    _fwd_epilogue(acc, l_i, m_i, O, o_off + h * stride_oh + m0.to(tl.int64) * stride_os, stride_os, stride_od,
                  LSE, l_off + h * stride_lh, stride_ls, m0, len_q, HEAD_DIM_V, BLOCK_M, HEAD_DIM_V)


# ----------------------------------------------------------------------------- host side: what this Triton and the tensors allow


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


def _aligned16(t: torch.Tensor) -> bool:
    es = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all((s * es) % 16 == 0 for s in t.stride()[:-1])


def _descriptor(t: torch.Tensor, varlen: bool, rows: int, head_dim: int):
    cls = _tensor_descriptor_cls()
    block = [rows, 1, head_dim] if varlen else [1, rows, 1, head_dim]
    return cls(t, list(t.shape), list(t.stride()), block)


# ----------------------------------------------------------------------------- autotuning


def _sm90_pre_hook(nargs):
    bm, bn, d, dv = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["HEAD_DIM"], nargs["HEAD_DIM_V"]
    varlen = nargs["IS_VARLEN"]
    nargs["desc_q"].block_shape = [bm, 1, d] if varlen else [1, bm, 1, d]
    nargs["desc_k"].block_shape = [bn, 1, d] if varlen else [1, bn, 1, d]
    nargs["desc_v"].block_shape = [bn, 1, dv] if varlen else [1, bn, 1, dv]


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


@functools.lru_cache(maxsize=None)
def _fwd_sm90_tuned():
    return triton.autotune(_sm90_configs(), key=_AUTOTUNE_KEY[2:] + ["HEAD_DIM", "HEAD_DIM_V"])(_fwd_kernel_sm90)
