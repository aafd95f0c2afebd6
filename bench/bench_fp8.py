"""Float8 benchmarks: the scaled GEMM and Float8Linear forward+backward.

GEMM (``fp8_gemm.<granularity>``, FLOPs 2·M·N·K): our Triton kernel (``titan-triton``) and the
public op (``titan``: torch._scaled_mm behind our padding/layout wrapper) against ``_scaled_mm``
called directly and bf16 ``torch.mm`` (y = x W^T on bf16 operands), on the same operands. Shapes:
M = 16384 tokens with (K, N) of Llama 3 8B and 70B projections (attention q/o and k/v, FFN up and
down), and 8192^3. The % matmul column is the share of the *measured bf16* rate, so float8 can
exceed 100%.

Float8Linear (``float8_linear.<recipe>``, fwd+bwd, FLOPs 3 GEMMs = 6·M·N·K): ours (``titan``,
eager: the casts are already fused Triton kernels) against a bf16 ``nn.Linear`` (``eager``) and
torchao's Float8Linear under torch.compile (``torchao``, how torchtitan runs it), when torchao is
installed. Shapes: Llama 3 8B FFN at 16384 tokens.

Targets (H100/H200, one run): fp8_gemm ``_scaled_mm`` >= 1.6x ``torch.mm`` at 8192^3; ``titan-triton``
>= 0.9x ``_scaled_mm``; Float8Linear ``titan`` >= 1.3x ``eager`` at 8B FFN shapes and >= 1.0x
``torchao``. Read them off the ratio column of the table.

CPU: one small shape of each as a smoke test in the default run (the Triton interpreter is no
benchmark, so ``titan-triton`` is left out there). Run on a GPU:
``BENCH_OUT=bench/results/local/<name>-fp8 pytest bench/bench_fp8.py`` (bench/run_gpu.sh does it).
"""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import titan_kernels as tk
from bench import common
from titan_kernels.nn import Float8Linear
from titan_kernels.ops import fp8 as ops_fp8

DEV = common.device()
E4M3 = torch.float8_e4m3fn
if DEV.type == "cuda":
    M = 16384
    GEMM_SHAPES = {  # name: (M, K, N)
        "8B.attn_qo": (M, 4096, 4096), "8B.attn_kv": (M, 4096, 1024),
        "8B.ffn_up": (M, 4096, 14336), "8B.ffn_down": (M, 14336, 4096),
        "70B.attn_qo": (M, 8192, 8192), "70B.attn_kv": (M, 8192, 1024),
        "70B.ffn_up": (M, 8192, 28672), "70B.ffn_down": (M, 28672, 8192),
        "8192^3": (8192, 8192, 8192),
    }
    LINEAR_SHAPES = {"8B.ffn_up": (M, 4096, 14336), "8B.ffn_down": (M, 14336, 4096)}
    HP = torch.bfloat16
else:
    GEMM_SHAPES = {"cpu-smoke": (128, 128, 128)}
    LINEAR_SHAPES = {"cpu-smoke": (128, 128, 128)}
    HP = torch.float32  # no bf16 units on our CPUs


def _torchao():
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except Exception:  # not installed, or a build that does not match this torch
        return None
    return Float8LinearConfig, convert_to_float8_training


# --------------------------------------------------------------------------- GEMM


@functools.lru_cache(maxsize=2)
def _gemm_operands(m, k, n, gran):
    x = torch.randn(m, k, device=DEV, dtype=HP)
    w = torch.randn(n, k, device=DEV, dtype=HP) * 0.02
    xq, xs = tk.fp8_quantize(x, granularity=gran)
    wq, ws = tk.fp8_quantize(w, granularity=gran)
    return x, w, xq, xs, wq, ws


def _gemm_impls(gran):
    impls = {
        "torch.mm": lambda x, w, xq, xs, wq, ws: torch.mm(x, w.t()),
        "titan": lambda x, w, xq, xs, wq, ws: tk.fp8_gemm(xq, wq, xs, ws, out_dtype=HP),
    }
    if ops_fp8.scaled_mm_available(DEV):
        # _scaled_mm's own conventions: b column-major, rowwise scales (M, 1) and (1, N).
        def scaled_mm(x, w, xq, xs, wq, ws):
            return torch._scaled_mm(xq, wq.t(), xs, ws.t() if ws.dim() else ws, out_dtype=HP)

        impls["_scaled_mm"] = scaled_mm
    if DEV.type == "cuda" and tk.available_backends(DEV)["triton"].available:
        from titan_kernels.triton import fp8_gemm as tri

        impls["titan-triton"] = lambda x, w, xq, xs, wq, ws: tri.fp8_gemm(xq, wq, xs, ws, HP, None, False)
    return impls


@pytest.mark.parametrize("impl", ["torch.mm", "_scaled_mm", "titan", "titan-triton"])
@pytest.mark.parametrize("gran", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("shape", list(GEMM_SHAPES))
def test_fp8_gemm(benchmark, shape, gran, impl):
    impls = _gemm_impls(gran)
    if impl not in impls:
        pytest.skip(f"{impl} does not run on {DEV.type} here")
    m, k, n = GEMM_SHAPES[shape]
    args = _gemm_operands(m, k, n, gran)
    fn = impls[impl]
    common.run(benchmark, lambda: fn(*args), op=f"fp8_gemm.{gran}", impl=impl, shape=f"{shape} {m}x{k}x{n}",
               dtype="e4m3; bf16 for the mm baseline", flops=2 * m * n * k, flop_dtype=torch.bfloat16)


# --------------------------------------------------------------------------- Float8Linear


@functools.lru_cache(maxsize=1)
def _linear_inputs(m, k, n):
    torch.manual_seed(0)
    return torch.randn(m, k, device=DEV, dtype=HP), torch.randn(m, n, device=DEV, dtype=HP)


def _linear_module(impl, recipe, k, n):
    lin = nn.Linear(k, n, bias=False, device=DEV, dtype=HP)
    if impl == "eager":
        return lin
    if impl == "titan":
        return Float8Linear.from_float(lin, recipe)
    ao = _torchao()
    if ao is None:
        return None
    config_cls, convert = ao
    model = nn.Sequential(lin)
    convert(model, config=config_cls.from_recipe_name(recipe))
    return torch.compile(model, dynamic=False)


@pytest.mark.parametrize("impl", ["eager", "titan", "torchao"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("shape", list(LINEAR_SHAPES))
def test_float8_linear_fwd_bwd(benchmark, shape, recipe, impl):
    m, k, n = LINEAR_SHAPES[shape]
    mod = _linear_module(impl, recipe, k, n)
    if mod is None:
        pytest.skip("torchao is not installed (pip install torchao) or does not import with this torch")
    x, g = _linear_inputs(m, k, n)
    x = x.detach().requires_grad_()
    params = [p for p in mod.parameters()]

    def step():
        y = mod(x)
        return torch.autograd.grad(y, [x, *params], g)

    common.run(benchmark, step, op=f"float8_linear.{recipe}", impl=impl, shape=f"{shape} {m}x{k}x{n}",
               dtype=str(HP).replace("torch.", ""), flops=6 * m * n * k, flop_dtype=torch.bfloat16)
