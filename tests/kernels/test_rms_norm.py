"""RMSNorm ops: every backend that runs here against a float64 formula, gradients, opcheck, errors.

Triton kernels run under TRITON_INTERPRET=1 (set in tests/conftest.py), so shapes stay small.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import titan_kernels as tk
from titan_kernels import backend
from titan_kernels.triton import triton_interpret
from titan_kernels.reference import rms_norm as ref
from tests.conftest import TEST_DEVICE
from tests.kernels.helpers import TOL, backends_here, rel_err

BACKENDS = backends_here()


def f64_rms_norm(x, w, eps, residual=None):
    """The textbook formula in float64 (rounding x + residual to x.dtype as the unfused code does)."""
    h = (x + residual) if residual is not None else x
    h64 = h.double()
    y = h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + eps)
    if w is not None:
        y = y * w.double()
    return y, h


def randn(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, dtype=torch.float64) * scale + 0.1).to(dtype).to(TEST_DEVICE)


# --------------------------------------------------------------------------- forward


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("hidden", [1, 7, 64, 1000, 1536, 4096, 5120, 8192])
def test_forward_hidden_sizes(be, hidden):
    rows = 3 if hidden >= 4096 else 5
    x = randn(rows, hidden)
    w = randn(hidden)
    with tk.use_backend(be):
        y = tk.rms_norm(x, w, 1e-6)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert rel_err(y, f64_rms_norm(x, w, 1e-6)[0]) < TOL[torch.float32]


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(33,), (4, 33), (2, 3, 96), (2, 3, 5, 40)], ids=["1d", "2d", "3d", "4d"])
def test_forward_dtypes_and_ranks(be, dtype, shape):
    x = randn(*shape, dtype=dtype, scale=3.0)
    w = randn(shape[-1], dtype=dtype)
    with tk.use_backend(be):
        y = tk.rms_norm(x, w, 1e-5)
        y_nw = tk.rms_norm(x, None, 1e-5)
    assert y.dtype == dtype
    assert rel_err(y, f64_rms_norm(x, w, 1e-5)[0]) < TOL[dtype]
    assert rel_err(y_nw, f64_rms_norm(x, None, 1e-5)[0]) < TOL[dtype]
    # Same result as PyTorch's own rms_norm to the precision of the dtype.
    assert rel_err(y, F.rms_norm(x.float(), (shape[-1],), w.float(), 1e-5)) < TOL[dtype]


@pytest.mark.parametrize("be", BACKENDS)
def test_strided_and_transposed_views(be):
    base = randn(40, 70)
    w = randn(30)
    views = {
        "transposed": base.t()[:, :30],  # (70, 30), last-dim stride 70
        "sliced_cols": base[:, 10:40],  # row stride 70
        "every_other_row": base[::2, :30],
        "3d_permuted": randn(5, 30, 4).permute(0, 2, 1),  # leading dims do not flatten: copied
    }
    with tk.use_backend(be):
        for name, v in views.items():
            y = tk.rms_norm(v, w, 1e-6)
            assert rel_err(y, f64_rms_norm(v, w, 1e-6)[0]) < 1e-5, name


@pytest.mark.parametrize("be", BACKENDS)
def test_zero_rows(be):
    w = randn(16)
    with tk.use_backend(be):
        for shape in [(0, 16), (2, 0, 16)]:
            x = torch.randn(shape, device=TEST_DEVICE, requires_grad=True)
            y = tk.rms_norm(x, w, 1e-6)
            assert y.shape == x.shape
            y.sum().backward()
            assert x.grad.shape == x.shape
            out, h = tk.add_rms_norm(randn(*shape), randn(*shape), w)
            assert out.shape == shape and h.shape == shape


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_forward(be, dtype):
    x = randn(6, 257, dtype=dtype)
    r = randn(6, 257, dtype=dtype)
    w = randn(257, dtype=dtype)
    with tk.use_backend(be):
        y, h = tk.add_rms_norm(x, r, w, 1e-6)
    y64, h_expected = f64_rms_norm(x, w, 1e-6, residual=r)
    if be == "triton" and dtype == torch.bfloat16 and triton_interpret():
        # The Triton interpreter truncates float32 -> bfloat16 (GPUs round to nearest even): allow one ulp.
        assert torch.allclose(h.float(), h_expected.float(), rtol=2**-7, atol=0)
    else:
        assert torch.equal(h, h_expected)  # the residual sum is rounded exactly like x + r
    assert rel_err(y, y64) < TOL[dtype]
    assert not torch.equal(x, h)  # inputs untouched, outputs fresh


def test_wide_row_uses_multi_block_path():
    # Wider than one Triton block (MAX_BLOCK_N): the two-pass loop is used.
    from titan_kernels.triton.rms_norm import MAX_BLOCK_N

    if not backend.backend_status("triton", TEST_DEVICE).available:
        pytest.skip(f"triton unavailable: {backend.backend_status('triton', TEST_DEVICE).reason}")
    n = MAX_BLOCK_N + 37
    x = randn(2, n).requires_grad_()
    w = randn(n).requires_grad_()
    r = randn(2, n).requires_grad_()
    g = randn(2, n)
    with tk.use_backend("triton"):
        y, h = tk.add_rms_norm(x, r, w)
        dx, dr, dw = torch.autograd.grad(y, (x, r, w), g)
    x64, r64, w64 = (t.detach().double().requires_grad_() for t in (x, r, w))
    y64, _ = f64_rms_norm(x64, w64, 1e-6, residual=r64)
    dx64, dw64 = torch.autograd.grad(y64, (x64, w64), g.double())
    assert rel_err(y, y64) < 1e-5
    assert rel_err(dx, dx64) < 1e-5 and torch.equal(dx, dr)
    assert rel_err(dw, dw64) < 1e-5


# --------------------------------------------------------------------------- gradients


class _RefFn(torch.autograd.Function):
    """The reference forward/backward pair, so gradcheck can test the reference's backward."""

    @staticmethod
    def forward(ctx, x, w, eps):
        y, _, rstd = ref.rms_norm_fwd(x, None, w, eps)
        ctx.save_for_backward(x, w, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, rstd = ctx.saved_tensors
        dx, dw = ref.rms_norm_bwd(dy, x, w, rstd, None, True)
        return dx, dw, None


def test_reference_backward_gradcheck_float64():
    x = randn(3, 11, dtype=torch.float64).requires_grad_()
    w = randn(11, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: _RefFn.apply(a, b, 1e-6), (x, w))


def _grads_f64(x, w, g, residual=None):
    xs = [x.detach().double().requires_grad_()]
    rs = [residual.detach().double().requires_grad_()] if residual is not None else []
    w64 = w.detach().double().requires_grad_()
    if rs:
        h = xs[0] + rs[0]
    else:
        h = xs[0]
    y = _RefFn.apply(h, w64, 1e-6)
    return torch.autograd.grad(y, xs + [w64], g.double())


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 3), (5, 64), (3, 1000), (2, 2, 1536)])  # hidden 1: dx ~ 0 (cancellation)
def test_backward_matches_float64(be, dtype, shape):
    x = randn(*shape, dtype=dtype).requires_grad_()
    w = randn(shape[-1], dtype=dtype).requires_grad_()
    g = randn(*shape, dtype=dtype)
    with tk.use_backend(be):
        y = tk.rms_norm(x, w, 1e-6)
        dx, dw = torch.autograd.grad(y, (x, w), g)
        # The dispatcher path (what torch.compile and DTensor see) gives the same gradients.
        y2 = torch.ops.titan.rms_norm(x, w, 1e-6)[0]
        dx2, dw2 = torch.autograd.grad(y2, (x, w), g)
    dx64, dw64 = _grads_f64(x, w, g)
    tol = TOL[dtype] if dtype == torch.float32 else 2e-2
    assert dx.dtype == dtype and dw.dtype == dtype
    assert rel_err(dx, dx64) < tol and rel_err(dw, dw64) < tol
    assert torch.equal(dx, dx2) and torch.equal(dw, dw2)


@pytest.mark.parametrize("be", BACKENDS)
def test_add_rms_norm_backward(be):
    x = randn(4, 9, 48).requires_grad_()
    r = randn(4, 9, 48).requires_grad_()
    w = randn(48).requires_grad_()
    gy, gh = randn(4, 9, 48), randn(4, 9, 48)
    with tk.use_backend(be):
        y, h = tk.add_rms_norm(x, r, w)
        dx, dr, dw = torch.autograd.grad((y, h), (x, r, w), (gy, gh))
    x64, r64, w64 = (t.detach().double().requires_grad_() for t in (x, r, w))
    h64 = x64 + r64
    y64 = _RefFn.apply(h64, w64, 1e-6)
    dx64, dr64, dw64 = torch.autograd.grad((y64, h64), (x64, r64, w64), (gy.double(), gh.double()))
    assert rel_err(dx, dx64) < 1e-5 and rel_err(dr, dr64) < 1e-5 and rel_err(dw, dw64) < 1e-5


@pytest.mark.parametrize("be", BACKENDS)
def test_gradient_never_aliases_incoming(be):
    # dx must be a fresh buffer: the incoming dy may also feed another branch (Liger #370).
    x = randn(3, 20).requires_grad_()
    w = randn(20).requires_grad_()
    dy = randn(3, 20)
    dy_copy = dy.clone()
    with tk.use_backend(be):
        out = tk.rms_norm(x, w)
        dx, _ = torch.autograd.grad(out, (x, w), dy)
        dx2, _ = torch.ops.titan.rms_norm_backward(dy, x.detach(), w.detach(), randn(3).abs() + 0.5, None, True)
    assert torch.equal(dy, dy_copy)
    assert dx.data_ptr() != dy.data_ptr() and dx2.data_ptr() != dy.data_ptr()


@pytest.mark.parametrize("be", BACKENDS)
def test_frozen_weight_and_no_weight(be):
    x = randn(3, 17).requires_grad_()
    w = randn(17)  # frozen: no grad
    with tk.use_backend(be):
        (dx,) = torch.autograd.grad(tk.rms_norm(x, w), (x,), randn(3, 17))
        (dx_nw,) = torch.autograd.grad(tk.rms_norm(x, None), (x,), randn(3, 17))
    assert dx.shape == x.shape and dx_nw.shape == x.shape


@pytest.mark.parametrize("be", BACKENDS)
def test_bf16_dweight_many_short_rows(be):
    """bf16 dweight over 32768 rows of 128 stays within 2x of PyTorch's own bf16 backward error."""
    x = randn(32768, 128, dtype=torch.bfloat16).requires_grad_()
    w = randn(128, dtype=torch.bfloat16).requires_grad_()
    g = randn(32768, 128, dtype=torch.bfloat16)
    with tk.use_backend(be):
        (dw,) = torch.autograd.grad(tk.rms_norm(x, w, 1e-6), (w,), g)
    (dw_torch,) = torch.autograd.grad(F.rms_norm(x, (128,), w, 1e-6), (w,), g)
    _, dw64 = _grads_f64(x, w, g)
    ours, theirs = rel_err(dw, dw64), rel_err(dw_torch, dw64)
    assert ours <= 2 * max(theirs, 4e-3), (ours, theirs)


# --------------------------------------------------------------------------- op contract


@pytest.mark.parametrize("be", BACKENDS)
def test_opcheck(be):
    x = randn(4, 3, 24)
    w = randn(24).requires_grad_()
    r = randn(4, 3, 24)
    with tk.use_backend(be):
        torch.library.opcheck(torch.ops.titan.rms_norm.default, (x.requires_grad_(), w, 1e-6))
        torch.library.opcheck(torch.ops.titan.rms_norm.default, (randn(5, 24).t(), None, 1e-6))
        torch.library.opcheck(torch.ops.titan.add_rms_norm.default, (x, r.requires_grad_(), w, 1e-6))
        rstd = randn(4, 3).abs() + 0.5
        torch.library.opcheck(torch.ops.titan.rms_norm_backward.default, (randn(4, 3, 24), x.detach(), w.detach(), rstd, None, True))
        torch.library.opcheck(torch.ops.titan.rms_norm_backward.default, (randn(4, 3, 24), x.detach(), None, rstd, r.detach(), False))


@pytest.mark.parametrize("be", BACKENDS)
def test_compile_fullgraph_matches_eager(be):
    x = randn(2, 5, 40).requires_grad_()
    r = randn(2, 5, 40).requires_grad_()
    w = randn(40).requires_grad_()

    def f(x, r, w):
        y, h = tk.add_rms_norm(x, r, w)
        return tk.rms_norm(y * 2 + h, w).sum(-1)

    with tk.use_backend(be):
        eager = f(x, r, w)
        g_eager = torch.autograd.grad(eager.sum(), (x, r, w))
        torch._dynamo.reset()
        compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(x, r, w)
        g_comp = torch.autograd.grad(compiled.sum(), (x, r, w))
    assert torch.allclose(eager, compiled, atol=1e-6, rtol=1e-5)
    for a, b in zip(g_eager, g_comp):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)


# --------------------------------------------------------------------------- errors


def test_bad_input_errors():
    x = randn(4, 8)
    with pytest.raises(ValueError, match="weight"):
        tk.rms_norm(x, randn(7))
    with pytest.raises(ValueError, match="weight"):
        tk.rms_norm(x, randn(2, 8))
    with pytest.raises(TypeError, match="x"):
        tk.rms_norm(torch.ones(4, 8, dtype=torch.int32, device=TEST_DEVICE))
    with pytest.raises(TypeError, match="x"):
        tk.rms_norm(x.to(torch.float8_e4m3fn))
    with pytest.raises(TypeError, match="weight"):
        tk.rms_norm(x, torch.ones(8, dtype=torch.int64, device=TEST_DEVICE))
    for eps in (0.0, -1e-6, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="eps"):
            tk.rms_norm(x, None, eps)
    with pytest.raises(TypeError, match="eps"):
        tk.rms_norm(x, None, "1e-6")
    with pytest.raises(ValueError, match="device"):
        tk.rms_norm(x, randn(8).to("meta"))
    with pytest.raises(ValueError, match="residual"):
        tk.add_rms_norm(x, randn(4, 9))
    with pytest.raises(TypeError, match="residual"):
        tk.add_rms_norm(x, randn(4, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="x"):
        tk.rms_norm(randn(1)[0])


def test_unavailable_backend_is_a_clear_error():
    x = randn(2, 8).cpu()
    with tk.use_backend("cuda"):
        with pytest.raises(RuntimeError, match="cuda"):
            tk.rms_norm(x)
    with pytest.raises(ValueError, match="backend"):
        with tk.use_backend("nope"):
            pass


def test_environment_variable_sets_default(monkeypatch, backend_env):
    # The variable is read at import, and again by reload_environment() after a running process sets it.
    monkeypatch.setenv("TITAN_KERNELS_BACKEND", "reference")
    assert backend.requested_backend() is None
    backend_env("reference")
    assert backend.resolve("rms_norm", "cpu") == "reference"
    backend_env("bogus")
    with pytest.raises(ValueError, match="TITAN_KERNELS_BACKEND"):
        backend.resolve("rms_norm", "cpu")
    backend_env("reference")
    with tk.use_backend("triton"):  # the context manager wins over the environment
        assert backend.requested_backend() == "triton"


def test_available_backends_reports_reasons():
    st = tk.available_backends("cpu")
    assert list(st) == ["reference", "triton", "cpu", "cuda"]
    assert st["reference"].available
    assert not st["cuda"].available and "cuda" in st["cuda"].reason
    for s in st.values():
        assert s.available or s.reason
