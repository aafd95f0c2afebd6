"""fp8_quantize: every backend that runs here against a float64 formula and against each other.

Checks: scales exact (bit-equal across backends; equal to the float64 formula to float32 rounding,
exactly for power-of-2 scales); codes correctly rounded (within half an fp8 step of x / scale);
saturation at +-448 (e4m3) and +-57344 (e5m2); zero tensors, rows and columns; NaN; awkward,
transposed, 3-D and zero-size inputs; errors; opcheck (fake strides included) and torch.compile.
Triton runs under TRITON_INTERPRET=1 (tests/conftest.py), so shapes stay small.
"""
from __future__ import annotations

import math

import pytest
import torch

import titan_kernels as tk
from titan_kernels import backend
from titan_kernels.ops import fp8 as ops_fp8
from titan_kernels.reference import fp8 as ref
from tests.conftest import TEST_DEVICE
from tests.kernels.helpers import backends_here

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FMT = {E4M3: (3, -6), E5M2: (2, -14)}  # mantissa bits, smallest normal exponent
GRANS = ("tensorwise", "rowwise", "colwise")


BACKENDS = backends_here(names=("reference", "triton"))


def randn(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(shape, dtype=torch.float64) * scale + 0.1).to(dtype).to(TEST_DEVICE)


def quantize(be, x, **kw):
    with tk.use_backend(be):
        return tk.fp8_quantize(x, **kw)


def f64_scale(x: torch.Tensor, dtype, gran: str) -> torch.Tensor:
    """The float64 formula: max(amax, 1e-12) / fp8_max over each group."""
    a = x.double().abs()
    if gran == "tensorwise":
        a = a.amax() if a.numel() else a.new_zeros(())
    elif gran == "rowwise":
        a = a.amax(1, keepdim=True) if a.shape[1] else a.new_zeros(a.shape[0], 1)
    else:
        a = a.amax(0, keepdim=True) if a.shape[0] else a.new_zeros(1, a.shape[1])
    return a.clamp_min(1e-12) / ref.FP8_MAX[dtype]


def fp8_step(v: torch.Tensor, dtype) -> torch.Tensor:
    """The spacing of the fp8 grid at |v| (float64)."""
    mant, emin = FMT[dtype]
    e = torch.floor(torch.log2(v.abs().clamp_min(2.0**emin)))
    return torch.exp2(e - mant)


def check_codes(x, codes, scale, dtype):
    """Every code is x * mult rounded to nearest on the fp8 grid (saturated at fp8_max)."""
    m = ref.FP8_MAX[dtype]
    v = (x.double() * (1.0 / scale.double())).clamp(-m, m)
    err = (codes.double() - v).abs()
    # Half a step (correct rounding), plus the float32 rounding of x * mult before the cast.
    bound = 0.5 * fp8_step(v, dtype) * (1 + 1e-6) + v.abs() * 2.0**-23
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"


# --------------------------------------------------------------------------- values


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("gran", GRANS)
@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (130, 3), (33, 300)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_quantize_against_float64(be, dtype, gran, shape):
    x = randn(*shape, scale=5.0)
    codes, scale = quantize(be, x, dtype=dtype, granularity=gran)
    assert codes.dtype == dtype and codes.shape == x.shape and scale.dtype == torch.float32
    assert scale.shape == {"tensorwise": (), "rowwise": (shape[0], 1), "colwise": (1, shape[1])}[gran]
    # Scales: the float64 formula up to float32 rounding (1 / (fp8_max / amax) rounds twice).
    s64 = f64_scale(x, dtype, gran)
    assert ((scale.double() - s64).abs() / s64).max().item() < 2.5e-7
    check_codes(x, codes, scale, dtype)
    # Dequantized tensor against x: e4m3 has 3 mantissa bits, e5m2 2.
    deq = codes.double() * scale.double()
    rel = ((deq - x.double()).norm() / x.double().norm()).item()
    assert rel < (7e-2 if dtype == E4M3 else 1.5e-1)


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("gran", GRANS)
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("pow2", [False, True], ids=["exact", "pow2"])
def test_backends_bit_equal(dtype, gran, xdtype, pow2):
    """Triton and the reference give the same scales and codes, bit for bit."""
    if not backend.backend_status("triton", TEST_DEVICE).available:
        pytest.skip("triton backend unavailable: " + backend.backend_status("triton", TEST_DEVICE).reason)
    x = randn(45, 70, dtype=xdtype, scale=30.0)
    x[3] = 0  # a zero row
    x[:, 5] = 0  # and a zero column
    c_ref, s_ref = quantize("reference", x, dtype=dtype, granularity=gran, round_scales_to_power_of_2=pow2)
    c_tri, s_tri = quantize("triton", x, dtype=dtype, granularity=gran, round_scales_to_power_of_2=pow2)
    assert torch.equal(s_tri, s_ref)
    assert torch.equal(c_tri.view(torch.uint8), c_ref.view(torch.uint8))
    assert c_tri.stride() == c_ref.stride()


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("gran", GRANS)
def test_power_of_2_scales(be, gran):
    x = randn(9, 20, scale=7.0)
    codes, scale = quantize(be, x, granularity=gran, round_scales_to_power_of_2=True)
    # The scale is the float64 one rounded up to a power of two (the multiplier rounded down).
    s64 = f64_scale(x, E4M3, gran)
    expect = torch.exp2(-torch.floor(torch.log2(1.0 / s64)))
    assert torch.equal(scale.double(), expect)
    check_codes(x, codes, scale, E4M3)
    assert codes.float().abs().max().item() <= 448


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_saturation(be, dtype):
    m = ref.FP8_MAX[dtype]
    x = randn(6, 40, scale=100.0)
    # The largest |x| of each group maps to exactly +-fp8_max.
    for gran, dim in (("tensorwise", None), ("rowwise", 1), ("colwise", 0)):
        codes, _ = quantize(be, x, dtype=dtype, granularity=gran)
        top = codes.float().abs().amax() if dim is None else codes.float().abs().amax(dim)
        assert bool((top == m).all()), (gran, top)
    # An amax below the true one (e.g. a stale one) saturates to +-fp8_max: never inf or NaN.
    with tk.use_backend(be):
        codes, scale = ops_fp8.fp8_quantize_from_amax(x, x.abs().amax() / 8, dtype)
    assert codes.float().isfinite().all()
    assert codes.float().abs().max().item() == m
    big = x.abs() > x.abs().amax() / 8
    assert bool((codes.float()[big].abs() == m).all())
    assert torch.equal(codes.float()[big].sign(), x[big].sign())


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [False, True], ids=["exact", "pow2"])
def test_zero_tensor_rows_and_columns(be, dtype, pow2):
    kw = dict(dtype=dtype, round_scales_to_power_of_2=pow2)
    z = torch.zeros(5, 24, device=TEST_DEVICE)
    for gran in GRANS:
        codes, scale = quantize(be, z, granularity=gran, **kw)
        assert bool((scale.isfinite() & (scale > 0)).all()), (gran, scale)
        assert not codes.float().any()
    x = randn(5, 24, scale=3.0)
    x[2] = 0
    x[:, 7] = 0
    codes, scale = quantize(be, x, granularity="rowwise", **kw)
    assert bool((scale.isfinite() & (scale > 0)).all()) and not codes[2].float().any()
    assert codes[0].float().abs().max() > 0
    codes, scale = quantize(be, x, granularity="colwise", **kw)
    assert bool((scale.isfinite() & (scale > 0)).all()) and not codes[:, 7].float().any()


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered")
def test_nan_makes_its_group_scale_nan(be):
    x = randn(4, 10)
    x[1, 3] = float("nan")
    _, s = quantize(be, x, granularity="rowwise")
    assert s[1].isnan().all() and s[[0, 2, 3]].isfinite().all()
    _, s = quantize(be, x, granularity="colwise")
    assert s[0, 3].isnan() and s[0, :3].isfinite().all()
    _, s = quantize(be, x)
    assert s.isnan()


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("gran", GRANS)
def test_strided_inputs(be, gran):
    base = randn(48, 30, scale=4.0)
    for x in (base.t(), base[::3, 1:28], base[:, ::2]):
        codes, scale = quantize(be, x, granularity=gran)
        c2, s2 = quantize("reference", x.contiguous(), granularity=gran)
        assert torch.equal(scale, s2)
        assert torch.equal(codes.view(torch.uint8), c2.view(torch.uint8))


@pytest.mark.parametrize("be", BACKENDS)
def test_layouts(be):
    x = randn(6, 10)
    codes, _ = quantize(be, x, granularity="colwise")
    assert codes.stride() == (1, 6)  # column-major: codes.t() is the row-major operand
    assert codes.t().is_contiguous()
    for gran in ("tensorwise", "rowwise"):
        assert quantize(be, x, granularity=gran)[0].is_contiguous()


@pytest.mark.parametrize("be", BACKENDS)
def test_tensorwise_any_rank(be):
    for shape in [(), (17,), (2, 3, 35), (2, 1, 3, 4)]:
        x = randn(*shape, scale=2.0)
        codes, scale = quantize(be, x)
        assert codes.shape == x.shape and scale.shape == ()
        c2, s2 = quantize("reference", x.reshape(1, -1))
        assert torch.equal(scale, s2) and torch.equal(codes.reshape(1, -1).view(torch.uint8), c2.view(torch.uint8))


@pytest.mark.parametrize("be", BACKENDS)
def test_tensorwise_many_programs(be):
    # Enough tiles that several programs each write a partial amax (pass 1) that pass 2 combines.
    x = randn(300, 300)
    x[217, 123] = 1000.0
    codes, scale = quantize(be, x)
    assert scale.item() == pytest.approx(1000.0 / 448, rel=1e-6)
    assert codes[217, 123].float().item() == 448


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="exercises the interpreter's multi-chunk path; CUDA rows fit one block")
def test_rowwise_wide_rows_triton():
    if not backend.backend_status("triton", TEST_DEVICE).available:
        pytest.skip("triton backend unavailable")
    x = randn(3, 17000, scale=2.0)  # wider than one block: two passes over column chunks
    x[1, 16900] = 77.0
    c1, s1 = quantize("triton", x, granularity="rowwise")
    c0, s0 = quantize("reference", x, granularity="rowwise")
    assert torch.equal(s1, s0) and torch.equal(c1.view(torch.uint8), c0.view(torch.uint8))


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (0, 0)], ids=str)
def test_zero_size(be, shape):
    x = torch.randn(*shape, device=TEST_DEVICE)
    for gran in GRANS:
        codes, scale = quantize(be, x, granularity=gran)
        assert codes.shape == x.shape
        assert scale.isfinite().all() and (scale > 0).all()
    codes, scale = quantize(be, torch.randn(0, device=TEST_DEVICE))
    assert codes.shape == (0,) and scale.item() == pytest.approx(1e-12 / 448)


# --------------------------------------------------------------------------- errors


def test_errors():
    x = randn(4, 8)
    with pytest.raises(TypeError, match="x: expected dtype"):
        tk.fp8_quantize(torch.ones(4, 8, dtype=torch.int32, device=TEST_DEVICE))
    with pytest.raises(TypeError, match="x: expected a torch.Tensor"):
        tk.fp8_quantize([1.0, 2.0])
    with pytest.raises(TypeError, match="dtype: expected torch.float8"):
        tk.fp8_quantize(x, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="granularity: expected one of"):
        tk.fp8_quantize(x, granularity="blockwise")
    with pytest.raises(ValueError, match="x: rowwise granularity expects a 2-D tensor"):
        tk.fp8_quantize(randn(2, 3, 4), granularity="rowwise")
    with pytest.raises(TypeError, match="round_scales_to_power_of_2: expected a bool"):
        tk.fp8_quantize(x, round_scales_to_power_of_2=1)


# --------------------------------------------------------------------------- op contract


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("gran", GRANS)
def test_opcheck(be, gran):
    base = randn(12, 20)
    with tk.use_backend(be):
        for x in (base, base.t()):  # contiguous and transposed
            for dtype in (E4M3, E5M2):
                torch.library.opcheck(torch.ops.titan.fp8_quantize, (x, dtype, gran, gran != "tensorwise"))


@pytest.mark.parametrize("be", BACKENDS)
def test_fake_strides_match(be):
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = randn(9, 14)
    with tk.use_backend(be):
        for gran in GRANS:
            real = torch.ops.titan.fp8_quantize(x, E4M3, gran, False)
            with FakeTensorMode() as mode:
                fake = torch.ops.titan.fp8_quantize(mode.from_tensor(x), E4M3, gran, False)
            for r, f in zip(real, fake):
                assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype), gran


@pytest.mark.parametrize("be", BACKENDS)
def test_compile_fullgraph(be):
    def f(x):
        c1, s1 = tk.fp8_quantize(x, granularity="rowwise", round_scales_to_power_of_2=True)
        c2, s2 = tk.fp8_quantize(x, dtype=E5M2, granularity="colwise")
        c3, s3 = tk.fp8_quantize(x)
        return c1.float() * s1, c2.float() * s2, c3.float() * s3

    x = randn(10, 24, scale=3.0)
    with tk.use_backend(be):
        eager = f(x)
        compiled = torch.compile(f, fullgraph=True, dynamic=False)(x)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert math.isfinite(float(compiled[0].sum()))
