"""SwiGLU op: every backend that runs here against float64 math, gradients (first and second order),
the two autograd paths, opcheck, torch.compile, the native ISA builds, the Triton tiles, errors.

Triton kernels run under TRITON_INTERPRET=1 (set in tests/conftest.py), so shapes stay small.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import titan_kernels as tk
from titan_kernels import backend
from titan_kernels.ops import swiglu as swiglu_ops
from titan_kernels.reference import swiglu as ref
from tests.conftest import TEST_DEVICE
from tests.kernels.helpers import TOL, backends_here, cpu_capability, cpu_capability_params, rel_err

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BACKENDS = backends_here(names=("reference", "triton", "cpu"))


def randn(*shape, dtype=torch.float32, scale=2.0):
    return (torch.randn(*shape, dtype=torch.float64) * scale).to(dtype).to(TEST_DEVICE)


def f64(gate, up, dy):
    """y, dgate, dup in float64 by autograd of the textbook formula, from the inputs as stored."""
    g = gate.detach().double().requires_grad_()
    u = up.detach().double().requires_grad_()
    y = F.silu(g) * u
    dg, du = torch.autograd.grad(y, (g, u), dy.double())
    return y.detach(), dg, du


def run(be, gate, up, dy):
    g = gate.detach().requires_grad_()
    u = up.detach().requires_grad_()
    with tk.use_backend(be):
        y = tk.swiglu(g, u)
        dg, du = torch.autograd.grad(y, (g, u), dy)
    return y, dg, du


def check(be, gate, up, dtype, what=""):
    dy = randn(*gate.shape, dtype=dtype)
    y, dg, du = run(be, gate, up, dy)
    y64, dg64, du64 = f64(gate, up, dy)
    assert y.dtype == dtype and y.shape == gate.shape and y.is_contiguous(), what
    assert dg.dtype == dtype and du.dtype == dtype, what
    for name, a, b in (("y", y, y64), ("dgate", dg, dg64), ("dup", du, du64)):
        assert rel_err(a, b) < TOL[dtype], (what, name, rel_err(a, b))


# --------------------------------------------------------------------------- forward + backward vs float64


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 33), (2, 5, 96), (4, 3, 2, 17), (3, 2500)],
                         ids=["1", "7", "3x33", "2x5x96", "4d", "wide"])
def test_matches_float64(be, dtype, shape):
    check(be, randn(*shape, dtype=dtype), randn(*shape, dtype=dtype), dtype)


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
        check(be, g, u, dtype, name)


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("shape", [(0, 16), (2, 0, 16), (3, 0), (0,)])
def test_zero_size(be, shape):
    g = torch.randn(shape, device=TEST_DEVICE, requires_grad=True)
    u = torch.randn(shape, device=TEST_DEVICE, requires_grad=True)
    with tk.use_backend(be):
        y = tk.swiglu(g, u)
        y.sum().backward()
    assert y.shape == shape and g.grad.shape == shape and u.grad.shape == shape


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the Triton interpreter's numpy
def test_extreme_gates_stay_finite(be):
    # exp(-g) overflows to inf for g < -88 in float32: sigmoid must still come out 0, not NaN.
    g = torch.tensor([[-1e4, -100.0, -88.7, -20.0, 0.0, 20.0, 88.7, 100.0, 1e4]], device=TEST_DEVICE)
    u = torch.full_like(g, 0.5)
    check(be, g, u, torch.float32)
    _, dg, du = run(be, g, u, torch.ones_like(g))
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
    g, u, dy = randn(5, 40), randn(5, 40), randn(5, 40)
    fast = run(be, g, u, dy)
    gg, uu = g.clone().requires_grad_(), u.clone().requires_grad_()
    y = torch.ops.titan.swiglu(gg, uu, backend=be)  # the dispatcher path with its registered autograd
    dg, du = torch.autograd.grad(y, (gg, uu), dy)
    for a, b in zip(fast, (y, dg, du)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("path", ["fast", "op"])
def test_backward_uses_the_forward_backend(path, monkeypatch):
    """A forward under use_backend("reference") runs the reference backward, even outside the block."""
    calls = []
    with contextlib.ExitStack() as stack:
        for impl in list(backend.implementations(swiglu_ops.OP)):
            def spy_bwd(*a, _name=impl.name, _bwd=impl.kernels.backward):
                calls.append(_name)
                return _bwd(*a)
            stack.enter_context(backend.replace_impl(swiglu_ops.OP, impl.name, (impl.kernels.forward, spy_bwd), impl.family))
        g = randn(3, 8).requires_grad_()
        u = randn(3, 8).requires_grad_()
        with tk.use_backend("reference"):
            if path == "fast":
                y = tk.swiglu(g, u)
            else:
                y = torch.ops.titan.swiglu(g, u)  # backend None: resolved by the autograd setup
        y.sum().backward()
    assert calls == ["reference"]


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
    g, u, dy, vg, vu = (randn(4, 19) for _ in range(5))

    def hvp(fn, g, u, dy, vg, vu):
        g = g.detach().requires_grad_()
        u = u.detach().requires_grad_()
        dy = dy.detach().requires_grad_()
        dg, du = torch.autograd.grad(fn(g, u), (g, u), dy, create_graph=True)
        return torch.autograd.grad((dg * vg).sum() + (du * vu).sum(), (g, u, dy))

    def ours(g, u):
        with tk.use_backend(be):
            return tk.swiglu(g, u) if path == "fast" else torch.ops.titan.swiglu(g, u, backend=be)

    got = hvp(ours, g, u, dy, vg, vu)
    want = hvp(lambda a, b: F.silu(a) * b, *(t.double() for t in (g, u, dy, vg, vu)))
    for name, a, b in zip(("d2/dgate", "d2/dup", "d2/ddy"), got, want):
        assert rel_err(a, b) < 1e-5, (name, rel_err(a, b))


# --------------------------------------------------------------------------- op contract


@pytest.mark.parametrize("be", BACKENDS)
def test_opcheck(be):
    g = randn(3, 17).requires_grad_()
    u = randn(3, 17).requires_grad_()
    dy = randn(3, 17).requires_grad_()
    torch.library.opcheck(torch.ops.titan.swiglu.default, (g, u, 1.0, None, 0.0, be))
    torch.library.opcheck(torch.ops.titan.swiglu_backward.default, (dy, g, u, 1.0, None, 0.0, be))
    torch.library.opcheck(torch.ops.titan.swiglu.default, (randn(2, 5, 8, dtype=torch.bfloat16),
                                                          randn(2, 5, 8, dtype=torch.bfloat16), 1.0, None, 0.0, be))


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
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        g = torch.empty(3, 4, 10, dtype=torch.bfloat16)
        y = tk.swiglu(g, torch.empty(3, 4, 10, dtype=torch.bfloat16))
        dg, du = torch.ops.titan.swiglu_backward(y, g, g)
    assert y.shape == (3, 4, 10) and y.dtype == torch.bfloat16
    assert dg.shape == du.shape == (3, 4, 10)


# --------------------------------------------------------------------------- kernels


def test_triton_fixed_configs():
    st = backend.backend_status("triton", TEST_DEVICE)
    if not st.available:
        pytest.skip(f"triton backend unavailable: {st.reason}")
    from titan_kernels.triton import swiglu as tri

    g, u, dy = randn(9, 70), randn(70, 9).t(), randn(9, 70)
    y64, dg64, du64 = f64(g, u, dy)
    for cfg in ({"block_m": 2, "block_n": 16, "num_warps": 1}, {"block_m": 16, "block_n": 128}, {}):
        y = tri.swiglu_fwd(g, u, **cfg)
        dg, du = tri.swiglu_bwd(dy, g, u, **cfg)
        assert rel_err(y, y64) < 1e-5 and rel_err(dg, dg64) < 1e-5 and rel_err(du, du64) < 1e-5, cfg
    assert tri.default_config(14336)["block_n"] == tri.MAX_BLOCK_N


@pytest.mark.parametrize("cap", cpu_capability_params())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_native_every_isa(cap, dtype):
    with cpu_capability(cap):
        h = 77  # not a multiple of any vector width
        fused = randn(5, 2 * h, dtype=dtype)
        cases = [
            (randn(2, 3, h, dtype=dtype), randn(2, 3, h, dtype=dtype)),  # contiguous: one flat range
            (randn(700, 61, dtype=dtype), randn(700, 61, dtype=dtype)),  # several threads' worth
            (fused[:, :h], fused[:, h:]),  # strided rows
            (randn(h, 6, dtype=dtype).t(), randn(6, h, dtype=dtype)),  # non-unit last stride: copied
        ]
        for g, u in cases:
            dy = randn(*g.shape, dtype=dtype)
            y = torch.ops.titan.swiglu_fwd_native(g, u)
            dg, du = torch.ops.titan.swiglu_bwd_native(dy, g, u)
            y64, dg64, du64 = f64(g, u, dy)
            assert rel_err(y, y64) < TOL[dtype] and rel_err(dg, dg64) < TOL[dtype] and rel_err(du, du64) < TOL[dtype]


def test_native_errors_name_the_argument():
    if not backend.backend_status("cpu", "cpu").available:
        pytest.skip("native cpu backend unavailable")
    g = torch.randn(3, 4)
    with pytest.raises(ValueError, match="up: expected shape"):
        torch.ops.titan.swiglu_fwd_native(g, torch.randn(3, 5))
    with pytest.raises(TypeError, match="up: expected dtype"):
        torch.ops.titan.swiglu_fwd_native(g, torch.randn(3, 4, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="gate: expected dtype"):
        torch.ops.titan.swiglu_fwd_native(g.double(), g.double())
    with pytest.raises(ValueError, match="dy: expected shape"):
        torch.ops.titan.swiglu_bwd_native(torch.randn(4), g, g)


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
