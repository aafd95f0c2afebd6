"""CPU chunked attention (Llama 4's RoPE layers): ``tk.flash_attn(chunk_size=...)`` against causal.

Target (issue 27, Llama 4): at seq 16384 with a chunk of 2048, forward + backward of the chunked layer
takes at most 0.3x the time of the causal one, float32, on the CPU, measured alternately in one
process (median of interleaved rounds). The scores it computes are 1/8 of causal's plus the chunks'
diagonals (``trainer.models.common.args.attention_entries``: 0.125x), so the bound leaves room for the
per-chunk calls. Shape: one sequence, Llama 4's head_dim 128 with grouped KV heads (2 query heads on
1 KV head instead of 40 on 8: both layers' time scales with the heads alike, and one causal pass
stays within seconds on 2 idle cores).

One thread (both layers alike): aten's CPU kernels run one parallel region per call, and on 2 cores
shared with other processes each region's threads stall each other (a 2-thread run of this file did not
finish in 15 minutes under a load of 14; single-threaded it takes about 2 minutes).

The chunked call is first checked against the float64 reference at a small shape (out and gradients).

Default run prints the table and the ratio at seq 4096 / chunk 512 (the same chunk fraction); the
target shape and the bound are used only with ``BENCH_STRICT=1`` (idle cores), since shared cores make
timings noisy:
  BENCH_STRICT=1 python -m pytest bench/bench_chunked_attention_cpu.py -s -p no:xdist
"""
from __future__ import annotations

import pytest
import torch

import titan_kernels as tk
from bench import common
from bench.bench_attention_cpu import _fwd_bwd, _interleaved, _qkv, _rel, _report
from titan_kernels.attention_mask import AttentionArgs
from titan_kernels.reference import attention as ref
from trainer.models.common.args import attention_entries

# The target shape under BENCH_STRICT; the default (smoke) run times 4096 / 512: the same 1/8 chunk
# fraction at a sixteenth of the cost, so the default test run stays short.
SEQ, CHUNK = (16384, 2048) if common.strict() else (4096, 512)
HEADS, KV_HEADS, HEAD_DIM = 2, 1, 128
BOUND = 0.3


@pytest.mark.skipif(common.device().type != "cpu", reason="the CPU chunked-attention target")
def test_chunked_vs_causal():
    # Correctness at a small awkward shape: 3 chunks of 48 with a partial last one.
    q, k, v, dout = _qkv(1, 130, HEADS, KV_HEADS, 32)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    out64, _ = ref.attention_fwd(q64, k64, v64, None, None, AttentionArgs(32 ** -0.5, right=0, chunk=48))
    g64 = torch.autograd.grad(out64, (q64, k64, v64), dout.double())
    assert _rel(tk.flash_attn(q, k, v, causal=True, chunk_size=48), out64) < 1e-5
    for got, want in zip(_fwd_bwd(q, k, v, dout, causal=True, chunk_size=48)(), g64):
        assert _rel(got, want) < 1e-5

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _time(*_qkv(1, SEQ, HEADS, KV_HEADS, HEAD_DIM))
    finally:
        torch.set_num_threads(threads)


def _time(q, k, v, dout):
    print("\nbackend: causal", tk.attention_backend(q, k, v).backend, "| chunked",
          tk.attention_backend(q, k, v, chunk_size=CHUNK).backend)
    fns = {"causal": _fwd_bwd(q, k, v, dout, causal=True),
           f"chunk{CHUNK}": _fwd_bwd(q, k, v, dout, causal=True, chunk_size=CHUNK)}
    _interleaved(fns, 1)  # warm-up
    title = f"chunked fwd+bwd (1, {SEQ}, {HEADS}/{KV_HEADS} heads, {HEAD_DIM})"
    ratio = _report(title, _interleaved(fns, 3 if common.strict() else 2), "causal")[f"chunk{CHUNK}"]
    scores = attention_entries(SEQ, True, -1, CHUNK) / attention_entries(SEQ, True)
    print(f"chunk{CHUNK}/causal {ratio:.3f}x (scores {scores:.3f}x; target <= {BOUND}, {common.target_note()})")
    if common.strict():
        assert ratio <= BOUND, f"the chunked layer takes {ratio:.3f}x causal's time (target <= {BOUND})"
