"""CPU attention: ``tk.flash_attn`` forward + backward against aten SDPA through autograd, same process.

Target (issue: hot paths): at (b 8, s 256, h 16, d 16) causal and (b 2, s 1024, h 8, h_kv 2, d 64)
causal, float32, ``tk.flash_attn`` forward + backward takes at most 1.1x the time of
``F.scaled_dot_product_attention(..., enable_gqa=True)`` + its autograd backward, measured alternately
in one run (median of interleaved rounds). Both run aten's CPU flash kernel; ours must add no more than
dispatch overhead. The outputs, LSE and gradients are checked against float64 first.

FLOPs (FlashAttention's convention): forward 4 b h s^2 d / 2 (causal), backward 2.5x the forward;
the ceiling is the measured float32 matmul rate (no bf16 units on our CPUs).

The variants (issue: attention that current models need), each a ratio to a baseline in the same
process, forward + backward, float32, interleaved rounds:
  * a sliding window of 128 at seq 4096 against full causal (target: at most 1/4 of causal's time;
    aten's kernel by query-block decomposition), a window of seq / 2, and a window as long as the
    sequence (normalized to causal: the 1.2x rule for a window on aten's kernel);
  * sinks (the LSE epilogue) against the same call without;
  * soft-capping (the blockwise backend; aten's kernel has none) against causal on aten's kernel,
    and the blockwise backend without soft-capping, to separate the backend from the tanh;
  * v head_dim 128 with q/k 192 (multi-head latent attention): aten's kernel with the narrower side
    zero-padded against the blockwise backend's native head dims, and 192 / 192 for reference.
Each prints its ratios; bounds are asserted only with ``BENCH_STRICT=1``. The window's ratio needs
idle cores: its few batched kernel calls and index copies are more parallel regions than causal's
one call, and other processes on 2 shared cores stall each region's threads (0.18x idle, single-
threaded too; about 0.3x with the cores shared, 2026-12-04).

Default run: both shapes, a few rounds (about 10 s), printing the table; the 1.1x bound is asserted
only with ``BENCH_STRICT=1`` (on an idle machine), since shared CI cores make timings noisy:
  BENCH_STRICT=1 BENCH_OUT=bench/results/local/$(date -u +%F)-cpu pytest bench/bench_attention_cpu.py -s
"""
from __future__ import annotations

import statistics
import time

import pytest
import torch
import torch.nn.functional as F

import titan_kernels as tk
from bench import common
from titan_kernels.attention_mask import AttentionArgs
from titan_kernels.reference import attention as ref

# (batch, seq, n_heads, n_kv_heads, head_dim), causal
SHAPES = [(8, 256, 16, 16, 16), (2, 1024, 8, 2, 64)]
BOUND = 1.1


def _flops(b, s, h, d) -> float:
    return 3.5 * 4.0 * b * h * s * s * d / 2


def _ours(q, k, v, dout):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = tk.flash_attn(q, k, v, causal=True)
    return torch.autograd.grad(out, (q, k, v), dout)


def _sdpa(q, k, v, dout):
    q, k, v = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    return torch.autograd.grad(out, (q, k, v), dout.transpose(1, 2))


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _interleaved(fns: dict, rounds: int) -> dict:
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


@pytest.mark.skipif(common.device().type != "cpu", reason="the CPU attention target; GPUs run bench_attention.py")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}_s{}_h{}_{}_d{}".format(*s))
def test_cpu_attention_vs_sdpa(shape):
    b, s, h, hkv, d = shape
    torch.manual_seed(0)
    q, k, v = torch.randn(b, s, h, d), torch.randn(b, s, hkv, d), torch.randn(b, s, hkv, d)
    dout = torch.randn(b, s, h, d)
    assert tk.attention_backend(q, k, v).backend == "sdpa_flash"
    # Correctness first: out, LSE and gradients against float64.
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    # The reference math computes in float64 for float64 inputs (plain torch ops: autograd gives the gradients).
    out64, lse64 = ref.attention_fwd(q64, k64, v64, None, None, AttentionArgs(d ** -0.5, right=0))
    g64 = torch.autograd.grad(out64, (q64, k64, v64), dout.double())
    out, lse = tk.flash_attn(q, k, v, causal=True, return_lse=True)
    assert _rel(out, out64) < 1e-5 and (lse.double() - lse64).abs().max().item() < 1e-4
    for a, e in zip(_ours(q, k, v, dout), g64):
        assert _rel(a, e) < 1e-5
    fns = {"titan": lambda: _ours(q, k, v, dout), "sdpa": lambda: _sdpa(q, k, v, dout)}
    _interleaved(fns, 2)  # warm-up
    t = _interleaved(fns, 7 if common.strict() else 3)
    ratio = t["titan"] / t["sdpa"]
    rate = common.matmul_rate(torch.float32)
    for impl in fns:
        common.ROWS.append(common.Row(op="attention fwd+bwd", shape=str(shape), dtype="float32", impl=impl,
                                      time_s=t[impl], flops=_flops(b, s, h, d), tflops=_flops(b, s, h, d) / t[impl] / 1e12,
                                      flop_share=_flops(b, s, h, d) / t[impl] / rate))
    print(f"\nattention fwd+bwd {shape}: titan {t['titan'] * 1e3:.1f} ms, sdpa {t['sdpa'] * 1e3:.1f} ms, "
          f"titan/sdpa {ratio:.2f} (target <= {BOUND}, {common.target_note()})")
    if common.strict():
        assert ratio <= BOUND, f"tk.flash_attn is {ratio:.2f}x SDPA's time (target <= {BOUND})"


# ----------------------------------------------------------------------------- the variants


def _fwd_bwd(q, k, v, dout, **kw):
    def run():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        out = tk.flash_attn(qq, kk, vv, **kw)
        return torch.autograd.grad(out, (qq, kk, vv), dout)
    return run


def _report(title: str, t: dict, base: str) -> dict:
    ratios = {name: t[name] / t[base] for name in t}
    print(f"\n{title}: " + ", ".join(f"{n} {t[n] * 1e3:.1f} ms ({ratios[n]:.3f}x)" for n in t) + f" [vs {base}]")
    for name in t:
        common.ROWS.append(common.Row(op=title, shape="", dtype="float32", impl=name, time_s=t[name]))
    return ratios


def _qkv(b, s, h, hkv, d, dv=None):
    torch.manual_seed(0)
    return (torch.randn(b, s, h, d), torch.randn(b, s, hkv, d), torch.randn(b, s, hkv, dv or d),
            torch.randn(b, s, h, dv or d))


def _rounds() -> int:
    return 5 if common.strict() else 3


@pytest.mark.skipif(common.device().type != "cpu", reason="the CPU attention targets")
def test_sliding_window_vs_causal():
    # GPT-OSS's window (128: left 127) at seq 4096; aten's kernel by query-block decomposition.
    s = 4096
    q, k, v, dout = _qkv(1, s, 8, 2, 64)
    for window in ((127, 0), (s // 2 - 1, 0)):
        assert tk.attention_backend(q, k, v, window_size=window).backend == "sdpa_flash"
    fns = {"causal": _fwd_bwd(q, k, v, dout), "window128": _fwd_bwd(q, k, v, dout, window_size=(127, 0)),
           "window_seq/2": _fwd_bwd(q, k, v, dout, window_size=(s // 2 - 1, 0)),
           "window_seq": _fwd_bwd(q, k, v, dout, window_size=(s - 1, 0))}
    _interleaved(fns, 1)
    r = _report("window fwd+bwd (1, 4096, 8/2 heads, 64)", _interleaved(fns, _rounds()), "causal")
    if common.strict():
        assert r["window128"] <= 0.25, f"a window of 128 takes {r['window128']:.3f}x causal's time (target <= 1/4)"
        assert r["window_seq"] <= 1.2, f"window = seq takes {r['window_seq']:.3f}x causal's time (target <= 1.2)"


@pytest.mark.slow  # ~18 s on 2 cores; by default sinks and soft-capping against float64 on every CPU
# backend: tests/kernels/test_attention_variants.py (this is their cost, a benchmark)
@pytest.mark.skipif(common.device().type != "cpu", reason="the CPU attention targets")
def test_sinks_and_softcap_overhead():
    q, k, v, dout = _qkv(1, 2048, 8, 2, 64)
    sinks = torch.randn(8)
    fns = {"causal": _fwd_bwd(q, k, v, dout), "sinks": _fwd_bwd(q, k, v, dout, sinks=sinks),
           "blockwise": _fwd_bwd(q, k, v, dout, backend="blockwise"),
           "softcap": _fwd_bwd(q, k, v, dout, softcap=30.0)}
    assert tk.attention_backend(q, k, v, softcap=30.0).backend == "blockwise"
    _interleaved(fns, 1)
    r = _report("sinks / soft-capping fwd+bwd (1, 2048, 8/2 heads, 64)", _interleaved(fns, _rounds()), "causal")
    print(f"softcap against the blockwise backend without it: {r['softcap'] / r['blockwise']:.3f}x")


@pytest.mark.skipif(common.device().type != "cpu", reason="the CPU attention targets")
def test_mla_head_dims():
    # DeepSeek-V3's q/k 192 with v 128 (one KV head per query head, as MLA's decompressed K/V).
    q, k, v, dout = _qkv(1, 1024, 8, 8, 192, 128)
    q2, k2, v2, dout2 = _qkv(1, 1024, 8, 8, 192)
    fns = {"auto": _fwd_bwd(q, k, v, dout), "sdpa_flash(padded)": _fwd_bwd(q, k, v, dout, backend="sdpa_flash"),
           "blockwise(native)": _fwd_bwd(q, k, v, dout, backend="blockwise"),
           "192/192": _fwd_bwd(q2, k2, v2, dout2, backend="sdpa_flash")}
    _interleaved(fns, 1)
    print("automatic choice:", tk.attention_backend(q, k, v).backend)
    _report("MLA 192/128 fwd+bwd (1, 1024, 8 heads)", _interleaved(fns, _rounds()), "sdpa_flash(padded)")
