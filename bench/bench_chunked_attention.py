"""Chunked attention at Llama 4's shapes: forward + backward time and TFLOP/s of a RoPE layer's chunked
causal attention (chunk 8192, ``tk.flash_attn(chunk_size=...)``) against causal attention (a NoPE
layer) at the same shape, in one process.

CUDA: bf16, Llama 4 Scout / Maverick's attention (40 query heads, 8 KV heads, head_dim 128), batch 1,
seq 32768 (four chunks): the chunked layer computes a quarter of causal's scores plus the chunks'
diagonals, so its time should approach that share. FLOPs count only the score entries the mask
leaves (``titan_kernels.unmasked_score_count``: forward 2 * entries * (head_dim + head_dim_v) per head,
backward 2.5x), so the two rows' TFLOP/s compare kernel efficiency; ceiling: the measured bf16 matmul
rate. Triton runs its kernels' default tiles (autotuning the chunked kernels would not fit
bench/run_gpu.sh's headline budget). CPU: one small float32 shape (a smoke test; the CPU target,
16k / chunk 2k <= 0.3x causal, is bench/bench_chunked_attention_cpu.py's).

Part of bench/run_gpu.sh's headline stage (group ``attention_chunked``, bench/gpu_headline.py).
"""
from __future__ import annotations

import pytest
import torch

import titan_kernels as tk
from bench import common
from bench.bench_attention_variants import _default_tiles

DEV = common.device()
if DEV.type == "cuda":
    SEQS, HEADS, CHUNK, DTYPE = (32768,), (40, 8, 128), 8192, torch.bfloat16
else:
    SEQS, HEADS, CHUNK, DTYPE = (256,), (5, 1, 16), 64, torch.float32


def flops(seq: int, chunk: int | None) -> float:
    """Forward + backward FLOPs over the unmasked score entries (module docstring)."""
    h, _, d = HEADS
    return 3.5 * 2.0 * h * tk.unmasked_score_count(seq, seq, causal=True, chunk_size=chunk) * 2 * d


@pytest.mark.parametrize("impl", ["causal", "titan", "titan-triton"])
@pytest.mark.parametrize("seq", SEQS)
@pytest.mark.parametrize("pass_", ["fwd+bwd"])
def test_chunked_attention(benchmark, pass_, seq, impl):
    if impl == "titan-triton" and DEV.type != "cuda":
        pytest.skip("Triton runs in the interpreter on the CPU: no benchmark")
    h, hkv, d = HEADS
    torch.manual_seed(0)
    q = torch.randn(1, seq, h, d, device=DEV, dtype=DTYPE, requires_grad=True)
    k = torch.randn(1, seq, hkv, d, device=DEV, dtype=DTYPE, requires_grad=True)
    v = torch.randn(1, seq, hkv, d, device=DEV, dtype=DTYPE, requires_grad=True)
    dout = torch.randn(1, seq, h, d, device=DEV, dtype=DTYPE)
    chunk = None if impl == "causal" else CHUNK
    backend = "triton" if impl == "titan-triton" else None

    def step():
        out = tk.flash_attn(q, k, v, causal=True, chunk_size=chunk, backend=backend)
        return torch.autograd.grad(out, (q, k, v), dout)

    name = impl
    if impl == "titan":
        name = f"titan({tk.attention_backend(q, k, v, chunk_size=CHUNK).backend})"
    with _default_tiles():
        step()
        # One label for both rows, so that each chunked row carries its ratio to ``causal``.
        label = f"s{seq} h{h}/{hkv} d{d} chunk{CHUNK}"
        common.run(benchmark, step, op=f"attention.chunked {pass_}", impl=name, shape=label, dtype=DTYPE,
                   flops=flops(seq, chunk), flop_dtype=torch.bfloat16)
