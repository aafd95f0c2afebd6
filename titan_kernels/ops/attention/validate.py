"""Input validation of the attention API: clear errors naming the argument, before any kernel runs."""
from __future__ import annotations

import math

import torch

from titan_kernels.ops._common import FLOAT_DTYPES, check_float, check_same_device, check_tensor

MAX_HEAD_DIM = 256


def check_scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale: expected a float or None, got {type(softmax_scale).__name__}")
    s = float(softmax_scale)
    if not math.isfinite(s) or s <= 0:
        raise ValueError(f"softmax_scale: expected a finite value > 0, got {s}")
    return s


_DTYPES = frozenset(FLOAT_DTYPES)


def _head_dim_if_valid(q, k, v, rank: int) -> int:
    """q's head_dim when q, k, v pass every check of the common case, in one pass (this runs on every
    call; dense: the batch too), else 0: the detailed checks then name what is wrong. v's head_dim may
    differ from q/k's (multi-head latent attention: q/k 192, v 128)."""
    try:
        qs, ks, vs, dt, dev = q.shape, k.shape, v.shape, q.dtype, q.device
        if not (len(qs) == rank and len(ks) == rank and len(vs) == rank and vs[:-1] == ks[:-1] and dt in _DTYPES
                and k.dtype == dt and v.dtype == dt and k.device == dev and v.device == dev
                and (rank == 3 or ks[0] == qs[0])):
            return 0
        d, hkv = qs[-1], ks[-2]
        return d if (ks[-1] == d and 1 <= d <= MAX_HEAD_DIM and 1 <= vs[-1] <= MAX_HEAD_DIM and hkv >= 1
                     and qs[-2] % hkv == 0) else 0
    except (AttributeError, TypeError):  # not a tensor: the detailed checks say which
        return 0


def check_qkv(q, k, v, rank: int, layout: str) -> None:
    if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) \
            and _head_dim_if_valid(q, k, v, rank):
        return  # the detailed checks below name the argument and what was expected
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float(t, name)
        if t.dim() != rank:
            raise ValueError(f"{name}: expected {rank} dims {layout}, got shape {tuple(t.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: expected dtype {q.dtype} (the dtype of q), got {t.dtype}")
    check_same_device({"q": q, "k": k, "v": v})
    d = q.shape[-1]
    if k.shape[-1] != d:  # before v against k: a k with the wrong head_dim is k's fault, not v's
        raise ValueError(f"k: expected head_dim {d} (the head_dim of q), got {k.shape[-1]}")
    if v.shape[:-1] != k.shape[:-1]:
        raise ValueError(f"v: expected shape {tuple(k.shape[:-1]) + ('head_dim_v',)} (the shape of k but its "
                         f"head_dim, which may differ), got {tuple(v.shape)}")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"q: head_dim must be in [1, {MAX_HEAD_DIM}] (no backend takes others), got {d}")
    if not 1 <= v.shape[-1] <= MAX_HEAD_DIM:
        raise ValueError(f"v: head_dim must be in [1, {MAX_HEAD_DIM}] (no backend takes others), got {v.shape[-1]}")
    h, hkv = q.shape[-2], k.shape[-2]
    if h < 1:
        raise ValueError(f"q: expected n_heads >= 1, got shape {tuple(q.shape)}")
    if hkv < 1 or h % hkv != 0:
        raise ValueError(f"k: n_heads ({h}) must be a multiple of n_kv_heads, got n_kv_heads={hkv}")


def check_cu_seqlens(cu, name: str, total: int, device: torch.device, n: int | None) -> None:
    check_tensor(cu, name)
    if cu.dtype != torch.int32:
        raise TypeError(f"{name}: expected dtype int32, got {str(cu.dtype).replace('torch.', '')}")
    if cu.dim() != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name}: expected a 1-D tensor of n_docs + 1 offsets, got shape {tuple(cu.shape)}")
    if n is not None and cu.shape[0] != n:
        raise ValueError(f"{name}: expected {n} entries (as cu_seqlens_q), got {cu.shape[0]}")
    if cu.device != device:
        raise ValueError(f"{name}: expected device {device} (the device of q), got {cu.device}")


def _check_cu_values(cu, name: str, total: int, max_seqlen: int, max_name: str) -> None:
    # Data-dependent: eager only (one device sync for all four checks).
    first, last, bad, longest = torch.stack([
        cu[0], cu[-1], (cu[1:] < cu[:-1]).any().to(torch.int32),
        (cu[1:] - cu[:-1]).max() if cu.shape[0] > 1 else cu.new_zeros(()),
    ]).tolist()
    if bad:
        raise ValueError(f"{name}: expected non-decreasing offsets, got {cu.tolist()}")
    if first != 0 or last != total:
        raise ValueError(f"{name}: expected to start at 0 and end at the total length {total}, got {first}..{last}")
    if longest > max_seqlen:
        raise ValueError(f"{max_name}: expected >= the longest document ({longest}), got {max_seqlen}")


def check_max_seqlen(x, name: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        if isinstance(x, torch.SymInt):
            return x
        raise TypeError(f"{name}: expected an int, got {type(x).__name__}")
    if x < 0:
        raise ValueError(f"{name}: expected >= 0, got {x}")
    return x


def validate_dense(q, k, v, softmax_scale) -> float:
    d = _head_dim_if_valid(q, k, v, 4) if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) else 0
    if d:
        return 1.0 / math.sqrt(d) if softmax_scale is None else check_scale(softmax_scale, d)
    check_qkv(q, k, v, 4, "(batch, seq, heads, head_dim)")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k: expected batch {q.shape[0]} (the batch of q), got {k.shape[0]}")
    return check_scale(softmax_scale, q.shape[-1])


def validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale) -> tuple:
    check_qkv(q, k, v, 3, "(total, heads, head_dim)")
    check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0], q.device, None)
    check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", k.shape[0], q.device, cu_seqlens_q.shape[0])
    max_seqlen_q = check_max_seqlen(max_seqlen_q, "max_seqlen_q")
    max_seqlen_k = check_max_seqlen(max_seqlen_k, "max_seqlen_k")
    if (not torch.compiler.is_compiling() and type(cu_seqlens_q) is torch.Tensor and type(cu_seqlens_k) is torch.Tensor
            and not cu_seqlens_q.is_meta):  # meta offsets have no values to check
        _check_cu_values(cu_seqlens_q, "cu_seqlens_q", q.shape[0], max_seqlen_q, "max_seqlen_q")
        _check_cu_values(cu_seqlens_k, "cu_seqlens_k", k.shape[0], max_seqlen_k, "max_seqlen_k")
    return check_scale(softmax_scale, q.shape[-1]), max_seqlen_q, max_seqlen_k



def check_sinks(sinks, q) -> None:
    """sinks: None or a float tensor of shape (n_heads,) on q's device (any float dtype; math in float32)."""
    if sinks is None:
        return
    check_float(sinks, "sinks")
    h = q.shape[-2]
    if sinks.shape != (h,):
        raise ValueError(f"sinks: expected shape (n_heads,) = ({h},), got {tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"sinks: expected device {q.device} (the device of q), got {sinks.device}")
