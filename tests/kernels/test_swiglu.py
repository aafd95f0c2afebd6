"""SwiGLU op: every backend that runs here against float64 math, gradients (first and second order),
the two autograd paths, opcheck, torch.compile, the native ISA builds, the Triton tiles, errors.

Triton kernels run under TRITON_INTERPRET=1 (set in tests/conftest.py), so shapes stay small.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import titan_kernels as tk
from titan_kernels import backend
from titan_kernels.ops import swiglu as swiglu_ops
from titan_kernels.reference import swiglu as ref
from tests.conftest import TEST_DEVICE
from tests.kernels import swiglu_checks as checks
from tests.kernels.helpers import TOL, backends_here, cpu_capability, cpu_capability_params, rel_err

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BACKENDS = backends_here(names=("reference", "triton", "cpu"))


def randn(*shape, dtype=torch.float32, scale=2.0):
    return (torch.randn(*shape, dtype=torch.float64) * scale).to(dtype).to(TEST_DEVICE)


def textbook(g, u):
    return F.silu(g) * u


def f64(gate, up, dy):
    """y, dgate, dup in float64 by autograd of the textbook formula, from the inputs as stored."""
    return checks.f64(gate, up, dy, textbook)


def check(be, gate, up, what=""):
    checks.check(be, gate, up, {}, textbook, what)


# --------------------------------------------------------------------------- forward + backward vs float64


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 33), (2, 5, 96), (4, 3, 2, 17), (3, 2500)],
                         ids=["1", "7", "3x33", "2x5x96", "4d", "wide"])
def test_matches_float64(be, dtype, shape):
    check(be, randn(*shape, dtype=dtype), randn(*shape, dtype=dtype))


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_strided_views(be, dtype):
    h = 45
    fused = randn(6, 7, 2 * h, dtype=dtype)  # a fused w1/w3 projection: gate and up are its halves
    base = randn(50, 3 * h, dtype=dtype)
    views = {
        "halves_of_fused": (fused[..., :h], fused[..., h:]),
        "transposed": (randn(h, 20, dtype=dtype).t(), randn(h, 20, dtype=dtype).t()),
        "sliced_cols": (base[:, 10:10 + h], base[:, 60:60 + h]),
        "every_other_row": (base[::2, :h], base[1::2, :h]),
        "permuted_3d": (randn(5, h, 4, dtype=dtype).permute(0, 2, 1), randn(4, 5, h, dtype=dtype).transpose(0, 1)),
        "expanded": (randn(1, h, dtype=dtype).expand(9, h), randn(9, h, dtype=dtype)),
    }
    for name, (g, u) in views.items():
        check(be, g, u, name)


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("shape", [(0, 16), (2, 0, 16), (3, 0), (0,)])
def test_zero_size(be, shape):
    checks.check_zero_size(be, shape, {})


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the Triton interpreter's numpy
def test_extreme_gates_stay_finite(be):
    # exp(-g) overflows to inf for g < -88 in float32: sigmoid must still come out 0, not NaN.
    g = torch.tensor([[-1e4, -100.0, -88.7, -20.0, 0.0, 20.0, 88.7, 100.0, 1e4]], device=TEST_DEVICE)
    u = torch.full_like(g, 0.5)
    check(be, g, u)
    _, dg, du = checks.run(be, g, u, torch.ones_like(g), {})
    assert torch.isfinite(dg).all() and torch.isfinite(du).all()


def test_inputs_untouched_and_outputs_fresh():
    g, u, dy = randn(4, 8), randn(4, 8), randn(4, 8)
    g0, u0, dy0 = g.clone(), u.clone(), dy.clone()
    for be in ("reference", "cpu"):
        if not backend.backend_status(be, TEST_DEVICE).available:
            continue
        with tk.use_backend(be):
            y = tk.swiglu(g, u)
            dg, du = swiglu_ops.swiglu_backward(dy, g, u, be)
        assert torch.equal(g, g0) and torch.equal(u, u0) and torch.equal(dy, dy0)
        ptrs = {t.data_ptr() for t in (g, u, dy)}
        assert not ({y.data_ptr(), dg.data_ptr(), du.data_ptr()} & ptrs)


# --------------------------------------------------------------------------- one autograd definition


@pytest.mark.parametrize("be", BACKENDS)
def test_fast_path_equals_op_path(be):
    checks.check_fast_path_equals_op_path(be, randn(5, 40), randn(5, 40), randn(5, 40), {})


@pytest.mark.parametrize("path", ["fast", "op"])
def test_backward_uses_the_forward_backend(path):
    """A forward under use_backend("reference") runs the reference backward (no scalars), even outside the block."""
    assert checks.backward_calls(path, randn(3, 8), randn(3, 8), {}) == [("reference", ())]


# --------------------------------------------------------------------------- second order


class _RefFn(torch.autograd.Function):
    """The reference forward, backward and double backward, for gradgradcheck in float64."""

    @staticmethod
    def forward(ctx, g, u):
        ctx.save_for_backward(g, u)
        return ref.swiglu_fwd(g, u)

    @staticmethod
    def backward(ctx, dy):
        g, u = ctx.saved_tensors
        return _RefBwdFn.apply(dy, g, u)


class _RefBwdFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dy, g, u):
        ctx.save_for_backward(dy, g, u)
        return ref.swiglu_bwd(dy, g, u)

    @staticmethod
    def backward(ctx, ddg, ddu):
        return ref.swiglu_bwd_bwd(ddg, ddu, *ctx.saved_tensors)


def test_reference_formulas_gradcheck_and_gradgradcheck_float64():
    g = randn(3, 7, dtype=torch.float64).requires_grad_()
    u = randn(3, 7, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(_RefFn.apply, (g, u))
    assert torch.autograd.gradgradcheck(_RefFn.apply, (g, u))


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("path", ["fast", "op"])
def test_double_backward_matches_float64(be, path):
    """The op takes no float64, so its second derivatives (float32) are checked against float64 autograd."""
    checks.check_double_backward(be, path, {}, textbook, *(randn(4, 19) for _ in range(5)))


# --------------------------------------------------------------------------- op contract


@pytest.mark.parametrize("be", BACKENDS)
def test_opcheck(be):
    g, u, dy = (randn(3, 17).requires_grad_() for _ in range(3))
    b16 = randn(2, 5, 8, dtype=torch.bfloat16), randn(2, 5, 8, dtype=torch.bfloat16)
    checks.opcheck(be, g, u, dy, b16, [(1.0, None, 0.0)])


@pytest.mark.parametrize("be", BACKENDS)
def test_compile_fullgraph(be):
    torch._dynamo.reset()  # the backend is chosen when the graph is traced

    def f(g, u):
        return tk.swiglu(g, u) * 2.0

    g, u, dy = randn(6, 50), randn(6, 50), randn(6, 50)
    with tk.use_backend(be):
        compiled = torch.compile(f, fullgraph=True)
        gc, uc = g.clone().requires_grad_(), u.clone().requires_grad_()
        y = compiled(gc, uc)
        dg, du = torch.autograd.grad(y, (gc, uc), dy)
    y64, dg64, du64 = f64(g, u, 2.0 * dy)
    assert rel_err(y, 2.0 * y64) < 1e-5
    assert rel_err(dg, dg64) < 1e-5 and rel_err(du, du64) < 1e-5
    torch._dynamo.reset()


def test_fake_tensor_shapes():
    checks.check_fake_tensor_shapes({})


# --------------------------------------------------------------------------- kernels


def test_triton_fixed_configs():
    g, u, dy = randn(9, 70), randn(70, 9).t(), randn(9, 70)
    checks.check_triton_fixed_configs(g, u, dy, f64(g, u, dy), {})
    from titan_kernels.triton import swiglu as tri

    assert tri.default_config(14336)["block_n"] == tri.MAX_BLOCK_N


@pytest.mark.parametrize("cap", cpu_capability_params())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_native_every_isa(cap, dtype):
    with cpu_capability(cap):
        for g, u in checks.native_cases(randn, dtype):
            dy = randn(*g.shape, dtype=dtype)
            y = torch.ops.titan.swiglu_fwd_native(g, u)
            dg, du = torch.ops.titan.swiglu_bwd_native(dy, g, u)
            y64, dg64, du64 = f64(g, u, dy)
            assert rel_err(y, y64) < TOL[dtype] and rel_err(dg, dg64) < TOL[dtype] and rel_err(du, du64) < TOL[dtype]


def test_native_errors_name_the_argument():
    checks.native_cpu_backend()
    g = torch.randn(3, 4)
    fwd, bwd = torch.ops.titan.swiglu_fwd_native, torch.ops.titan.swiglu_bwd_native
    checks.assert_raises_each([
        (fwd, (g, torch.randn(3, 5)), ValueError, "up: expected shape"),
        (fwd, (g, torch.randn(3, 4, dtype=torch.bfloat16)), TypeError, "up: expected dtype"),
        (fwd, (g.double(), g.double()), TypeError, "gate: expected dtype"),
        (bwd, (torch.randn(4), g, g), ValueError, "dy: expected shape"),
    ])


# --------------------------------------------------------------------------- errors


def test_errors_are_clear():
    g = torch.randn(3, 4)
    with pytest.raises(TypeError, match="gate: expected a torch.Tensor"):
        tk.swiglu([1.0], g)
    with pytest.raises(TypeError, match="gate: expected dtype"):
        tk.swiglu(g.double(), g.double())
    with pytest.raises(TypeError, match="up: expected a torch.Tensor"):
        tk.swiglu(g, 1.0)
    with pytest.raises(TypeError, match=r"up: expected dtype float32 \(the dtype of gate\), got float16"):
        tk.swiglu(g, g.half())
    with pytest.raises(ValueError, match=r"up: expected shape \(3, 4\)"):
        tk.swiglu(g, torch.randn(4, 3))
    with pytest.raises(ValueError, match="gate: expected at least 1 dimension"):
        tk.swiglu(torch.tensor(1.0), torch.tensor(1.0))
    with pytest.raises(ValueError, match="up: expected device cpu"):
        tk.swiglu(g, torch.randn(3, 4, device="meta"))
    with pytest.raises(ValueError, match="backend"):
        with tk.use_backend("nope"):
            pass
