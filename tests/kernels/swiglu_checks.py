"""The checks tests/kernels/test_swiglu.py (the plain op) and test_swiglu_clamped.py (its GPT-OSS
variant) make alike. ``scalars`` are ``tk.swiglu``'s keywords (alpha, limit, up_offset), ``{}`` for
the plain op; the registered ops take them positionally, in that order, or not at all (the plain op's
defaults)."""
from __future__ import annotations

import contextlib

import pytest
import torch

import titan_kernels as tk
from titan_kernels import backend
from titan_kernels.ops import swiglu as swiglu_ops
from tests.conftest import TEST_DEVICE
from tests.kernels.helpers import TOL, rel_err


def positional(scalars: dict) -> tuple:
    """``scalars`` as the registered ops take them: (alpha, limit, up_offset) as floats, () for none."""
    if not scalars:
        return ()
    return tuple(None if scalars[k] is None else float(scalars[k]) for k in ("alpha", "limit", "up_offset"))


def call(path: str, g, u, scalars: dict, be=None):
    """The forward through ``path``: "fast" (``tk.swiglu``) or "op" (the dispatcher's op with its registered
    autograd; ``be`` None: the backend is resolved by the autograd setup)."""
    if path == "fast":
        return tk.swiglu(g, u, **scalars)
    return torch.ops.titan.swiglu(g, u, *positional(scalars), backend=be)


def f64(gate, up, dy, formula):
    """y, dgate, dup in float64 by autograd of ``formula(gate, up)``, from the inputs as stored."""
    g = gate.detach().double().requires_grad_()
    u = up.detach().double().requires_grad_()
    y = formula(g, u)
    dg, du = torch.autograd.grad(y, (g, u), dy.double())
    return y.detach(), dg, du


def run(be, gate, up, dy, scalars: dict):
    """y, dgate, dup of ``tk.swiglu`` on backend ``be``."""
    g = gate.detach().requires_grad_()
    u = up.detach().requires_grad_()
    with tk.use_backend(be):
        y = tk.swiglu(g, u, **scalars)
        dg, du = torch.autograd.grad(y, (g, u), dy)
    return y, dg, du


def check(be, gate, up, scalars: dict, formula, what=""):
    """``run`` against ``f64`` of ``formula`` for a random dy: dtypes, shape, a contiguous output, and
    each of y, dgate, dup within the dtype's tolerance."""
    dtype = gate.dtype
    dy = torch.randn(gate.shape, dtype=torch.float64).to(dtype).to(TEST_DEVICE)
    got = run(be, gate, up, dy, scalars)
    assert got[0].shape == gate.shape and got[0].is_contiguous(), what
    for name, a, b in zip(("y", "dgate", "dup"), got, f64(gate, up, dy, formula)):
        assert a.dtype == dtype, (what, name)
        assert rel_err(a, b) < TOL[dtype], (what, name, rel_err(a, b))


def check_zero_size(be, shape, scalars: dict):
    g = torch.randn(shape, device=TEST_DEVICE, requires_grad=True)
    u = torch.randn(shape, device=TEST_DEVICE, requires_grad=True)
    with tk.use_backend(be):
        y = tk.swiglu(g, u, **scalars)
        y.sum().backward()
    assert y.shape == shape and g.grad.shape == shape and u.grad.shape == shape


def check_fast_path_equals_op_path(be, g, u, dy, scalars: dict):
    """``tk.swiglu`` and the op with its registered autograd give the same bits, forward and backward."""
    fast = run(be, g, u, dy, scalars)
    gg, uu = g.clone().requires_grad_(), u.clone().requires_grad_()
    y = call("op", gg, uu, scalars, be)
    dg, du = torch.autograd.grad(y, (gg, uu), dy)
    for a, b in zip(fast, (y, dg, du)):
        assert torch.equal(a, b)


def backward_calls(path: str, g, u, scalars: dict) -> list:
    """(backend, scalars it got) of every backward kernel call, for a forward through ``path`` under
    use_backend("reference") and its backward outside the block."""
    calls = []
    with contextlib.ExitStack() as stack:
        for impl in list(backend.implementations(swiglu_ops.OP)):
            def spy_bwd(*a, _name=impl.name, _bwd=impl.kernels.backward):
                calls.append((_name, a[3:]))
                return _bwd(*a)
            stack.enter_context(backend.replace_impl(swiglu_ops.OP, impl.name, (impl.kernels.forward, spy_bwd), impl.family))
        g, u = g.detach().requires_grad_(), u.detach().requires_grad_()
        with tk.use_backend("reference"):
            y = call(path, g, u, scalars)
        y.sum().backward()
    return calls


def check_double_backward(be, path, scalars: dict, formula, g, u, dy, vg, vu):
    """Second derivatives (Hessian-vector products along vg, vu, and the derivative in dy) of the op
    in float32 against float64 autograd of ``formula``."""
    def hvp(fn, g, u, dy, vg, vu):
        g = g.detach().requires_grad_()
        u = u.detach().requires_grad_()
        dy = dy.detach().requires_grad_()
        dg, du = torch.autograd.grad(fn(g, u), (g, u), dy, create_graph=True)
        return torch.autograd.grad((dg * vg).sum() + (du * vu).sum(), (g, u, dy))

    def ours(g, u):
        with tk.use_backend(be):
            return call(path, g, u, scalars, be)

    got = hvp(ours, g, u, dy, vg, vu)
    want = hvp(formula, *(t.double() for t in (g, u, dy, vg, vu)))
    for name, a, b in zip(("d2/dgate", "d2/dup", "d2/ddy"), got, want):
        assert rel_err(a, b) < 1e-5, (name, rel_err(a, b))


def opcheck(be, g, u, dy, b16, scalars: list[tuple]):
    """torch.library.opcheck of the forward with each of ``scalars`` (positional), of the backward and
    of a bfloat16 forward (``b16``: its gate and up) with the first."""
    for s in scalars:
        torch.library.opcheck(torch.ops.titan.swiglu.default, (g, u, *s, be))
    torch.library.opcheck(torch.ops.titan.swiglu_backward.default, (dy, g, u, *scalars[0], be))
    torch.library.opcheck(torch.ops.titan.swiglu.default, (*b16, *scalars[0], be))


def check_fake_tensor_shapes(scalars: dict):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        g = torch.empty(3, 4, 10, dtype=torch.bfloat16)
        y = tk.swiglu(g, torch.empty(3, 4, 10, dtype=torch.bfloat16), **scalars)
        dg, du = torch.ops.titan.swiglu_backward(y, g, g, *positional(scalars))
    assert y.shape == (3, 4, 10) and y.dtype == torch.bfloat16
    assert dg.shape == du.shape == (3, 4, 10)


def check_triton_fixed_configs(g, u, dy, want, scalars: dict):
    """The Triton kernels at fixed tile configs (a small one, a wide one, the default) against ``want``
    (y, dgate, dup). Skips where the Triton backend is unavailable."""
    st = backend.backend_status("triton", TEST_DEVICE)
    if not st.available:
        pytest.skip(f"triton backend unavailable: {st.reason}")
    from titan_kernels.triton import swiglu as tri

    for cfg in ({"block_m": 2, "block_n": 16, "num_warps": 1}, {"block_m": 16, "block_n": 128}, {}):
        y = tri.swiglu_fwd(g, u, *positional(scalars), **cfg)
        dg, du = tri.swiglu_bwd(dy, g, u, *positional(scalars), **cfg)
        assert all(rel_err(a, b) < 1e-5 for a, b in zip((y, dg, du), want)), cfg


def native_cases(make, dtype) -> list:
    """(gate, up) pairs for the native kernels from ``make(*shape, dtype=)``, at a width (77) that is no
    multiple of any vector width: contiguous (one flat range), several threads' worth, strided rows,
    interleaved (non-unit last stride) and transposed."""
    h = 77
    fused = make(5, 2 * h, dtype=dtype)
    return [
        (make(2, 3, h, dtype=dtype), make(2, 3, h, dtype=dtype)),
        (make(700, 61, dtype=dtype), make(700, 61, dtype=dtype)),
        (fused[:, :h], fused[:, h:]),
        (fused[:, ::2], fused[:, 1::2]),
        (make(h, 6, dtype=dtype).t(), make(6, h, dtype=dtype)),
    ]


def native_cpu_backend():
    """Skips unless the native CPU backend is built."""
    if not backend.backend_status("cpu", "cpu").available:
        pytest.skip("native cpu backend unavailable")


def assert_raises_each(cases):
    """Each of ``cases`` (fn, args, exception, message) raises that exception matching the message."""
    for fn, args, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            fn(*args)
