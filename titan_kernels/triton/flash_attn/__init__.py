"""Triton FlashAttention: forward and backward, causal or not, dense or varlen, GQA, with the LSE.

This module is the public API and the launchers: ``attention_fwd`` and ``attention_bwd`` have the
contract of ``titan_kernels.reference.attention`` (same layouts; ``max_seqlen_*`` size the grids).
Algorithm: FlashAttention-2 (Dao 2023, "FlashAttention-2", Alg. 1 forward and Alg. 2 backward):
online softmax over key blocks with float32 statistics and accumulator, the log-sum-exp saved for
the backward, which recomputes P block by block. The kernels live in:
  tiles      shared device helpers (varlen/dense offsets, causal key ranges, the online-softmax
             step, masks, dot, the forward epilogue) and the shared autotuning configs.
  fwd        _fwd_kernel, the portable forward.
  fwd_sm90   _fwd_kernel_sm90, the Hopper forward (TMA, warp specialization; FlashAttention-3,
             Shah et al. 2024), chosen on sm_90 by ``sm90_eligible``; the backward is portable.
  bwd        _bwd_delta_kernel, _bwd_dkdv_kernel, _bwd_dq_kernel.

Indexing: batch/head/document bases are int64 and the key/query loops advance pointers, so tensors
over 2^31 elements index correctly. Inputs may have any strides (the head_dim stride too).
Masked-out scores are -inf; a row with no visible key gets O = 0 and lse = -inf; the backward treats
its lse as +inf so that P = 0 there.

On CUDA the block sizes are autotuned per (head_dim, causal, varlen, dtype, GQA group, sequence
length bucket); ``TITAN_KERNELS_AUTOTUNE=0`` uses each kernel's first (default) config instead (tests
on a GPU, where autotuning every small shape costs more than it saves). Under the interpreter
(``TRITON_INTERPRET=1``) fixed small blocks are used.

The launchers look up the kernels, their autotuners and ``triton_interpret`` as names of this module,
which is where tests/kernels/test_attention_sm90.py replaces them to capture launches.
"""
from __future__ import annotations

import os
import warnings

import torch
import triton

from titan_kernels.attention_mask import AttentionArgs
from titan_kernels.triton import triton_interpret
from titan_kernels.triton.flash_attn.bwd import (
    _bwd_delta_kernel,
    _bwd_dkdv_kernel,
    _bwd_dq_kernel,
    _dkdv_tuned,
    _dq_tuned,
)
from titan_kernels.triton.flash_attn.fwd import _fwd_kernel, _fwd_tuned
from titan_kernels.triton.flash_attn.fwd_sm90 import (
    _aligned16,
    _descriptor,
    _fwd_kernel_sm90,
    _fwd_sm90_tuned,
    _tensor_descriptor_cls,
    _tl_range_has_warp_specialize,
)
from titan_kernels.triton.flash_attn.tiles import LOG2E

# ----------------------------------------------------------------------------- tiling and launch helpers

# Fixed tiles under the interpreter: unequal, small tiles so the tests cross block, diagonal and
# sequence-end boundaries at small sizes.
INTERPRET_TILES = {"fwd": (64, 32), "dkdv": (32, 64), "dq": (64, 32)}

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


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def _dummy_cu(t: torch.Tensor, cu: torch.Tensor | None) -> torch.Tensor:
    return cu if cu is not None else t  # never read when IS_VARLEN is False


# ----------------------------------------------------------------------------- Hopper path selection

_sm90_disabled_reason: str | None = None


def sm90_eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """True when the Hopper forward kernel takes this case: an sm_90 device, bf16/fp16, q/k and v
    head_dims each 64, 128 or 256, unit stride on head_dim and 16-byte aligned strides (TMA descriptor
    rules)."""
    if _sm90_disabled_reason is not None or _tensor_descriptor_cls() is None:
        return False
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or q.shape[-1] not in (64, 128, 256) \
            or v.shape[-1] not in (64, 128, 256):
        return False
    return all(_aligned16(t) for t in (q, k, v))


def _mask_args(a: AttentionArgs) -> tuple[tuple, dict]:
    """The kernels' runtime mask / scale arguments (qk_scale, sm_scale, softcap, left, right, chunk)
    and constexprs (IS_CAUSAL: a right bound, ``right`` 0 being causal; HAS_LEFT; HAS_CHUNK; SOFTCAP)."""
    runtime = (a.scale * LOG2E, a.scale, a.softcap if a.softcap > 0 else 1.0, max(a.left, 0), max(a.right, 0),
               max(a.chunk, 1))
    return runtime, dict(IS_CAUSAL=a.right >= 0, HAS_LEFT=a.left >= 0, HAS_CHUNK=a.chunk > 0, SOFTCAP=a.softcap > 0)


def _launch_fwd_sm90(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dims, a: AttentionArgs, tiles=None):
    varlen, batch, seq_q, seq_k, h, hkv, d = dims
    dv = v.shape[-1]
    so, sl = _strides4(out, varlen), _lse_strides(lse, varlen)
    runtime, mask_meta = _mask_args(a)
    args = (
        out, lse, _dummy_cu(lse, cu_seqlens_q), _dummy_cu(lse, cu_seqlens_k), *so, *sl,
        seq_q, seq_k, h, h // hkv, *runtime, _seq_bucket(seq_q),
    )
    if tiles is not None:  # fixed tiles (the interpreter, in tests)
        bm, bn = tiles
        ws = _tl_range_has_warp_specialize()
        descs = (_descriptor(q, varlen, bm, d), _descriptor(k, varlen, bn, d), _descriptor(v, varlen, bn, dv))
        _fwd_kernel_sm90[(triton.cdiv(seq_q, bm), batch * h)](
            *descs, *args, IS_VARLEN=varlen, **mask_meta, BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=d, HEAD_DIM_V=dv,
            WARP_SPECIALIZE=ws)
        return
    descs = (_descriptor(q, varlen, 64, d), _descriptor(k, varlen, 64, d), _descriptor(v, varlen, 64, dv))
    grid = lambda meta: (triton.cdiv(seq_q, meta["BLOCK_M"]), batch * h)  # noqa: E731
    _launch(_fwd_sm90_tuned(), grid, (*descs, *args),
            dict(IS_VARLEN=varlen, **mask_meta, HEAD_DIM=d, HEAD_DIM_V=dv))


# ----------------------------------------------------------------------------- launchers


def _launch_fwd_portable(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dims, a: AttentionArgs):
    varlen, batch, seq_q, seq_k, h, hkv, d = dims
    dv = v.shape[-1]
    block_d, block_dv = _block_d(d), _block_d(dv)
    runtime, mask_meta = _mask_args(a)
    args = (
        q, k, v, out, lse, _dummy_cu(q, cu_seqlens_q), _dummy_cu(q, cu_seqlens_k),
        *_strides4(q, varlen), *_strides4(k, varlen), *_strides4(v, varlen), *_strides4(out, varlen),
        *_lse_strides(lse, varlen),
        seq_q, seq_k, h, h // hkv, d, dv, *runtime, _seq_bucket(seq_q),
    )
    meta = dict(IS_VARLEN=varlen, **mask_meta, BLOCK_D=block_d, EVEN_D=block_d == d, BLOCK_DV=block_dv,
                EVEN_DV=block_dv == dv, PRECISION=_precision(q.dtype), DOT_F32=_dot_f32(q.dtype))
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
    a: AttentionArgs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton forward; same contract as ``titan_kernels.reference.attention.attention_fwd``.

    Returns a contiguous out in q.dtype and a contiguous float32 lse. On an sm_90 device the Hopper
    kernel runs where it takes the case (``sm90_eligible``); if it fails to compile there, a warning
    is issued once and the portable kernel is used from then on.
    """
    global _sm90_disabled_reason
    dims = _dims(q, k, cu_seqlens_q, a.max_q, a.max_k)
    varlen, batch, seq_q, seq_k, h, hkv, d = dims
    out_shape = (*q.shape[:-1], v.shape[-1])
    if varlen:
        # Rows outside every document (only possible with unvalidated cu_seqlens) read as 0 / -inf.
        out = torch.zeros(out_shape, dtype=q.dtype, device=q.device)
        lse = torch.full((h, q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    else:
        out = torch.empty(out_shape, dtype=q.dtype, device=q.device)
        lse = torch.empty((batch, h, seq_q), dtype=torch.float32, device=q.device)
    if batch == 0 or h == 0 or seq_q == 0 or out.numel() == 0:
        return out, lse
    if sm90_eligible(q, k, v):
        try:
            _launch_fwd_sm90(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dims, a)
            return out, lse
        except Exception as e:  # a compiler without this Hopper support: keep working, loudly
            _sm90_disabled_reason = f"{type(e).__name__}: {e}"
            warnings.warn(
                f"titan flash_attn: the sm_90 Triton forward kernel failed ({_sm90_disabled_reason}); "
                "using the portable Triton kernel from now on",
                RuntimeWarning,
                stacklevel=2,
            )
    _launch_fwd_portable(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dims, a)
    return out, lse


def attention_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    a: AttentionArgs,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton backward; same contract as ``titan_kernels.reference.attention.attention_bwd``.

    dq, dk, dv are fresh contiguous tensors in the dtypes of q, k, v (float32 accumulation).
    """
    dims = _dims(q, k, cu_seqlens_q, a.max_q, a.max_k)
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
    d_v = v.shape[-1]
    block_d, block_dv = _block_d(d), _block_d(d_v)
    precision = _precision(q.dtype)
    runtime, mask_meta = _mask_args(a)
    group = h // hkv
    interp = triton_interpret()

    bm = 64
    _bwd_delta_kernel[(triton.cdiv(seq_q, bm), batch * h)](
        out, dout, delta, cu_q, *_strides4(out, varlen), *_strides4(dout, varlen), *sl,
        seq_q, h, d_v, IS_VARLEN=varlen, BLOCK_M=bm, BLOCK_DV=block_dv,
    )
    if dlse is not None:
        delta.sub_(dlse)  # dS = P * (dP - delta + dlse): an LSE gradient only shifts delta
    meta = dict(IS_VARLEN=varlen, **mask_meta, BLOCK_D=block_d, EVEN_D=block_d == d, BLOCK_DV=block_dv,
                EVEN_DV=block_dv == d_v, PRECISION=precision, DOT_F32=_dot_f32(q.dtype))
    qkv_strides = (*_strides4(q, varlen), *_strides4(k, varlen), *_strides4(v, varlen), *_strides4(dout, varlen))
    dkdv_args = (
        q, k, v, dout, lse, delta, dk, dv, cu_q, cu_k, *qkv_strides,
        *_strides4(dk, varlen), *_strides4(dv, varlen), *sl,
        seq_q, seq_k, hkv, group, d, d_v, *runtime, _seq_bucket(seq_k),
    )
    dq_args = (
        q, k, v, dout, lse, delta, dq, cu_q, cu_k, *qkv_strides, *_strides4(dq, varlen), *sl,
        seq_q, seq_k, h, group, d, d_v, *runtime, _seq_bucket(seq_q),
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
