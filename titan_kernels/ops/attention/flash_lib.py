"""FlashAttention-2 (``flash_attn`` >= 2.6) and FlashAttention-3 (``flash_attn_interface``, sm_90) as titan
attention backends: their private forward/backward functions, bound by name against the installed release.

FlashAttention writes lse = +inf for a row with no visible key; our convention (log 0) is -inf, converted
both ways here. The libraries' backward takes no LSE gradient (``dispatch.why_not`` skips them then).
Windows (bottom-right aligned, as ours) and soft-capping pass natively, forward and backward; FA3's
attention_chunk in its forward only. Sinks are applied to their output (``sinks.py``), as for every
backend: the backward takes (out', lse') as it is.
"""
from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass

import torch

from titan_kernels.attention_mask import AttentionArgs

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


def _fa_values(q, k, v, cu_q, cu_k, a: AttentionArgs) -> dict:
    # FlashAttention's window is ours (bottom-right aligned, -1 unbounded, causal = right 0), by
    # whichever name the release uses (a pair, or left / right); soft-capping and FA3's
    # attention_chunk likewise (dispatch.why_not says which release and pass take which).
    varlen = cu_q is not None
    return {
        "q": q, "k": k, "v": v, "softmax_scale": a.scale, "causal": a.causal, "is_causal": a.causal,
        "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k,
        "max_seqlen_q": int(a.max_q) if varlen else None, "max_seqlen_k": int(a.max_k) if varlen else None,
        "window_size": (a.left, a.right), "window_size_left": a.left, "window_size_right": a.right,
        "softcap": a.softcap, "attention_chunk": a.chunk,
    }


@dataclass(frozen=True)
class _FlashLib:
    """One installed flash-attn flavour: its forward/backward functions (dense and varlen)."""

    fwd: object
    bwd: object
    varlen_fwd: object
    varlen_bwd: object

    @property
    def has_chunk(self) -> bool:
        """The forward takes ``attention_chunk`` (FlashAttention-3's chunked attention)."""
        return "attention_chunk" in _signature(self.fwd).parameters


def _probe(fns: dict) -> None:
    dummy = dict.fromkeys(("q", "k", "v", "dout", "out", "softmax_lse", "dq", "dk", "dv", "softmax_scale", "causal",
                           "is_causal", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"))
    for fn in fns.values():
        _bind(fn, dummy)


@functools.lru_cache(maxsize=None)
def flash_lib(kind: str) -> tuple[_FlashLib | None, str]:
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


def flash_fwd(kind):
    def fwd(q, k, v, cu_q, cu_k, a: AttentionArgs):
        lib = flash_lib(kind)[0]
        fn = lib.varlen_fwd if cu_q is not None else lib.fwd
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        res = fn(**_bind(fn, _fa_values(q, k, v, cu_q, cu_k, a)))
        out, lse = res[0], res[1]
        return out.contiguous(), _fix_lse_fwd(lse.contiguous())

    return fwd


def flash_bwd(kind):
    def bwd(dout, q, k, v, out, lse, dlse, cu_q, cu_k, a: AttentionArgs):
        # dlse is always None here: dispatch.why_not skips the libraries when there is one.
        lib = flash_lib(kind)[0]
        fn = lib.varlen_bwd if cu_q is not None else lib.bwd
        dout, q, k, v, out = (t if t.stride(-1) == 1 else t.contiguous() for t in (dout, q, k, v, out))
        dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
        values = _fa_values(q, k, v, cu_q, cu_k, a)
        values.update(dout=dout, out=out, softmax_lse=_fix_lse_bwd(lse), dq=dq, dk=dk, dv=dv)
        fn(**_bind(fn, values))  # writes dq, dk, dv
        return dq, dk, dv

    return bwd

