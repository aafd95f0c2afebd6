"""fp8_gemm: every backend that runs here against float64 math on the dequantized operands.

Backends: torch._scaled_mm (runs on the CPU in torch >= 2.13; the native choice when no backend is
requested), the reference (dequantize + float32 matmul), our Triton kernel (pointer kernel, and the
TMA kernel forced, both under the interpreter). M in {1, 17, 264, 1000}; tensorwise, rowwise and
mixed scales; K and N that are not multiples of 16 (padded for _scaled_mm); e4m3/e5m2 operands;
three output dtypes; bias; transposed operands; zero sizes; errors; opcheck; torch.compile.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import titan_kernels as tk
from titan_kernels import backend
from titan_kernels.ops.fp8 import gemm_backend_name, scaled_mm
from tests.conftest import TEST_DEVICE

# torch._scaled_mm is checked wherever it runs, on the CPU too (tests/kernels/conftest.py).
pytestmark = pytest.mark.usefixtures("scaled_mm_when_available")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
OUT_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}


def _status(name):
    if name == "scaled_mm":
        ok = scaled_mm.scaled_mm_available(TEST_DEVICE)
        return ok, "" if ok else "this torch has no float8 torch._scaled_mm on " + TEST_DEVICE
    st = backend.backend_status("triton" if name.startswith("triton") else name, TEST_DEVICE)
    if name == "triton-tma" and st.available and TEST_DEVICE == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        return False, "TMA needs sm_90 or newer"
    return st.available, st.reason


def backends_here() -> list:
    out = []
    for name in ("scaled_mm", "reference", "triton", "triton-tma"):
        ok, why = _status(name)
        marks = [] if ok else [pytest.mark.skip(reason=f"{name} unavailable: {why}")]
        out.append(pytest.param(name, marks=marks, id=name))
    return out


BACKENDS = backends_here()


def gemm(be, a, b, sa, sb, **kw):
    """fp8_gemm through the public function on backend ``be`` (triton-tma: the launcher, forced)."""
    if be == "triton-tma":
        from titan_kernels.triton import fp8_gemm as tri

        return tri.fp8_gemm(a, b, sa, sb, kw.get("out_dtype", torch.bfloat16), kw.get("bias"),
                            kw.get("use_fast_accum", False), use_tma=True)
    ctx = contextlib.nullcontext() if be == "scaled_mm" else tk.use_backend(be)
    with ctx:
        if be == "scaled_mm":
            assert gemm_backend_name(a.device) == "scaled_mm"
        return tk.fp8_gemm(a, b, sa, sb, **kw)


def operands(m, n, k, dtype_a=E4M3, dtype_b=E4M3, gran="tensorwise"):
    """Quantized random operands: a (M, K), b (N, K) and their scales."""
    x = torch.randn(m, k, dtype=torch.float64).float().to(TEST_DEVICE) * 3 + 0.1
    w = torch.randn(n, k, dtype=torch.float64).float().to(TEST_DEVICE) + 0.1
    ga = gb = gran
    if gran == "mixed":
        ga, gb = "rowwise", "tensorwise"
    a, sa = tk.fp8_quantize(x, dtype=dtype_a, granularity=ga)
    b, sb = tk.fp8_quantize(w, dtype=dtype_b, granularity=gb)
    return a, b, sa, sb


def f64(a, b, sa, sb, bias=None):
    out = (a.double() * sa.double()) @ (b.double() * sb.double()).t()
    return out + bias.double() if bias is not None else out


def rel_err(y, ref) -> float:
    if ref.numel() == 0:
        return 0.0
    return ((y.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# --------------------------------------------------------------------------- values


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("gran", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("m", [1, 17, 264, 1000])
def test_gemm_m_sizes(be, gran, m):
    n, k = (48, 64) if be == "triton-tma" else (40, 72)  # TMA needs 16-byte rows; others take any
    a, b, sa, sb = operands(m, n, k, gran=gran)
    y = gemm(be, a, b, sa, sb)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16 and y.is_contiguous()
    assert rel_err(y, f64(a, b, sa, sb)) <= 2e-2


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("gran", ["tensorwise", "rowwise", "mixed"])
def test_gemm_out_dtypes_and_bias(be, out_dtype, gran):
    a, b, sa, sb = operands(33, 48, 96, gran=gran)
    bias = torch.randn(48, device=TEST_DEVICE).to(out_dtype)
    y = gemm(be, a, b, sa, sb, out_dtype=out_dtype, bias=bias)
    assert y.dtype == out_dtype
    assert rel_err(y, f64(a, b, sa, sb, bias)) <= OUT_TOL[out_dtype]
    y32 = gemm(be, a, b, sa, sb, out_dtype=out_dtype, bias=bias.float())  # a float32 bias
    assert rel_err(y32, f64(a, b, sa, sb, bias.float())) <= OUT_TOL[out_dtype]


@pytest.mark.parametrize("be", [b for b in BACKENDS if b.id != "triton-tma"])
@pytest.mark.parametrize("shape", [(5, 7, 3), (17, 33, 50), (3, 1, 17), (20, 16, 1)], ids=str)
def test_gemm_unaligned_k_n(be, shape):
    """K, N not multiples of 16: _scaled_mm pads them; the result is the same as unpadded math."""
    m, n, k = shape
    for gran in ("tensorwise", "rowwise"):
        a, b, sa, sb = operands(m, n, k, gran=gran)
        y = gemm(be, a, b, sa, sb, out_dtype=torch.float32)
        assert rel_err(y, f64(a, b, sa, sb)) <= 1e-5


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("dtypes", [(E4M3, E5M2), (E5M2, E4M3), (E5M2, E5M2)], ids=["e4m3xe5m2", "e5m2xe4m3", "e5m2xe5m2"])
def test_gemm_e5m2(be, dtypes):
    a, b, sa, sb = operands(20, 32, 64, *dtypes)
    y = gemm(be, a, b, sa, sb, out_dtype=torch.float32)
    assert rel_err(y, f64(a, b, sa, sb)) <= 1e-5


@pytest.mark.parametrize("be", BACKENDS)
def test_gemm_transposed_operands(be):
    """Operands in any layout, e.g. the weight-gradient GEMM's dy^T and x^T."""
    a0, b0, sa, sb = operands(32, 48, 64)
    a = a0.t().contiguous().t()  # (M, K) column-major
    b = b0.t().contiguous().t()
    y = gemm(be, a, b, sa, sb, out_dtype=torch.float32)
    assert rel_err(y, f64(a0, b0, sa, sb)) <= 1e-5
    # Colwise codes transposed: the row-major operands of dW = dy^T x.
    x = torch.randn(48, 32, device=TEST_DEVICE)  # 48 tokens: the K of this GEMM
    dy = torch.randn(48, 40, device=TEST_DEVICE)
    xq, xs = tk.fp8_quantize(x, granularity="colwise")
    dq, ds = tk.fp8_quantize(dy, granularity="colwise", dtype=E5M2)
    dw = gemm(be, dq.t(), xq.t(), ds.t(), xs.t(), out_dtype=torch.float32)
    assert rel_err(dw, f64(dq.t(), xq.t(), ds.t(), xs.t())) <= 1e-5


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("fast", [False, True], ids=["precise", "fast_accum"])
def test_gemm_fast_accum(be, fast):
    a, b, sa, sb = operands(24, 32, 128)
    y = gemm(be, a, b, sa, sb, use_fast_accum=fast)
    assert rel_err(y, f64(a, b, sa, sb)) <= 2e-2


@pytest.mark.parametrize("be", [b for b in BACKENDS if b.id != "triton-tma"])
@pytest.mark.parametrize("shape", [(0, 8, 16), (8, 0, 16), (8, 16, 0), (0, 0, 0)], ids=str)
def test_gemm_zero_size(be, shape):
    m, n, k = shape
    a = torch.randn(m, k, device=TEST_DEVICE).to(E4M3)
    b = torch.randn(n, k, device=TEST_DEVICE).to(E4M3)
    one = torch.ones((), device=TEST_DEVICE)
    bias = torch.randn(n, device=TEST_DEVICE)
    y = gemm(be, a, b, one, one, out_dtype=torch.float32, bias=bias)
    assert y.shape == (m, n)
    torch.testing.assert_close(y, bias.expand(m, n))  # an empty sum leaves the bias


def test_scaled_mm_fallback_paths():
    """The branches of the _scaled_mm wrapper other than the direct call agree with the reference."""
    if not scaled_mm.scaled_mm_available(TEST_DEVICE):
        pytest.skip("torch._scaled_mm unavailable on " + TEST_DEVICE)
    a, b, sa, sb = operands(19, 24, 40, gran="rowwise")
    ref_out = f64(a, b, sa, sb)
    real = scaled_mm._scaled_mm_works
    try:
        # Pretend rowwise is refused: the unit-scale float32 product, scaled afterwards.
        scaled_mm._scaled_mm_works = lambda dev, da, db, rowwise, out, bias: not rowwise and out == torch.float32
        y = scaled_mm.scaled_mm_gemm(a, b, sa, sb, torch.bfloat16, None, False)
        assert rel_err(y, ref_out) <= 2e-2
        # Pretend nothing is accepted: the Triton kernel or the reference takes over.
        scaled_mm._scaled_mm_works = lambda *args: False
        y = scaled_mm.scaled_mm_gemm(a, b, sa, sb, torch.float32, None, False)
        assert rel_err(y, ref_out) <= 1e-5
    finally:
        scaled_mm._scaled_mm_works = real


# --------------------------------------------------------------------------- errors


def test_errors():
    a, b, sa, sb = operands(8, 16, 32)
    bf = torch.randn(8, 32, device=TEST_DEVICE, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"a \(dtype\): expected torch.float8"):
        tk.fp8_gemm(bf, b, sa, sb)
    with pytest.raises(TypeError, match=r"b \(dtype\): expected torch.float8"):
        tk.fp8_gemm(a, bf, sa, sb)
    with pytest.raises(ValueError, match=r"b: expected shape \(N, K\) with K = a.shape\[1\] = 32"):
        tk.fp8_gemm(a, b[:, :16], sa, sb)
    with pytest.raises(ValueError, match="a_scale: expected shape"):
        tk.fp8_gemm(a, b, torch.ones(8, 2, device=TEST_DEVICE), sb)
    with pytest.raises(ValueError, match=r"b_scale: expected shape .*\(16, 1\)"):
        tk.fp8_gemm(a, b, sa, torch.ones(1, 16, device=TEST_DEVICE))  # _scaled_mm's (1, N) is not ours
    with pytest.raises(ValueError, match="a_scale: expected shape"):
        tk.fp8_gemm(a, b, torch.ones(7, 1, device=TEST_DEVICE), sb)
    with pytest.raises(TypeError, match="a_scale: expected a float32 tensor"):
        tk.fp8_gemm(a, b, sa.half(), sb)
    with pytest.raises(TypeError, match="out_dtype: expected one of"):
        tk.fp8_gemm(a, b, sa, sb, out_dtype=torch.int32)
    with pytest.raises(TypeError, match="out_dtype: expected one of"):
        tk.fp8_gemm(a, b, sa, sb, out_dtype=E4M3)
    with pytest.raises(ValueError, match=r"bias: expected shape \(16,\)"):
        tk.fp8_gemm(a, b, sa, sb, bias=torch.randn(15, device=TEST_DEVICE))
    with pytest.raises(ValueError, match="a: expected a 2-D tensor"):
        tk.fp8_gemm(a.reshape(2, 4, 32), b, sa, sb)
    with pytest.raises(TypeError, match="use_fast_accum: expected a bool"):
        tk.fp8_gemm(a, b, sa, sb, use_fast_accum=None)


# --------------------------------------------------------------------------- op contract


@pytest.mark.parametrize("be", [b for b in BACKENDS if b.id != "triton-tma"])
@pytest.mark.parametrize("gran", ["tensorwise", "rowwise"])
def test_opcheck(be, gran):
    a, b, sa, sb = operands(12, 16, 32, gran=gran)
    bias = torch.randn(16, device=TEST_DEVICE, dtype=torch.bfloat16)
    # opcheck's test_schema compares inputs before/after with float math that float8 lacks
    # ("mul_cpu_reduced_float" not implemented for Float8_e4m3fn), so the schema part (no mutation,
    # no aliasing) is checked by hand below, on the bytes.
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    ctx = contextlib.nullcontext() if be == "scaled_mm" else tk.use_backend(be)
    with ctx:
        for aa, bb in ((a, b), (a.t().contiguous().t(), b.t().contiguous().t())):  # contiguous and transposed
            for args in ((aa, bb, sa, sb, torch.bfloat16, bias, False), (aa, bb, sa, sb, torch.float32, None, True)):
                torch.library.opcheck(torch.ops.titan.fp8_gemm, args, test_utils=utils)
                before = [t.view(torch.uint8).clone() if t.dtype in (E4M3, E5M2) else t.clone() for t in args[:4]]
                out = torch.ops.titan.fp8_gemm(*args)
                for t, t0 in zip(args[:4], before):
                    assert torch.equal(t.view(torch.uint8) if t.dtype in (E4M3, E5M2) else t, t0)
                    assert out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


@pytest.mark.parametrize("be", [b for b in BACKENDS if b.id != "triton-tma"])
def test_compile_fullgraph(be):
    def f(x, w):
        xq, xs = tk.fp8_quantize(x, granularity="rowwise")
        wq, ws = tk.fp8_quantize(w, granularity="rowwise")
        return tk.fp8_gemm(xq, wq, xs, ws, out_dtype=torch.float32)

    x = torch.randn(17, 48, device=TEST_DEVICE)
    w = torch.randn(24, 48, device=TEST_DEVICE)
    ctx = contextlib.nullcontext() if be == "scaled_mm" else tk.use_backend(be)
    with ctx:
        eager = f(x, w)
        compiled = torch.compile(f, fullgraph=True, dynamic=False)(x, w)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    assert rel_err(eager, x.double() @ w.double().t()) < 7e-2
