"""The clamped SwiGLU variant (GPT-OSS: alpha 1.702, limit 7, up_offset 1) of titan::swiglu: every
backend against a float64 torch composition written as Hugging Face's GptOssExperts._apply_gate,
forward and backward, at awkward shapes and strides (gate/up interleaved as GPT-OSS's gate_up_proj
has them), values straddling and exactly at +-limit, NaN, second derivatives, the two autograd paths,
opcheck, torch.compile, the native ISA builds, argument errors; and that the plain default path is the
plain kernels' call, unchanged. The plain SwiGLU itself: tests/kernels/test_swiglu.py.

Triton kernels run under TRITON_INTERPRET=1 (set in tests/conftest.py), so shapes stay small.
"""
from __future__ import annotations

import contextlib
import functools

import pytest
import torch

import titan_kernels as tk
from titan_kernels import backend
from titan_kernels.ops import swiglu as swiglu_ops
from titan_kernels.reference import swiglu as ref
from tests.conftest import TEST_DEVICE
from tests.kernels import swiglu_checks as checks
from tests.kernels.helpers import TOL, backends_here, cpu_capability, cpu_capability_params, rel_err

BACKENDS = backends_here(names=("reference", "triton", "cpu"))
GPT_OSS = {"alpha": 1.702, "limit": 7.0, "up_offset": 1.0}
# GPT-OSS; no limit; a limit only; all three off their defaults with a small limit and negative offset.
VARIANTS = [GPT_OSS, {"alpha": 1.702, "limit": None, "up_offset": 1.0}, {"alpha": 1.0, "limit": 3.0, "up_offset": 0.0},
            {"alpha": 2.5, "limit": 0.5, "up_offset": -0.75}]
VARIANT_IDS = ["gpt_oss", "no_limit", "limit_only", "small_limit"]


def gate64(gate, up, alpha, limit, up_offset):
    """GPT-OSS's gate in float64, as Hugging Face's GptOssExperts._apply_gate writes it (torch.clamp)."""
    if limit is not None:
        gate = gate.clamp(min=None, max=limit)
        up = up.clamp(min=-limit, max=limit)
    return (up + up_offset) * gate * torch.sigmoid(gate * alpha)


def f64(gate, up, dy, scalars):
    """y, dgate, dup in float64 by autograd of ``gate64``, from the inputs as stored."""
    return checks.f64(gate, up, dy, functools.partial(gate64, **scalars))


def straddling(*shape, dtype=torch.float32, limit=7.0):
    """Random values of which about a third lie beyond +-limit; exact +-limit and the nearest values
    on each side of them in the first row (where it is wide enough)."""
    x = torch.randn(*shape, dtype=torch.float64) * limit
    flat = x.view(-1, shape[-1]) if x.numel() else x
    if x.numel() and shape[-1] >= 6:
        lim = torch.tensor(limit, dtype=dtype)
        above, below = torch.nextafter(lim, lim + 1).item(), torch.nextafter(lim, lim - 1).item()
        flat[0, :6] = torch.tensor([limit, -limit, above, below, -above, -below], dtype=torch.float64)
    return x.to(dtype).to(TEST_DEVICE)


def check(be, gate, up, scalars, what=""):
    checks.check(be, gate, up, scalars, functools.partial(gate64, **scalars), what)


# --------------------------------------------------------------------------- forward + backward vs float64


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scalars", VARIANTS, ids=VARIANT_IDS)
def test_matches_float64(be, dtype, scalars):
    lim = scalars["limit"] or 7.0
    for shape in [(1,), (7,), (3, 33), (2, 5, 96), (3, 1100)]:  # 1100: several vectors and a tail
        check(be, straddling(*shape, dtype=dtype, limit=lim), straddling(*shape, dtype=dtype, limit=lim), scalars,
              shape)


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_interleaved_and_strided(be, dtype):
    """GPT-OSS's gate_up_proj output interleaves gate (even columns) and up (odd): the two strided
    views go in as they are, and the gradient reaches the fused tensor."""
    h = 45
    gate_up = straddling(6, 7, 2 * h, dtype=dtype)
    base = straddling(50, 3 * h, dtype=dtype)
    views = {
        "interleaved": (gate_up[..., ::2], gate_up[..., 1::2]),
        "halves": (gate_up[..., :h], gate_up[..., h:]),
        "transposed": (straddling(h, 20, dtype=dtype).t(), straddling(h, 20, dtype=dtype).t()),
        "every_other_row": (base[::2, :h], base[1::2, :h]),
        "expanded": (straddling(1, h, dtype=dtype).expand(9, h), straddling(9, h, dtype=dtype)),
    }
    for name, (g, u) in views.items():
        check(be, g, u, GPT_OSS, name)

    fused = gate_up.detach().requires_grad_()
    dy = torch.randn(6, 7, h, dtype=torch.float64).to(dtype).to(TEST_DEVICE)
    with tk.use_backend(be):
        (d_fused,) = torch.autograd.grad(tk.swiglu(fused[..., ::2], fused[..., 1::2], **GPT_OSS), fused, dy)
    f = gate_up.detach().double().requires_grad_()
    (want,) = torch.autograd.grad(gate64(f[..., ::2], f[..., 1::2], **GPT_OSS), f, dy.double())
    assert rel_err(d_fused, want) < TOL[dtype]


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_clamp_boundaries_follow_torch_clamp(be, dtype):
    """At exactly +-limit the gradient passes (torch.clamp's inclusive bounds), one step beyond it is 0;
    NaN: y is NaN, the clamped argument's gradient 0 (torch.clamp's backward), the other one's NaN."""
    lim = 7.0
    above, below = (torch.nextafter(torch.tensor(lim, dtype=dtype), torch.tensor(d, dtype=dtype)).item()
                    for d in (8.0, 6.0))
    nan = float("nan")
    g = torch.tensor([lim, above, below, -lim, -above, 1.0, 2.0, 3.0, nan, 1.0], dtype=dtype)
    u = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, lim, -lim, above, 1.0, nan], dtype=dtype)
    g, u = g.to(TEST_DEVICE), u.to(TEST_DEVICE)
    dy = torch.ones_like(g)
    y, dg, du = checks.run(be, g, u, dy, GPT_OSS)
    y64, dg64, du64 = f64(g, u, dy, GPT_OSS)
    for name, a, b in (("y", y, y64), ("dgate", dg, dg64), ("dup", du, du64)):
        assert torch.equal(a.isnan(), b.isnan()), (name, a, b)
        assert torch.equal(a == 0, b == 0), (name, a, b)  # the masks: exact zeros where torch's are
        fin = ~b.isnan()
        assert rel_err(a[fin], b[fin]) < TOL[dtype], (name, rel_err(a[fin], b[fin]))
    assert dg[0] != 0 and dg[1] == 0 and du[5] != 0 and du[6] != 0 and du[7] == 0
    assert dg[8] == 0 and du[9] == 0  # NaN: 0 through the clamp, as torch.clamp's backward


@pytest.mark.parametrize("be", BACKENDS)
def test_no_limit_lets_nan_through(be):
    """Without a limit nothing is clamped: a NaN gate gives NaN gradients (no mask hides it)."""
    g = torch.tensor([float("nan"), 1.0, 50.0, -50.0], device=TEST_DEVICE)
    u = torch.tensor([1.0, float("nan"), 20.0, -20.0], device=TEST_DEVICE)
    scalars = {"alpha": 1.702, "limit": None, "up_offset": 1.0}
    y, dg, du = checks.run(be, g, u, torch.ones_like(g), scalars)
    y64, dg64, du64 = f64(g, u, torch.ones_like(g), scalars)
    for a, b in ((y, y64), (dg, dg64), (du, du64)):
        assert torch.equal(a.isnan(), b.isnan()), (a, b)
        assert rel_err(a[~b.isnan()], b[~b.isnan()]) < 1e-5


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("shape", [(0, 16), (2, 0, 16), (3, 0)])
def test_zero_size(be, shape):
    checks.check_zero_size(be, shape, GPT_OSS)


# --------------------------------------------------------------------------- the plain default path


@pytest.mark.parametrize("be", BACKENDS)
def test_defaults_are_the_plain_kernels_call(be):
    """The defaults (and the same values spelled out) reach each backend's kernels as the plain call
    (gate, up) / (dy, gate, up), with no scalars, so the plain path runs the kernels it always ran; a
    variant passes all three."""
    calls = []
    with contextlib.ExitStack() as stack:
        for impl in list(backend.implementations(swiglu_ops.OP)):
            def spy_fwd(*a, _fwd=impl.kernels.forward):
                calls.append(("fwd", len(a)))
                return _fwd(*a)

            def spy_bwd(*a, _bwd=impl.kernels.backward):
                calls.append(("bwd", len(a)))
                return _bwd(*a)

            stack.enter_context(backend.replace_impl(swiglu_ops.OP, impl.name, (spy_fwd, spy_bwd), impl.family))
        g, u, dy = (torch.randn(5, 40, device=TEST_DEVICE) for _ in range(3))
        got = {}
        for name, kw in (("default", {}), ("spelled", {"alpha": 1, "limit": None, "up_offset": 0.0}),
                         ("gpt_oss", GPT_OSS)):
            calls.clear()
            got[name] = checks.run(be, g, u, dy, kw)
            assert calls == ([("fwd", 2), ("bwd", 3)] if name != "gpt_oss" else [("fwd", 5), ("bwd", 6)]), name
    for a, b in zip(got["default"], got["spelled"]):
        assert torch.equal(a, b)
    want = f64(g, u, dy, {"alpha": 1.0, "limit": None, "up_offset": 0.0})
    assert all(rel_err(a, b) < 1e-5 for a, b in zip(got["default"], want))


# --------------------------------------------------------------------------- one autograd definition


@pytest.mark.parametrize("be", BACKENDS)
def test_fast_path_equals_op_path(be):
    checks.check_fast_path_equals_op_path(be, straddling(5, 40), straddling(5, 40),
                                          torch.randn(5, 40, device=TEST_DEVICE), GPT_OSS)


@pytest.mark.parametrize("path", ["fast", "op"])
def test_backward_gets_the_forward_backend_and_scalars(path):
    scalars = {"alpha": 2, "limit": 3, "up_offset": -1}  # integers: the op path gets them as floats
    assert checks.backward_calls(path, straddling(3, 8), straddling(3, 8), scalars) == [("reference", (2.0, 3.0, -1.0))]


# --------------------------------------------------------------------------- second order


class _RefFn(torch.autograd.Function):
    """The reference forward, backward and double backward of the variant, for gradgradcheck in float64."""

    @staticmethod
    def forward(ctx, g, u, scalars):
        ctx.save_for_backward(g, u)
        ctx.scalars = scalars
        return ref.swiglu_fwd(g, u, *scalars)

    @staticmethod
    def backward(ctx, dy):
        g, u = ctx.saved_tensors
        return (*_RefBwdFn.apply(dy, g, u, ctx.scalars), None)


class _RefBwdFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dy, g, u, scalars):
        ctx.save_for_backward(dy, g, u)
        ctx.scalars = scalars
        return ref.swiglu_bwd(dy, g, u, *scalars)

    @staticmethod
    def backward(ctx, ddg, ddu):
        return (*ref.swiglu_bwd_bwd(ddg, ddu, *ctx.saved_tensors, *ctx.scalars), None)


@pytest.mark.parametrize("scalars", [(1.702, 1.5, 1.0), (0.8, None, -0.5)], ids=["clamped", "no_limit"])
def test_reference_gradcheck_and_gradgradcheck_float64(scalars):
    # Values at least 0.05 from +-limit: finite differences must not straddle a clamp's kink.
    x = torch.rand(2, 3, 11, dtype=torch.float64) * 2.9 + 0.05
    sign = torch.randint(0, 2, x.shape).double() * 2 - 1
    g = (sign * x).requires_grad_()  # in +-(0.05, 2.95): about half beyond the limit 1.5
    u = (-sign * x.flip(-1)).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: _RefFn.apply(a, b, scalars), (g, u))
    assert torch.autograd.gradgradcheck(lambda a, b: _RefFn.apply(a, b, scalars), (g, u))


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("path", ["fast", "op"])
def test_double_backward_matches_float64(be, path):
    """Second derivatives (the kernels' float32 gradients, the reference's double backward) against
    float64 autograd through torch.clamp, with values beyond the limits."""
    g, u, dy, vg, vu = straddling(4, 19), straddling(4, 19), *(torch.randn(4, 19, device=TEST_DEVICE) for _ in range(3))
    checks.check_double_backward(be, path, GPT_OSS, functools.partial(gate64, **GPT_OSS), g, u, dy, vg, vu)


# --------------------------------------------------------------------------- op contract


@pytest.mark.parametrize("be", BACKENDS)
def test_opcheck(be):
    g = straddling(3, 17).requires_grad_()
    u = straddling(3, 17).requires_grad_()
    dy = torch.randn(3, 17, device=TEST_DEVICE).requires_grad_()
    b16 = straddling(2, 5, 8, dtype=torch.bfloat16)
    checks.opcheck(be, g, u, dy, (b16, b16.flip(-1)), [(1.702, 7.0, 1.0), (1.702, None, 1.0)])


@pytest.mark.parametrize("be", BACKENDS)
def test_compile_fullgraph(be):
    torch._dynamo.reset()  # the backend is chosen when the graph is traced

    def f(gate_up):
        return tk.swiglu(gate_up[..., ::2], gate_up[..., 1::2], alpha=1.702, limit=7.0, up_offset=1.0) * 2.0

    x, dy = straddling(6, 100), torch.randn(6, 50, device=TEST_DEVICE)
    with tk.use_backend(be):
        xc = x.clone().requires_grad_()
        y = torch.compile(f, fullgraph=True)(xc)
        (dx,) = torch.autograd.grad(y, xc, dy)
    x64 = x.double().requires_grad_()
    y64 = 2.0 * gate64(x64[..., ::2], x64[..., 1::2], **GPT_OSS)
    (dx64,) = torch.autograd.grad(y64, x64, dy.double())
    assert rel_err(y, y64) < 1e-5 and rel_err(dx, dx64) < 1e-5
    torch._dynamo.reset()


def test_compile_scalars_as_arguments():
    """alpha and limit passed into the compiled function: a second value makes them symbolic floats
    (dynamo's automatic dynamic), which the checks must take; each value gives its own result."""
    torch._dynamo.reset()

    def f(g, u, alpha, limit):
        return tk.swiglu(g, u, alpha=alpha, limit=limit, up_offset=1.0)

    g, u = straddling(4, 24), straddling(4, 24)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for alpha, limit in ((1.702, 7.0), (1.5, 7.0), (1.3, 2.0), (1.0, None)):
        scalars = {"alpha": alpha, "limit": limit, "up_offset": 1.0}
        y = compiled(g, u, alpha, limit)
        assert rel_err(y, gate64(g.double(), u.double(), **scalars)) < 1e-5, (alpha, limit)
    torch._dynamo.reset()


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    checks.check_fake_tensor_shapes(GPT_OSS)
    with FakeTensorMode():
        g = torch.empty(3, 4, 10, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="limit: expected None"):
            torch.ops.titan.swiglu(g, g, 1.0, -1.0, 0.0, None)


# --------------------------------------------------------------------------- kernels


def test_triton_fixed_configs():
    g, u, dy = straddling(9, 70), straddling(70, 9).t(), torch.randn(9, 70, device=TEST_DEVICE)
    checks.check_triton_fixed_configs(g, u, dy, f64(g, u, dy, GPT_OSS), GPT_OSS)


@pytest.mark.parametrize("cap", cpu_capability_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_native_every_isa(cap, dtype):
    with cpu_capability(cap):
        cases = checks.native_cases(straddling, dtype)
        for scalars in VARIANTS:
            for g, u in cases:
                dy = torch.randn(g.shape).to(dtype)
                s = (scalars["alpha"], scalars["limit"], scalars["up_offset"])
                y = torch.ops.titan.swiglu_clamped_fwd_native(g, u, *s)
                dg, du = torch.ops.titan.swiglu_clamped_bwd_native(dy, g, u, *s)
                for a, b in zip((y, dg, du), f64(g, u, dy, scalars)):
                    assert rel_err(a, b) < TOL[dtype], (scalars, g.shape, rel_err(a, b))
        # NaN, +-inf and the exact limits in each ISA's selects and masks: NaN and zeros where torch's are.
        nan, inf = float("nan"), float("inf")
        g = torch.tensor([7.0, 7.5, -7.0, nan, 1.0, inf, -inf, 1.0, 2.0, 3.0] * 3, dtype=dtype)
        u = torch.tensor([1.0, 1.0, 1.0, 1.0, nan, 1.0, 1.0, 7.0, -7.0, -7.5] * 3, dtype=dtype)
        dy = torch.ones_like(g)
        y = torch.ops.titan.swiglu_clamped_fwd_native(g, u, 1.702, 7.0, 1.0)
        dg, du = torch.ops.titan.swiglu_clamped_bwd_native(dy, g, u, 1.702, 7.0, 1.0)
        for a, b in zip((y, dg, du), f64(g, u, dy, GPT_OSS)):
            assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a == 0, b == 0), (a, b)


# --------------------------------------------------------------------------- errors


def test_errors_name_the_argument():
    g = torch.randn(3, 4)
    bad = [
        ({"alpha": 0.0}, ValueError, "alpha: expected a finite value > 0, got 0.0"),
        ({"alpha": -1.702}, ValueError, "alpha: expected a finite value > 0"),
        ({"alpha": float("nan")}, ValueError, "alpha: expected a finite value, got nan"),
        ({"alpha": float("inf")}, ValueError, "alpha: expected a finite value"),
        ({"alpha": "1.702"}, TypeError, "alpha: expected a float, got str"),
        ({"alpha": True}, TypeError, "alpha: expected a float, got bool"),
        ({"limit": 0.0}, ValueError, r"limit: expected None \(no clamp\) or a finite value > 0, got 0.0"),
        ({"limit": -7.0}, ValueError, "limit: expected None"),
        ({"limit": float("inf")}, ValueError, "limit: expected a finite value, got inf"),
        ({"limit": torch.tensor(7.0)}, TypeError, "limit: expected a float, got Tensor"),
        ({"up_offset": float("nan")}, ValueError, "up_offset: expected a finite value, got nan"),
        ({"up_offset": None}, TypeError, "up_offset: expected a float, got NoneType"),
    ]
    for kw, exc, msg in bad:
        with pytest.raises(exc, match=msg):
            tk.swiglu(g, g, **kw)
    with pytest.raises(ValueError, match="alpha: expected a finite value > 0"):
        torch.ops.titan.swiglu(g, g, -1.0, 7.0, 1.0, "reference")  # the op checks too
    with pytest.raises(ValueError, match="up_offset: expected a finite value"):
        swiglu_ops.swiglu_backward(g, g, g, "reference", 1.702, 7.0, float("inf"))
    with pytest.raises(TypeError, match="swiglu\\(\\) takes 2 positional arguments"):
        tk.swiglu(g, g, 1.702)  # the scalars are keyword-only


def test_native_errors_name_the_argument():
    checks.native_cpu_backend()
    g = torch.randn(3, 4)
    fwd, bwd = torch.ops.titan.swiglu_clamped_fwd_native, torch.ops.titan.swiglu_clamped_bwd_native
    checks.assert_raises_each([
        (fwd, (g, g, 0.0, 7.0, 1.0), ValueError, "alpha: expected a finite value > 0"),
        (fwd, (g, g, 1.702, float("nan"), 1.0), ValueError, "limit: expected None"),
        (bwd, (g, g, g, 1.702, 7.0, float("-inf")), ValueError, "up_offset: expected a finite value"),
        (fwd, (g, torch.randn(3, 5), 1.702, 7.0, 1.0), ValueError, "up: expected shape"),
        # The Meta kernel checks the same.
        (fwd, (g.to("meta"), g.to("meta"), 1.702, -7.0, 1.0), ValueError, "limit: expected None"),
    ])
    assert fwd(g.to("meta"), g.to("meta"), 1.702, 7.0, 1.0).shape == (3, 4)
