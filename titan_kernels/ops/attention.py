"""FlashAttention ops: ``torch.ops.titan.flash_attn`` and its backward ``torch.ops.titan.flash_attn_backward``.

One attention call that runs the fastest correct kernel on the machine. Math: softmax(c Q K^T + mask) V
(Vaswani et al. 2017, eq. 1) computed as FlashAttention does (Dao et al. 2022; Dao 2023), with the
float32 log-sum-exp (LSE) of each query row; see ``titan_kernels.reference.attention``.

Backends (``ATTENTION_BACKENDS``), tried in this order, each skipped (never called) when it cannot
take the case (device, dtype, head_dim, varlen, LSE gradient, what torch reports SDPA can run):
  CUDA: fa3 (``flash_attn_interface``, sm_90) > fa2 (``flash_attn`` >= 2.6) > triton (ours) >
        sdpa_cudnn > sdpa_flash > sdpa_math > reference
  CPU:  reference. ``triton`` runs on CPU tensors in the interpreter (``TRITON_INTERPRET=1``) and
        ``sdpa_flash`` / ``sdpa_math`` (aten's CPU kernels) run when asked for.
Overrides, strongest first: the ``backend=`` argument (any name above, or ``"cpu"`` / ``"cuda"``),
``titan_kernels.use_backend(...)``, the ``TITAN_KERNELS_BACKEND`` variable. The generic names map to:
``reference`` and ``triton`` to themselves, ``cuda`` to the native CUDA libraries (fa3 > fa2 > the
SDPA backends) and ``cpu`` to aten's CPU kernels (sdpa_flash > sdpa_math). An explicitly requested
backend that cannot take the case raises ``RuntimeError`` with the reason instead of falling back.
``attention_backend(q, k, v, ...)`` tells which backend would run and why the others were skipped.

Conventions every backend follows (so a backward may run on another backend than its forward):
bottom-right causal alignment (query i sees key j when ``j <= i + seq_k - seq_q``); a row with no
visible key has out = 0 and lse = -inf (FlashAttention's +inf is converted); out and lse are fresh
contiguous tensors. SDPA returns no LSE: its backends compute it in one more blocked Q K^T pass,
and their backward is the reference math (SDPA's backward kernels are reachable only through
autograd, which an op's implementation cannot use), so they are fallbacks, not fast paths, for
training.
SDPA's ``is_causal`` is top-left aligned, so for ``seq_q != seq_k`` an explicit bottom-right mask is
passed instead and rows with no visible key are zeroed.

Op contract: ``torch.library.custom_op`` ops with fake implementations, ``register_autograd`` whose
backward is the op ``titan::flash_attn_backward`` (which also takes a gradient for the LSE), DTensor
rules in ``titan_kernels.dtensor``; in plain eager mode the public functions skip the dispatcher
(``eager_fast_path``). Under ``torch.compile`` the backend is chosen when the op runs.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from titan_kernels import backend as _backend
from titan_kernels.ops._common import check_float, check_same_device, check_tensor, eager_fast_path
from titan_kernels.reference import attention as _ref

OP = "flash_attn"
ATTENTION_BACKENDS = ("fa3", "fa2", "triton", "sdpa_cudnn", "sdpa_flash", "sdpa_math", "reference")
MAX_HEAD_DIM = 256

# Automatic order per device type, and what the generic backend names mean for attention.
_AUTO_ORDER = {
    "cuda": ("fa3", "fa2", "triton", "sdpa_cudnn", "sdpa_flash", "sdpa_math", "reference"),
    "cpu": ("reference",),
}
_GENERIC = {
    "cuda": ("fa3", "fa2", "sdpa_cudnn", "sdpa_flash", "sdpa_math"),
    "cpu": ("sdpa_flash", "sdpa_math"),
}


# ----------------------------------------------------------------------------- the case to dispatch


@dataclass(eq=False)
class AttentionCase:
    """What a backend must take: shapes, dtype and device of one call (seq_* are the maxima)."""

    device: torch.device
    dtype: torch.dtype
    batch: int
    seq_q: int
    seq_k: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    causal: bool
    varlen: bool
    need_lse: bool = False
    backward: bool = False
    has_dlse: bool = False
    tensors: tuple = field(default=(), repr=False)  # (q, k, v) for SDPA's own capability checks


def _case(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal, need_lse, backward=False, has_dlse=False):
    if cu_seqlens_q is not None:
        batch, seq_q, seq_k = cu_seqlens_q.shape[0] - 1, int(max_seqlen_q), int(max_seqlen_k)
    else:
        batch, seq_q, seq_k = q.shape[0], q.shape[1], k.shape[1]
    return AttentionCase(
        q.device, q.dtype, batch, seq_q, seq_k, q.shape[-2], k.shape[-2], q.shape[-1], bool(causal),
        cu_seqlens_q is not None, bool(need_lse), backward, has_dlse, (q, k, v),
    )


@dataclass(frozen=True)
class AttentionChoice:
    """The backend that runs an attention call, why, and why the ones before it were skipped."""

    backend: str
    reason: str
    skipped: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        lines = [f"{self.backend}: {self.reason}"]
        lines += [f"  skipped {name}: {why}" for name, why in self.skipped]
        return "\n".join(lines)


# ----------------------------------------------------------------------------- FlashAttention 2 / 3 adapters

# Arguments of flash-attn's private forward/backward functions that we leave off; their names differ
# across releases, so calls are bound by name against the installed signature (``_bind``).
_OFF_NONE = frozenset({
    "k_new", "v_new", "qv", "out", "out_", "cu_seqlens_k_new", "seqused_q", "seqused_k", "sequed_q", "sequed_k",
    "page_table", "kv_batch_idx", "leftpad_k", "rotary_cos", "rotary_sin", "seqlens_rotary", "q_descale",
    "k_descale", "v_descale", "alibi_slopes", "block_table", "scheduler_metadata", "pack_gqa", "rng_state",
})
_OFF_VALUE = {
    "dropout_p": 0.0, "window_size": (-1, -1), "window_size_left": -1, "window_size_right": -1, "softcap": 0.0,
    "attention_chunk": 0, "rotary_interleaved": True, "num_splits": 1, "sm_margin": 0, "return_softmax": False,
    "deterministic": False, "zero_tensors": False,
}


def _signature(fn) -> inspect.Signature:
    return inspect.signature(getattr(fn, "_init_fn", fn))  # a torch.library CustomOpDef keeps its function there


def _bind(fn, values: dict) -> dict:
    """Keyword arguments for ``fn``: ``values`` under the names it has, optional features off.

    Raises RuntimeError naming a required parameter this adapter does not know (an unsupported
    release), which makes the backend report itself unavailable.
    """
    kwargs = {}
    for name, p in _signature(fn).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if name in values:
            kwargs[name] = values[name]
        elif p.default is not p.empty:
            continue
        elif name in _OFF_VALUE:
            kwargs[name] = _OFF_VALUE[name]
        elif name in _OFF_NONE:
            kwargs[name] = None
        else:
            raise RuntimeError(f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__name__', fn)}: unknown required parameter {name!r}")
    return kwargs


def _fa_values(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale) -> dict:
    varlen = cu_q is not None
    return {
        "q": q, "k": k, "v": v, "softmax_scale": scale, "causal": causal, "is_causal": causal,
        "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k,
        "max_seqlen_q": int(max_q) if varlen else None, "max_seqlen_k": int(max_k) if varlen else None,
    }


@dataclass(frozen=True)
class _FlashLib:
    """One installed flash-attn flavour: its forward/backward functions (dense and varlen)."""

    fwd: object
    bwd: object
    varlen_fwd: object
    varlen_bwd: object


def _probe(fns: dict) -> None:
    dummy = dict.fromkeys(("q", "k", "v", "dout", "out", "softmax_lse", "dq", "dk", "dv", "softmax_scale", "causal",
                           "is_causal", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"))
    for fn in fns.values():
        _bind(fn, dummy)


@functools.lru_cache(maxsize=None)
def _flash_lib(kind: str) -> tuple[_FlashLib | None, str]:
    """(library, "") or (None, why not) for kind "fa3" (flash_attn_interface) or "fa2" (flash_attn)."""
    modname = "flash_attn_interface" if kind == "fa3" else "flash_attn.flash_attn_interface"
    try:
        mod = importlib.import_module(modname)
    except Exception as e:  # absent, or a build that does not load (ABI, CUDA runtime): report, never crash
        return None, f"{modname} is not importable ({type(e).__name__}: {e})"
    if kind == "fa2":
        try:
            version = tuple(int(x) for x in importlib.import_module("flash_attn").__version__.split(".")[:2])
        except Exception:
            version = (0, 0)
        if version < (2, 6):
            return None, f"flash_attn {version} is too old: the adapter needs >= 2.6"
        names = ("_flash_attn_forward", "_flash_attn_backward", "_flash_attn_varlen_forward", "_flash_attn_varlen_backward")
    else:
        names = ("_flash_attn_forward", "_flash_attn_backward", "_flash_attn_forward", "_flash_attn_backward")
    fns = {}
    for n in set(names):
        if not hasattr(mod, n):
            return None, f"{modname} has no {n} (unsupported release)"
        fns[n] = getattr(mod, n)
    try:
        _probe(fns)
    except (RuntimeError, TypeError, ValueError) as e:
        return None, f"{modname}: unsupported release ({e})"
    return _FlashLib(*(fns[n] for n in names)), ""


def _fix_lse_fwd(lse: torch.Tensor) -> torch.Tensor:
    # FlashAttention writes +inf for a row with no visible key; our convention (log 0) is -inf.
    return lse.masked_fill(lse == float("inf"), float("-inf"))


def _fix_lse_bwd(lse: torch.Tensor) -> torch.Tensor:
    return lse.masked_fill(lse == float("-inf"), float("inf"))


def _flash_fwd(kind):
    def fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        lib = _flash_lib(kind)[0]
        fn = lib.varlen_fwd if cu_q is not None else lib.fwd
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        res = fn(**_bind(fn, _fa_values(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)))
        out, lse = res[0], res[1]
        return out.contiguous(), _fix_lse_fwd(lse.contiguous())

    return fwd


def _flash_bwd(kind):
    def bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        lib = _flash_lib(kind)[0]
        fn = lib.varlen_bwd if cu_q is not None else lib.bwd
        dout, q, k, v, out = (t if t.stride(-1) == 1 else t.contiguous() for t in (dout, q, k, v, out))
        dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
        values = _fa_values(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)
        values.update(dout=dout, out=out, softmax_lse=_fix_lse_bwd(lse), dq=dq, dk=dk, dv=dv)
        fn(**_bind(fn, values))  # writes dq, dk, dv
        return dq, dk, dv

    return bwd


# ----------------------------------------------------------------------------- SDPA adapters

_SDPA_KIND = {"sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_flash": "FLASH_ATTENTION", "sdpa_math": "MATH"}


def _sdpa_args(q, k, causal):
    """(attn_mask, is_causal) for SDPA, whose is_causal is top-left aligned: equal lengths use it,
    other lengths get an explicit bottom-right boolean mask."""
    sq, sk = q.shape[1], k.shape[1]
    if not causal:
        return None, False
    if sq == sk:
        return None, True
    return _ref.causal_mask(sq, sk, q.device), False


def _sdpa_call(name, q, k, v, causal, scale):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mask, is_causal = _sdpa_args(q, k, causal)
    with sdpa_kernel([getattr(SDPBackend, _SDPA_KIND[name])]):
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=is_causal,
            scale=scale, enable_gqa=q.shape[2] != k.shape[2],
        )
    o = o.transpose(1, 2)
    if causal and q.shape[1] > k.shape[1]:
        # The first seq_q - seq_k rows see no key: 0 by our convention (SDPA may give nan there).
        o = torch.cat([o.new_zeros((o.shape[0], q.shape[1] - k.shape[1], *o.shape[2:])), o[:, q.shape[1] - k.shape[1]:]], 1)
    return o


def _sdpa_fwd(name):
    def fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        out = _sdpa_call(name, q, k, v, causal, scale).contiguous()
        # SDPA returns no LSE: one more Q K^T pass, over blocks of rows (the price of a fallback).
        return out, _ref.attention_lse(q, k, causal, scale)

    return fwd


def _sdpa_bwd(name):
    def bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, dlse=None):
        # torch runs SDPA's backward kernels only through autograd, which an op's implementation
        # cannot use (it runs below the autograd key): the gradients come from the reference math.
        return _ref.attention_bwd(dout, q, k, v, out, lse, None, None, 0, 0, causal, scale, dlse=dlse)

    return bwd


def _sdpa_can_use(name: str, case: AttentionCase) -> bool:
    """torch's own test of whether an SDPA backend runs these CUDA inputs."""
    q, k, v = case.tensors
    mask, is_causal = _sdpa_args(q, k, case.causal)
    params = torch.backends.cuda.SDPAParams(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, 0.0, is_causal, case.n_heads != case.n_kv_heads
    )
    test = {
        "sdpa_cudnn": torch.backends.cuda.can_use_cudnn_attention,
        "sdpa_flash": torch.backends.cuda.can_use_flash_attention,
    }.get(name)
    return True if test is None else bool(test(params, False))


# ----------------------------------------------------------------------------- backend table


def _cuda_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _why_not_flash(kind: str, case: AttentionCase) -> str | None:
    if case.device.type != "cuda":
        return f"runs on CUDA tensors, not {case.device.type}"
    lib, why = _flash_lib(kind)
    if lib is None:
        return why
    cap = _cuda_capability(case.device)
    if kind == "fa3" and cap != (9, 0):
        return f"FlashAttention-3 runs on sm_90, this device is sm_{cap[0]}{cap[1]}"
    if kind == "fa2" and cap < (8, 0):
        return f"FlashAttention-2 needs sm_80 or newer, this device is sm_{cap[0]}{cap[1]}"
    if case.dtype not in (torch.float16, torch.bfloat16):
        return f"takes float16/bfloat16, not {str(case.dtype).replace('torch.', '')}"
    if case.head_dim % 8 != 0:
        return f"head_dim {case.head_dim} is not a multiple of 8"
    if case.has_dlse:
        return "its backward takes no gradient for the LSE"
    return None


def _why_not_sdpa(name: str, case: AttentionCase) -> str | None:
    if case.varlen:
        return "SDPA has no varlen (packed documents) mode"
    if name == "sdpa_cudnn" and case.device.type != "cuda":
        return f"cuDNN attention runs on CUDA tensors, not {case.device.type}"
    if case.device.type not in ("cuda", "cpu"):
        return f"not used on {case.device.type}"
    if case.device.type == "cuda" and not _sdpa_can_use(name, case):
        kind = _SDPA_KIND[name].lower()
        return f"torch.backends.cuda.can_use_{kind.replace('_attention', '')}_attention rejects these inputs"
    return None


def _why_not_triton(case: AttentionCase) -> str | None:
    st = _backend.backend_status("triton", case.device)
    if not st.available:
        return st.reason
    if "triton" not in _backend.implemented_backends(OP):
        return "titan_kernels.triton.flash_attn failed to import"
    return None


def _why_not(name: str, case: AttentionCase) -> str | None:
    if name == "reference":
        return None
    if name == "triton":
        return _why_not_triton(case)
    if name in ("fa3", "fa2"):
        return _why_not_flash(name, case)
    return _why_not_sdpa(name, case)


def _impl(name: str):
    """(fwd, bwd) of backend ``name``, both with the contract of ``titan_kernels.reference.attention``."""
    if name in ("reference", "triton"):
        return _backend._impls[OP][name] if name in _backend.implemented_backends(OP) else None
    if name in ("fa3", "fa2"):
        return _flash_fwd(name), _flash_bwd(name)
    return _sdpa_fwd(name), _sdpa_bwd(name)


_backend.register_impl(OP, "reference", (_ref.attention_fwd, _ref.attention_bwd))


def _register_triton() -> None:
    try:
        from titan_kernels.triton import flash_attn as _tri
    except ImportError:  # triton not installed: the backend reports itself unavailable
        return
    _backend.register_impl(OP, "triton", (_tri.attention_fwd, _tri.attention_bwd))


_register_triton()


def _requested(backend: str | None) -> tuple[str | None, str]:
    if backend:
        return backend, f"requested by backend={backend!r}"
    name = _backend.requested_backend()
    if name is None:
        return None, ""
    return name, f"requested by use_backend({name!r}) or {_backend.ENV_VAR}"


def choose_backend(case: AttentionCase, backend: str | None = None) -> AttentionChoice:
    """The backend that runs ``case``: ``backend`` (a name of ``ATTENTION_BACKENDS``, "cpu", "cuda" or
    None), else ``use_backend`` / ``TITAN_KERNELS_BACKEND``, else the automatic order.

    Raises RuntimeError when an explicitly requested backend cannot take the case (with why).
    """
    name, why_requested = _requested(backend)
    dev = case.device.type
    if name is None:
        chain, explicit = _AUTO_ORDER.get(dev, ("reference",)), False
    elif name in _GENERIC:
        if dev != name:
            raise RuntimeError(f"backend {name!r} runs on {name} tensors, got {dev} tensors ({why_requested})")
        chain, explicit = _GENERIC[name], True
    else:
        chain, explicit = (name,), True
    skipped = []
    for cand in chain:
        why = _why_not(cand, case)
        if why is None:
            if explicit:
                reason = why_requested
            elif skipped:
                reason = f"first backend of the {dev} order that takes this case"
            else:
                reason = f"first backend of the {dev} order"
            return AttentionChoice(cand, reason, tuple(skipped))
        skipped.append((cand, why))
    detail = "; ".join(f"{n}: {w}" for n, w in skipped)
    raise RuntimeError(f"backend {name!r} cannot run this attention ({why_requested}): {detail}")


# ----------------------------------------------------------------------------- validation


def _check_backend_arg(backend) -> str:
    if backend is None or backend == "":
        return ""
    if not isinstance(backend, str) or backend not in ATTENTION_BACKENDS + tuple(_GENERIC):
        raise ValueError(f"backend: expected None or one of {ATTENTION_BACKENDS + tuple(_GENERIC)}, got {backend!r}")
    return backend


def _check_scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale: expected a float or None, got {type(softmax_scale).__name__}")
    s = float(softmax_scale)
    if not math.isfinite(s) or s <= 0:
        raise ValueError(f"softmax_scale: expected a finite value > 0, got {s}")
    return s


def _check_qkv(q, k, v, rank: int, layout: str) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float(t, name)
        if t.dim() != rank:
            raise ValueError(f"{name}: expected {rank} dims {layout}, got shape {tuple(t.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: expected dtype {q.dtype} (the dtype of q), got {t.dtype}")
    check_same_device({"q": q, "k": k, "v": v})
    if v.shape != k.shape:
        raise ValueError(f"v: expected shape {tuple(k.shape)} (the shape of k), got {tuple(v.shape)}")
    d = q.shape[-1]
    if k.shape[-1] != d:
        raise ValueError(f"k: expected head_dim {d} (the head_dim of q), got {k.shape[-1]}")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"q: head_dim must be in [1, {MAX_HEAD_DIM}] (no backend takes others), got {d}")
    h, hkv = q.shape[-2], k.shape[-2]
    if hkv < 1 or h % hkv != 0:
        raise ValueError(f"k: n_heads ({h}) must be a multiple of n_kv_heads, got n_kv_heads={hkv}")


def _check_cu_seqlens(cu, name: str, total: int, device: torch.device, n: int | None) -> None:
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


def _check_max_seqlen(x, name: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        if isinstance(x, torch.SymInt):
            return x
        raise TypeError(f"{name}: expected an int, got {type(x).__name__}")
    if x < 0:
        raise ValueError(f"{name}: expected >= 0, got {x}")
    return x


def _validate_dense(q, k, v, softmax_scale) -> float:
    _check_qkv(q, k, v, 4, "(batch, seq, heads, head_dim)")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k: expected batch {q.shape[0]} (the batch of q), got {k.shape[0]}")
    return _check_scale(softmax_scale, q.shape[-1])


def _validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale) -> tuple:
    _check_qkv(q, k, v, 3, "(total, heads, head_dim)")
    _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0], q.device, None)
    _check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", k.shape[0], q.device, cu_seqlens_q.shape[0])
    max_seqlen_q = _check_max_seqlen(max_seqlen_q, "max_seqlen_q")
    max_seqlen_k = _check_max_seqlen(max_seqlen_k, "max_seqlen_k")
    if not torch.compiler.is_compiling() and type(cu_seqlens_q) is torch.Tensor and type(cu_seqlens_k) is torch.Tensor:
        _check_cu_values(cu_seqlens_q, "cu_seqlens_q", q.shape[0], max_seqlen_q, "max_seqlen_q")
        _check_cu_values(cu_seqlens_k, "cu_seqlens_k", k.shape[0], max_seqlen_k, "max_seqlen_k")
    return _check_scale(softmax_scale, q.shape[-1]), max_seqlen_q, max_seqlen_k


# ----------------------------------------------------------------------------- run one backend


def _trivial(q, k, cu_q) -> bool:
    """No work: no query, no key or no document (every backend's answer is out = 0, lse = -inf)."""
    if cu_q is not None:
        return q.shape[0] == 0 or k.shape[0] == 0 or cu_q.shape[0] <= 1
    return q.numel() == 0 or k.shape[1] == 0


def _empty_fwd(q, cu_q):
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    shape = (q.shape[1], q.shape[0]) if cu_q is not None else (q.shape[0], q.shape[2], q.shape[1])
    return out, torch.full(shape, float("-inf"), dtype=torch.float32, device=q.device)


def _run_fwd(name, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    if _trivial(q, k, cu_q):
        return _empty_fwd(q, cu_q)
    out, lse = _impl(name)[0](q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)
    return out.contiguous(), lse.contiguous()


def _run_bwd(name, dout, q, k, v, out, lse, dlse, cu_q, cu_k, max_q, max_k, causal, scale):
    if _trivial(q, k, cu_q):
        return tuple(torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    bwd = _impl(name)[1]
    if dlse is not None:  # FlashAttention's backward does not take it (see AttentionCase.has_dlse)
        grads = bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, dlse=dlse)
    else:
        grads = bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale)
    return tuple(g.contiguous() for g in grads)  # the fake implementation's strides


# ----------------------------------------------------------------------------- ops


def _resolve(backend, q, k, v, cu_q, max_q, max_k, causal, return_lse, backward=False, has_dlse=False) -> str:
    case = _case(q, k, v, cu_q, max_q, max_k, causal, return_lse, backward, has_dlse)
    return choose_backend(case, backend or None).backend


@torch.library.custom_op("titan::flash_attn", mutates_args=())
def flash_attn_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    softmax_scale: float,
    return_lse: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward -> (out, lse). Dense when cu_seqlens_q is None: q (b, s_q, h, d),
    k/v (b, s_k, h_kv, d), lse (b, h, s_q); varlen: q (total_q, h, d), lse (h, total_q) and
    max_seqlen_* bound the document lengths (ignored when dense). ``backend`` "" chooses at run time.
    ``return_lse`` says whether the caller sees the LSE (only then is its gradient used). out is in
    q.dtype, lse float32; both contiguous."""
    name = _resolve(backend, q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal, return_lse)
    return _run_fwd(name, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale)


@flash_attn_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, return_lse, backend):
    if cu_seqlens_q is not None:
        lse_shape = (q.shape[1], q.shape[0])
    else:
        lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("titan::flash_attn_backward", mutates_args=())
def flash_attn_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    softmax_scale: float,
    return_lse: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of flash_attn from its out and lse: (dq, dk, dv), fresh contiguous tensors shaped and
    typed like (q, k, v), accumulated in float32. dout is shaped like out (any strides); dlse, shaped
    like lse or None, is a gradient for the LSE output (not on the FlashAttention backends)."""
    name = _resolve(backend, q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal, return_lse, True, dlse is not None)
    return _run_bwd(name, dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    causal, softmax_scale)


@flash_attn_backward_op.register_fake
def _(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
      return_lse, backend):
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, return_lse, backend = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_q, cu_k)
    ctx.args = (max_q, max_k, causal, scale, return_lse, backend)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    max_q, max_k, causal, scale, return_lse, backend = ctx.args
    dq, dk, dv = torch.ops.titan.flash_attn_backward(
        dout, q, k, v, out, lse, dlse if return_lse else None, cu_q, cu_k, max_q, max_k, causal, scale, return_lse,
        backend,
    )
    return dq, dk, dv, None, None, None, None, None, None, None, None


flash_attn_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- eager fast path


class _FlashAttnFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, return_lse, name):
        out, lse = _run_fwd(name, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.args = (max_q, max_k, causal, scale, name)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*(() if return_lse else (lse,)))
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, causal, scale, name = ctx.args
        if dout is None:
            dout = torch.zeros_like(out)
        if dlse is not None and _why_not(name, _case(q, k, v, cu_q, max_q, max_k, causal, True, True, True)):
            # The forward's backend cannot take an LSE gradient: any backend's backward is valid
            # with its out and lse (shared conventions), so use the first that can.
            name = _resolve("", q, k, v, cu_q, max_q, max_k, causal, True, True, True)
        dq, dk, dv = _run_bwd(name, dout, q, k, v, out, lse, dlse, cu_q, cu_k, max_q, max_k, causal, scale)
        return dq, dk, dv, None, None, None, None, None, None, None, None


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _call(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, return_lse, backend):
    if eager_fast_path(q, k, v, cu_q, cu_k):
        name = _resolve(backend, q, k, v, cu_q, max_q, max_k, causal, return_lse)
        if _needs_grad(q, k, v):
            out, lse = _FlashAttnFn.apply(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, return_lse, name)
        else:
            out, lse = _run_fwd(name, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)
    else:
        out, lse = torch.ops.titan.flash_attn(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, return_lse, backend)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------- public API


def flash_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention on the fastest backend that takes the case (FlashAttention API).

    Args:
        q: (batch, seq_q, n_heads, head_dim); k, v: (batch, seq_k, n_kv_heads, head_dim). Same dtype
            (float16 / bfloat16; float32 too, on backends that take it: reference, Triton, SDPA) and
            device; any strides. head_dim up to 256: any multiple of 8 runs everywhere (fast
            paths at 64, 128, 256), other sizes only on the backends that take them (reference,
            Triton, SDPA; not FlashAttention). n_heads is a multiple of n_kv_heads (GQA/MQA: query
            head h reads K/V head h // (n_heads // n_kv_heads); K/V are never repeated in memory).
        causal: mask aligned bottom-right as FlashAttention >= 2.1: query i sees key j when
            ``j <= i + seq_k - seq_q``. A row with no visible key outputs 0.
        softmax_scale: the scale of Q K^T (finite, > 0); None means 1 / sqrt(head_dim).
        return_lse: also return the float32 log-sum-exp (natural log) of each query row's scaled
            scores, (batch, n_heads, seq_q); -inf for a row with no visible key. Differentiable.
        backend: force one of ``ATTENTION_BACKENDS`` (or "cpu" / "cuda"); None chooses (see module doc).

    Returns:
        out (batch, seq_q, n_heads, head_dim) in q.dtype, or (out, lse) with ``return_lse``.

    Raises:
        TypeError: a non-tensor, an unsupported dtype, or k/v dtype != q dtype.
        ValueError: wrong rank, mismatched batch / head_dim / shapes / devices, n_heads not a multiple
            of n_kv_heads, head_dim over 256 (no backend takes it), a bad softmax_scale or backend name.
        RuntimeError: a requested backend cannot run the case, e.g. FlashAttention with a head_dim
            that is not a multiple of 8 (the message says why).

    Source: Vaswani et al. 2017 eq. 1; Dao et al. 2022 (FlashAttention) and Dao 2023
    (FlashAttention-2) for the blocked online softmax, the LSE and the backward.
    """
    backend = _check_backend_arg(backend)
    scale = _validate_dense(q, k, v, softmax_scale)
    return _call(q, k, v, None, None, 0, 0, bool(causal), scale, bool(return_lse), backend)


def flash_attn_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over packed documents: tokens attend only within their own document.

    Args:
        q: (total_q, n_heads, head_dim); k, v: (total_k, n_kv_heads, head_dim); dtype, head_dim and
            GQA rules as ``flash_attn``.
        cu_seqlens_q, cu_seqlens_k: int32 (n_docs + 1,) cumulative lengths on q's device: document i
            is rows ``cu[i]:cu[i+1]``; they start at 0, never decrease and end at total_q / total_k.
            Zero-length documents are allowed.
        max_seqlen_q, max_seqlen_k: ints >= the longest document (they size the kernel grids).
        causal, softmax_scale, return_lse, backend: as ``flash_attn``; the causal alignment applies
            per document.

    Returns:
        out (total_q, n_heads, head_dim) in q.dtype, or (out, lse) with lse (n_heads, total_q) float32.

    Raises:
        As ``flash_attn``, plus TypeError for cu_seqlens that are not int32 and ValueError for
        cu_seqlens that are not 1-D, differ in length, do not start at 0, decrease, do not end at the
        total, or have a document longer than max_seqlen. The value checks need one device sync and
        run in eager mode only (under torch.compile they are skipped).

    Source: as ``flash_attn``; the varlen layout of FlashAttention's ``flash_attn_varlen_func``.
    """
    backend = _check_backend_arg(backend)
    scale, max_seqlen_q, max_seqlen_k = _validate_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale
    )
    return _call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, bool(causal), scale,
                 bool(return_lse), backend)


def attention_backend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    return_lse: bool = False,
    cu_seqlens_q: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    backward: bool = False,
    backend: str | None = None,
) -> AttentionChoice:
    """Which backend ``flash_attn`` (or ``flash_attn_varlen``, when cu_seqlens_q is given) would run
    for these inputs, why, and why each backend before it was skipped.

    Takes the same tensors (dense or varlen layout) and options; ``backward=True`` asks about the
    backward instead. Raises as the attention call would (bad inputs: ValueError / TypeError; a
    requested backend that cannot run: RuntimeError).
    """
    backend = _check_backend_arg(backend)
    if cu_seqlens_q is None:
        _validate_dense(q, k, v, None)
    else:
        _check_qkv(q, k, v, 3, "(total, heads, head_dim)")
        _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0], q.device, None)
        max_seqlen_q = _check_max_seqlen(max_seqlen_q, "max_seqlen_q")
        max_seqlen_k = _check_max_seqlen(max_seqlen_k, "max_seqlen_k")
    case = _case(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal, return_lse, backward)
    return choose_backend(case, backend or None)
