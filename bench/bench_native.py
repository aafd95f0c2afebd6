"""Native kernel benchmarks (csrc/): the ``cpu`` / ``cuda`` backends against eager PyTorch and, on a
GPU, against our Triton kernels, at the shapes of the native-kernel targets.

Targets:
  CPU, [8192, 4096] float32 and bf16, one run on the dev machine: ``cpu`` RMSNorm forward+backward
  >= 1.5x eager ``F.rms_norm`` with autograd; rotary (q 8192 x 32 x 128, k 8192 x 8 x 128, i.e.
  q is [8192, 4096]) >= 2x the eager rotate-half formula.
  CUDA, 16k x 4096 bf16: ``cuda`` RMSNorm and rotary >= 90% of the measured copy bandwidth and
  faster than ``triton``.

Roofline bytes: RMSNorm forward reads x and writes y (2 M N elements), backward reads dy and x and
writes dx (3 M N); rotary reads q, k and writes both (2 (n_heads + n_kv_heads) head_dim per token),
the same again for the backward. FLOPs are negligible: the ceiling is the copy bandwidth.

Default run: a small CPU shape as a smoke test. The target shapes (about 2 minutes here):
  BENCH_OUT=bench/results/local/$(date -u +%F)-cpu pytest -m slow bench/bench_native.py
On a GPU (bench/run_gpu.sh): ``pytest bench/bench_native.py`` runs the 16k x 4096 bf16 shapes.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import titan_kernels as tk
from bench import common
from bench.bench_rotary import eager_rope
from titan_kernels import backend

DEV = common.device()
ON_CUDA = DEV.type == "cuda"
NATIVE = "cuda" if ON_CUDA else "cpu"

# (rows, hidden) for RMSNorm; (batch, seq, n_heads, n_kv_heads, head_dim) for rotary.
if ON_CUDA:
    RMS_CASES = [pytest.param((16384, 4096), torch.bfloat16, id="16384x4096-bf16")]
    ROPE_CASES = [pytest.param((1, 16384, 32, 8, 128), torch.bfloat16, id="s16384-h32/8-bf16")]
else:
    slow = pytest.mark.slow
    RMS_CASES = [pytest.param((512, 1024), torch.float32, id="512x1024-f32")] + [
        pytest.param((8192, 4096), dt, id=f"8192x4096-{str(dt)[6:]}", marks=slow)
        for dt in (torch.float32, torch.bfloat16)
    ]
    ROPE_CASES = [pytest.param((1, 512, 8, 2, 128), torch.float32, id="s512-h8/2-f32")] + [
        pytest.param((1, 8192, 32, 8, 128), dt, id=f"s8192-h32/8-{str(dt)[6:]}", marks=slow)
        for dt in (torch.float32, torch.bfloat16)
    ]


def _available(name: str) -> bool:
    st = backend.backend_status(name, DEV)
    return st.available and not (name == "triton" and not ON_CUDA)  # the interpreter is no benchmark


IMPLS = ["eager"] + [f"titan-{b}" for b in (NATIVE, "triton") if _available(b)]


def _skip_unavailable(impl: str) -> None:
    if impl.startswith("titan-") and not _available(impl[6:]):
        pytest.skip(f"{impl}: {backend.backend_status(impl[6:], DEV).reason or 'not benchmarked on ' + DEV.type}")


def _elem(dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


# ------------------------------------------------------------------------------ RMSNorm


@functools.lru_cache(maxsize=2)
def _rms_inputs(shape, dtype):
    x = torch.randn(shape, device=DEV, dtype=dtype)
    return x, torch.randn(shape[-1], device=DEV, dtype=dtype), torch.randn_like(x)


def _rms_fn(impl):
    if impl == "eager":
        return lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6)

    def f(x, w):
        with tk.use_backend(impl[6:]):
            return tk.rms_norm(x, w, 1e-6)

    return f


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("pass_", ["fwd", "bwd", "fwd+bwd"])
@pytest.mark.parametrize("shape,dtype", RMS_CASES)
def test_rms_norm(benchmark, shape, dtype, pass_, impl):
    _skip_unavailable(impl)
    x, w, dy = _rms_inputs(shape, dtype)
    fn = _rms_fn(impl)
    mn = shape[0] * shape[1] * _elem(dtype)
    if pass_ == "fwd":
        call, moved = (lambda: fn(x, w)), 2 * mn
    else:
        xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
        if pass_ == "bwd":
            y = fn(xg, wg)
            call, moved = (lambda: torch.autograd.grad(y, (xg, wg), dy, retain_graph=True)), 3 * mn
        else:
            call, moved = (lambda: torch.autograd.grad(fn(xg, wg), (xg, wg), dy)), 5 * mn
    common.run(benchmark, call, op=f"rms_norm.{pass_}", impl=impl, shape=f"{shape[0]}x{shape[1]}", dtype=dtype,
               bytes_moved=moved)


# ------------------------------------------------------------------------------ rotary


@functools.lru_cache(maxsize=2)
def _rope_inputs(shape, dtype):
    b, s, hq, hk, d = shape
    q = torch.randn(b, s, hq, d, device=DEV, dtype=dtype)
    k = torch.randn(b, s, hk, d, device=DEV, dtype=dtype)
    cos, sin = tk.rope_cos_sin(d, s, 500000.0, device=DEV)
    return q, k, cos, sin, torch.randn_like(q), torch.randn_like(k)


def _rope_fn(impl):
    if impl == "eager":
        return eager_rope

    def f(q, k, cos, sin):
        with tk.use_backend(impl[6:]):
            return tk.apply_rotary_emb(q, k, cos, sin)  # rotate-half layout, as the eager formula

    return f


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("pass_", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("shape,dtype", ROPE_CASES)
def test_rotary(benchmark, shape, dtype, pass_, impl):
    _skip_unavailable(impl)
    q, k, cos, sin, gq, gk = _rope_inputs(shape, dtype)
    fn = _rope_fn(impl)
    b, s, hq, hk, d = shape
    moved = 2 * b * s * (hq + hk) * d * _elem(dtype)
    if pass_ == "fwd":
        call = lambda: fn(q, k, cos, sin)  # noqa: E731
    else:
        qg, kg = q.detach().requires_grad_(), k.detach().requires_grad_()
        call = lambda: torch.autograd.grad(fn(qg, kg, cos, sin), (qg, kg), (gq, gk))  # noqa: E731
        moved *= 2
    common.run(benchmark, call, op=f"rotary.{pass_}", impl=impl, shape=f"b{b} s{s} h{hq}/{hk} d{d}", dtype=dtype,
               bytes_moved=moved)


# ------------------------------------------------------------------------------ same results


@pytest.mark.parametrize("impl", IMPLS[1:])
def test_timed_implementations_agree(impl):
    """The rows of the table compute the same thing as the eager baselines (small shapes)."""
    _skip_unavailable(impl)
    x, w, _ = _rms_inputs((64, 1024), torch.float32)
    torch.testing.assert_close(_rms_fn(impl)(x, w), _rms_fn("eager")(x, w), rtol=1e-5, atol=1e-5)
    q, k, cos, sin, _, _ = _rope_inputs((1, 64, 4, 2, 128), torch.float32)
    for got, want in zip(_rope_fn(impl)(q, k, cos, sin), eager_rope(q, k, cos, sin)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
