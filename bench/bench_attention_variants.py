"""Attention variants: forward + backward time and TFLOP/s of a sliding window (128), sinks and
multi-head latent attention's head dims (q/k 192, v 128) against full causal attention at the same
shape, and against FlashAttention (window) / SDPA (MLA) where they run.

FLOPs count only the score entries the mask leaves (``titan_kernels.unmasked_score_count``): a
forward costs 2 * entries * (head_dim + head_dim_v) per (batch, head) (Q K^T and P V), the backward
2.5x that; so a window of 128 over 32k is credited with 32k * 128 entries, not 32k^2 / 2, and its
TFLOP/s is comparable with causal's. Ceiling: the measured bf16 matmul rate (the row's share).
Ratios: each row against ``causal`` (titan's causal attention at the same shape) and the library
baselines (``fa3``, ``fa2``, ``sdpa``) timed in the same group.

Implementations: ``titan`` (the automatic choice; the row's name says which backend ran),
``titan-triton`` (forced), ``causal`` (the baseline), ``fa3`` / ``fa2`` (``flash_attn_func`` with
``window_size``, when installed; no sinks there), ``sdpa`` (``F.scaled_dot_product_attention``,
torch's own choice, for MLA's head dims). Triton runs its kernels' default tiles here
(TITAN_KERNELS_AUTOTUNE=0): the windowed kernels are new binaries, and autotuning them would
not fit bench/run_gpu.sh's budget (bench_attention.py times the autotuned causal kernels).

CUDA: bf16, GPT-OSS's attention shape (64 / 8 heads, head_dim 64) at seq 8k and 32k, batch 1;
MLA at DeepSeek-V3's head dims, 16 heads, seq 8k. CPU: one small float32 shape (a smoke test; the
CPU targets are bench/bench_attention_cpu.py's).
"""
from __future__ import annotations

import contextlib
import importlib
import os

import pytest
import torch
import torch.nn.functional as F

import titan_kernels as tk
from bench import common

DEV = common.device()
if DEV.type == "cuda":
    SEQS, HEADS, DTYPE = (8192, 32768), (64, 8, 64), torch.bfloat16
    MLA = (8192, 16, 192, 128)
else:
    SEQS, HEADS, DTYPE = (256,), (4, 2, 16), torch.float32
    MLA = (256, 4, 24, 16)
WINDOW = (127, 0)  # GPT-OSS's sliding window of 128 tokens


def _flash(modname: str):
    try:
        return importlib.import_module(modname).flash_attn_func
    except Exception:  # not installed, or a build that does not load
        return None


LIBS = {name: fn for name, fn in (("fa3", _flash("flash_attn_interface")), ("fa2", _flash("flash_attn")))
        if fn is not None and DEV.type == "cuda"}
IMPLS = ["titan", "titan-triton", "sdpa", *LIBS]


@contextlib.contextmanager
def _default_tiles():
    old = os.environ.get("TITAN_KERNELS_AUTOTUNE")
    os.environ["TITAN_KERNELS_AUTOTUNE"] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TITAN_KERNELS_AUTOTUNE")
        else:
            os.environ["TITAN_KERNELS_AUTOTUNE"] = old


def _call(impl: str, variant: str):
    """fn(q, k, v, sinks) -> out for ``impl`` on ``variant``, or a string saying why it does not apply."""
    kw = {"window128": {"window_size": WINDOW}}.get(variant, {})
    if impl in ("titan", "titan-triton"):
        if impl == "titan-triton" and DEV.type != "cuda":
            return "Triton runs in the interpreter on the CPU: no benchmark"
        be = "triton" if impl == "titan-triton" else None
        return lambda q, k, v, s: tk.flash_attn(q, k, v, causal=True, sinks=s, backend=be, **kw)
    if impl == "sdpa":
        if variant != "mla":
            return "SDPA takes no window or sinks (its causal time is bench_attention.py's)"
        return lambda q, k, v, s: F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)
    fn = LIBS[impl]
    if variant not in ("causal", "window128"):
        return f"{impl}'s flash_attn_func takes no sinks and (FA2) no v head_dim of its own"
    return lambda q, k, v, s: _first(fn(q, k, v, causal=True, window_size=kw.get("window_size", (-1, -1))))


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _shape(variant: str, seq: int):
    """(batch, seq, n_heads, n_kv_heads, head_dim, head_dim_v)."""
    if variant == "mla":
        s, h, d, dv = MLA
        return 1, s, h, h, d, dv
    h, hkv, d = HEADS
    return 1, seq, h, hkv, d, d


def flops(variant: str, seq: int) -> float:
    """Forward + backward FLOPs over the unmasked score entries only (module docstring)."""
    b, s, h, _, d, dv = _shape(variant, seq)
    entries = tk.unmasked_score_count(s, s, causal=True, window_size=WINDOW if variant == "window128" else (-1, -1))
    return 3.5 * 2.0 * b * h * entries * (d + dv)


@pytest.mark.parametrize("impl", ["causal", *IMPLS])
@pytest.mark.parametrize("variant", ["window128", "sinks", "mla"])
@pytest.mark.parametrize("seq", SEQS)
@pytest.mark.parametrize("pass_", ["fwd+bwd"])
def test_attention_variant(benchmark, pass_, seq, variant, impl):
    if variant == "mla" and seq != MLA[0]:
        pytest.skip(f"MLA is timed at seq {MLA[0]} only")
    if impl == "causal" and variant == "mla":
        pytest.skip("MLA's baseline is SDPA at the same head dims")
    fn = _call("titan" if impl == "causal" else impl, "causal" if impl == "causal" else variant)
    if isinstance(fn, str):
        pytest.skip(fn)
    b, s, h, hkv, d, dv = _shape(variant, seq)
    torch.manual_seed(0)
    q = torch.randn(b, s, h, d, device=DEV, dtype=DTYPE, requires_grad=True)
    k = torch.randn(b, s, hkv, d, device=DEV, dtype=DTYPE, requires_grad=True)
    v = torch.randn(b, s, hkv, dv, device=DEV, dtype=DTYPE, requires_grad=True)
    sinks = torch.randn(h, device=DEV, requires_grad=True) if variant == "sinks" and impl != "causal" else None
    dout = torch.randn(b, s, h, dv, device=DEV, dtype=DTYPE)
    inputs = (q, k, v) + ((sinks,) if sinks is not None else ())

    def step():
        return torch.autograd.grad(fn(q, k, v, sinks), inputs, dout)

    name = impl
    if impl in ("titan", "titan-triton"):
        kw = {"window_size": WINDOW} if variant == "window128" else {}
        name = f"{impl}({tk.attention_backend(q, k, v, **kw).backend})"
    with _default_tiles():
        try:
            step()
        except RuntimeError as e:  # e.g. a library that does not take this shape here
            pytest.skip(f"{impl} cannot run {variant} s{s}: {str(e).splitlines()[0][:200]}")
        label = f"s{s} h{h}/{hkv} d{d}" + (f"/{dv}" if dv != d else "") + f" {variant}"
        common.run(benchmark, step, op=f"attention.{variant} {pass_}", impl=name, shape=label, dtype=DTYPE,
                   flops=flops("causal" if impl == "causal" else variant, seq), flop_dtype=torch.bfloat16)
