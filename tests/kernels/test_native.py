"""The native CPU kernels (csrc/cpu, ``torch.ops.titan.*_native``) against float64 formulas.

Every instruction-set build of the kernels that this CPU runs (default, AVX2, AVX512) is tested, at
awkward shapes: odd widths, strided / transposed / expanded views, views whose leading dims do not
flatten, a non-unit last stride, zero rows, wide rows, many rows for the bf16 dweight. Also the
native ops' own contract (undefined outputs are None, fresh output buffers), opcheck on them,
C++-side errors, the capability switch and determinism. The op-level suites
(tests/kernels/test_rms_norm.py, test_rotary.py) run their tests on the ``cpu`` backend too.

The extension is built by ``pip install --no-build-isolation -e .`` (or ``python setup.py
build_ext --inplace``). Without it these tests skip with the reason, unless
``TITAN_KERNELS_REQUIRE_NATIVE=1`` (CI), where they fail.
"""
from __future__ import annotations

import os

import pytest
import torch

from titan_kernels import _native

_OK, _WHY = _native.status("cpu")
if not _OK:
    if os.environ.get("TITAN_KERNELS_REQUIRE_NATIVE") == "1":
        raise RuntimeError(f"TITAN_KERNELS_REQUIRE_NATIVE=1 but the cpu native backend is unavailable: {_WHY}")
    pytest.skip(f"native cpu backend unavailable: {_WHY}", allow_module_level=True)

from titan_kernels import _C  # noqa: E402
from tests.kernels.helpers import TOL, cpu_capabilities, cpu_capability, rel_err  # noqa: E402

ops = torch.ops.titan
CAPS = cpu_capabilities()  # this CPU's builds, best last


@pytest.fixture(params=CAPS)
def cap(request):
    with cpu_capability(request.param):
        yield request.param


def randn(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, dtype=torch.float64) * scale + 0.1).to(dtype)


# ------------------------------------------------------------------------------ float64 formulas


def f64_rms_norm_fwd(x, r, w, eps):
    """(y, h, rstd) in float64, with h = x + r rounded to x.dtype first (as the unfused code)."""
    h = (x + r) if r is not None else x
    h64 = h.double()
    rstd = torch.rsqrt(h64.pow(2).mean(-1) + eps)
    y = h64 * rstd.unsqueeze(-1)
    if w is not None:
        y = y * w.double()
    return y, h, rstd


def f64_rms_norm_bwd(dy, x, w, dres):
    """(dx, dweight) in float64, from the textbook formula (Zhang & Sennrich 2019, eq. 4)."""
    x64 = x.double()
    rstd = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    xhat = x64 * rstd
    g = dy.double() * (w.double() if w is not None else 1.0)
    dx = (g - xhat * (g * xhat).mean(-1, keepdim=True)) * rstd
    if dres is not None:
        dx = dx + dres.double()
    dw = (dy.double() * xhat).reshape(-1, x.shape[-1]).sum(0)
    return dx, dw


def f64_rotary(x, cos, sin, pos, interleaved, sign=1.0):
    """x (B, S, H, D) rotated pairwise by cos/sin rows at pos (Su et al. 2021, eq. 34), float64."""
    b, s, _, d = x.shape
    half = cos.shape[1]
    p = torch.arange(s).expand(b, s) if pos is None else pos.long().expand(b, s)
    valid = ((p >= 0) & (p < cos.shape[0]))[..., None, None]
    c = cos.double()[p.clamp(0, cos.shape[0] - 1)][:, :, None, :]
    sn = sign * sin.double()[p.clamp(0, cos.shape[0] - 1)][:, :, None, :]
    out = x.double().clone()
    if interleaved:
        i1 = torch.arange(half) * 2
        i2 = i1 + 1
    else:
        i1, i2 = torch.arange(half), torch.arange(half, 2 * half)
    x1, x2 = x.double()[..., i1], x.double()[..., i2]
    out[..., i1] = torch.where(valid, x1 * c - x2 * sn, torch.nan)
    out[..., i2] = torch.where(valid, x2 * c + x1 * sn, torch.nan)
    assert d >= 2 * half
    return out


def tables(positions, half):
    ang = torch.rand(positions, half, dtype=torch.float64) * 6.28
    return ang.cos().float(), ang.sin().float()


# ------------------------------------------------------------------------------ RMSNorm


VIEWS = {
    "contiguous": lambda t: t,
    "transposed": lambda t: t.transpose(0, 1).contiguous().transpose(0, 1),  # leading stride 1, last N
    "row_slice": lambda t: torch.cat([t, t], 0)[::2],  # row stride 2N
    "inner_slice": lambda t: torch.stack([t, t], -1)[..., 0],  # last-dim stride 2: copied first
    "no_flatten": lambda t: _no_flatten(t),
}


def _no_flatten(t: torch.Tensor) -> torch.Tensor:
    """A view of t's values (maybe permuted) whose leading dims cannot merge into one row stride."""
    if t.dim() < 3:
        return torch.cat([t, t], 0)[::2]
    view = torch.cat([t, t[..., :1, :]], dim=-2)[..., :-1, :]  # strides (..., (S+1)N, N, 1)
    return view.transpose(0, 1) if t.dim() > 3 else view  # 4-D: three leading dims, none merge


@pytest.mark.parametrize("view", list(VIEWS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1,), (5, 1), (6, 7), (3, 5, 33), (2, 3, 4, 17), (4, 1000), (2, 4096 + 24)],
                         ids=lambda s: "x".join(map(str, s)))
def test_rms_norm_forward(cap, view, dtype, shape):
    x = VIEWS[view](randn(*shape, dtype=dtype, scale=3.0)) if len(shape) > 1 else randn(*shape, dtype=dtype)
    r = VIEWS[view](randn(*shape, dtype=dtype)) if len(shape) > 1 else randn(*shape, dtype=dtype)
    w = randn(shape[-1], dtype=dtype)
    for res, wt in ((None, w), (r, w), (r, None)):
        y, h, rstd = ops.rms_norm_fwd_native(x, res, wt, 1e-6)
        y64, h_ref, rstd64 = f64_rms_norm_fwd(x, res, wt, 1e-6)
        assert y.shape == x.shape and y.dtype == dtype and y.is_contiguous()
        assert rstd.shape == x.shape[:-1] and rstd.dtype == torch.float32
        assert rel_err(y, y64) < TOL[dtype]
        assert rel_err(rstd, rstd64) < 1e-5
        if res is None:
            assert h is None
        else:
            assert torch.equal(h, h_ref)  # the sum is rounded to x.dtype exactly as x + r


@pytest.mark.parametrize("view", ["contiguous", "row_slice", "no_flatten", "inner_slice"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(6, 7), (3, 5, 33), (2, 4096 + 24)], ids=lambda s: "x".join(map(str, s)))
def test_rms_norm_backward(cap, view, dtype, shape):
    x = VIEWS[view](randn(*shape, dtype=dtype, scale=2.0))
    dy = VIEWS[view](randn(*shape, dtype=dtype))
    dres = VIEWS[view](randn(*shape, dtype=dtype))
    w = randn(shape[-1], dtype=dtype)
    _, _, rstd = ops.rms_norm_fwd_native(x, None, w, 1e-6)
    for wt, dr in ((w, None), (w, dres), (None, dres)):
        dx, dw = ops.rms_norm_bwd_native(dy, x, wt, rstd, dr, True)
        dx64, dw64 = f64_rms_norm_bwd(dy, x, wt, dr)
        assert dx.shape == x.shape and dx.dtype == dtype and dx.is_contiguous()
        assert rel_err(dx, dx64) < TOL[dtype]
        if wt is None:
            assert dw is None
        else:
            assert dw.dtype == dtype and rel_err(dw, dw64) < TOL[dtype]
    dx, dw = ops.rms_norm_bwd_native(dy, x, w, rstd, None, False)
    assert dw is None and rel_err(dx, f64_rms_norm_bwd(dy, x, w, None)[0]) < TOL[dtype]


def test_rms_norm_float32_weight_with_bf16_input(cap):
    x, dy = randn(7, 40, dtype=torch.bfloat16), randn(7, 40, dtype=torch.bfloat16)
    w = randn(40)
    y, _, rstd = ops.rms_norm_fwd_native(x, None, w, 1e-6)
    assert y.dtype == torch.bfloat16 and rel_err(y, f64_rms_norm_fwd(x, None, w, 1e-6)[0]) < 1e-2
    dx, dw = ops.rms_norm_bwd_native(dy, x, w, rstd, None, True)
    dx64, dw64 = f64_rms_norm_bwd(dy, x, w, None)
    assert dw.dtype == torch.float32 and rel_err(dw, dw64) < 1e-5 and rel_err(dx, dx64) < 1e-2


def test_rms_norm_bf16_dweight_over_many_rows(cap):
    # 30k rows into one bf16 dweight: accumulating in bf16 would be off by far more than 1e-2.
    x, dy = randn(30000, 24, dtype=torch.bfloat16), randn(30000, 24, dtype=torch.bfloat16)
    w = randn(24, dtype=torch.bfloat16)
    _, _, rstd = ops.rms_norm_fwd_native(x, None, w, 1e-6)
    _, dw = ops.rms_norm_bwd_native(dy, x, w, rstd, None, True)
    assert rel_err(dw, f64_rms_norm_bwd(dy, x, w, None)[1]) < 1e-2


def test_rms_norm_wide_row(cap):
    x, dy = randn(2, 70001, scale=4.0), randn(2, 70001)
    w = randn(70001)
    y, _, rstd = ops.rms_norm_fwd_native(x, None, w, 1e-6)
    assert rel_err(y, f64_rms_norm_fwd(x, None, w, 1e-6)[0]) < 1e-5
    dx, dw = ops.rms_norm_bwd_native(dy, x, w, rstd, None, True)
    dx64, dw64 = f64_rms_norm_bwd(dy, x, w, None)
    assert rel_err(dx, dx64) < 1e-5 and rel_err(dw, dw64) < 1e-5


@pytest.mark.parametrize("shape", [(0, 64), (3, 0), (2, 0, 5), (0,)], ids=str)
def test_rms_norm_zero_size(shape):
    x = torch.randn(shape)
    n = shape[-1]
    w = torch.randn(n)
    y, h, rstd = ops.rms_norm_fwd_native(x, torch.randn(shape), w, 1e-6)
    assert y.shape == x.shape and h.shape == x.shape and rstd.shape == x.shape[:-1]
    if n == 0:  # an empty row has sum of squares 0 (as the Triton kernel)
        assert torch.all(rstd == 1e-6 ** -0.5)
    dres = torch.randn(shape)
    dx, dw = ops.rms_norm_bwd_native(torch.randn(shape), x, w, rstd, dres, True)
    assert torch.equal(dx, dres) and dw.shape == (n,) and torch.all(dw == 0)


def test_rms_norm_outputs_are_fresh_and_inputs_untouched():
    x, dy, dres = randn(8, 64), randn(8, 64), randn(8, 64)
    copies = [t.clone() for t in (x, dy, dres)]
    _, _, rstd = ops.rms_norm_fwd_native(x, None, None, 1e-6)
    dx, _ = ops.rms_norm_bwd_native(dy, x, None, rstd, dres, False)
    assert dx.data_ptr() not in (dy.data_ptr(), dres.data_ptr(), x.data_ptr())
    assert all(torch.equal(a, b) for a, b in zip((x, dy, dres), copies))


def test_rms_norm_backward_deterministic_and_thread_count_independent():
    x, dy = randn(4000, 96), randn(4000, 96)
    w = randn(96)
    _, _, rstd = ops.rms_norm_fwd_native(x, None, w, 1e-6)
    a = ops.rms_norm_bwd_native(dy, x, w, rstd, None, True)
    b = ops.rms_norm_bwd_native(dy, x, w, rstd, None, True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        y1 = ops.rms_norm_fwd_native(x, None, w, 1e-6)[0]
        c = ops.rms_norm_bwd_native(dy, x, w, rstd, None, True)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(y1, ops.rms_norm_fwd_native(x, None, w, 1e-6)[0])  # rows are independent
    assert torch.equal(c[0], a[0]) and rel_err(c[1], a[1]) < 1e-5  # dweight: other chunking, fp32 sums


# ------------------------------------------------------------------------------ rotary


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dims", [(128, 64), (64, 16), (74, 29), (6, 3), (9, 0)], ids=lambda d: f"D{d[0]}R{d[1]}")
def test_rotary_matches_float64(cap, interleaved, dtype, dims):
    head_dim, half = dims
    b, s, hq, hk, positions = 2, 13, 3, 1, 40
    q, k = randn(b, s, hq, head_dim, dtype=dtype), randn(b, s, hk, head_dim, dtype=dtype)
    cos, sin = tables(positions, half)
    pos = torch.randint(0, positions, (b, s))
    pos[1, 4] = positions  # out of range: NaN in the rotated dims, the rest copied
    pos[0, 2] = -1
    for p in (None, pos, pos[0], pos[:1].to(torch.int32)):
        qo, ko = ops.rotary_fwd_native(q, k, cos, sin, p, interleaved)
        assert qo.dtype == dtype and qo.is_contiguous() and ko.shape == k.shape
        for got, x in ((qo, q), (ko, k)):
            want = f64_rotary(x, cos, sin, p, interleaved)
            assert torch.equal(got.isnan(), want.isnan())
            assert rel_err(got.nan_to_num(), want.nan_to_num()) < TOL[dtype]
        dq, dk = ops.rotary_bwd_native(q, k, cos, sin, p, interleaved)
        assert rel_err(dq.nan_to_num(), f64_rotary(q, cos, sin, p, interleaved, -1.0).nan_to_num()) < TOL[dtype]
        assert rel_err(dk.nan_to_num(), f64_rotary(k, cos, sin, p, interleaved, -1.0).nan_to_num()) < TOL[dtype]


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
def test_rotary_strided_inputs(cap, interleaved):
    b, s, h, d = 2, 11, 4, 64
    qkv = randn(b, s, 3 * h, d)
    q, k = qkv[:, :, :h], qkv[:, :, h : h + 2]  # slices of a fused projection: strides (s*3h*d, 3h*d, d, 1)
    qt = randn(b, h, s, d).transpose(1, 2)  # (b, s, h, d) view of a head-major tensor
    kn = randn(b, s, 2, d, 2)[..., 0]  # head_dim stride 2: copied first
    cos, sin = tables(s, 24)
    cos_t = torch.randn(24, s).t()  # a table with a non-unit column stride
    for qq, kk in ((q, k), (qt, kn)):
        for c in (cos, cos_t):
            qo, ko = ops.rotary_fwd_native(qq, kk, c, sin, None, interleaved)
            assert rel_err(qo, f64_rotary(qq, c, sin, None, interleaved)) < 1e-5
            assert rel_err(ko, f64_rotary(kk, c, sin, None, interleaved)) < 1e-5


def test_rotary_backward_inverts_forward(cap):
    q, k = randn(1, 17, 4, 32), randn(1, 17, 2, 32)
    cos, sin = tables(17, 16)
    qo, ko = ops.rotary_fwd_native(q, k, cos, sin, None, False)
    qb, kb = ops.rotary_bwd_native(qo, ko, cos, sin, None, False)
    assert rel_err(qb, q) < 1e-6 and rel_err(kb, k) < 1e-6


def test_rotary_q_and_k_of_different_dtypes(cap):
    q, k = randn(2, 5, 2, 16, dtype=torch.bfloat16), randn(2, 5, 1, 16)
    cos, sin = tables(5, 8)
    qo, ko = ops.rotary_fwd_native(q, k, cos, sin, None, True)
    assert qo.dtype == torch.bfloat16 and ko.dtype == torch.float32
    assert rel_err(qo, f64_rotary(q, cos, sin, None, True)) < 1e-2
    assert rel_err(ko, f64_rotary(k, cos, sin, None, True)) < 1e-5


@pytest.mark.parametrize("shape", [(0, 5, 2, 8), (2, 0, 2, 8), (2, 5, 0, 8), (2, 5, 2, 0)], ids=str)
def test_rotary_zero_size(shape):
    q = torch.randn(shape)
    k = torch.randn(shape[0], shape[1], 1, shape[3])
    half = min(4, shape[3] // 2)
    cos, sin = tables(6, half)
    qo, ko = ops.rotary_fwd_native(q, k, cos, sin, None, False)
    assert qo.shape == q.shape and ko.shape == k.shape
    if k.numel():
        assert rel_err(ko, f64_rotary(k, cos, sin, None, False)) < 1e-5


# ------------------------------------------------------------------------------ contract and errors


def test_opcheck_native_ops():
    x, r, w, dy = randn(4, 3, 40), randn(4, 3, 40), randn(40), randn(4, 3, 40)
    _, _, rstd = ops.rms_norm_fwd_native(x, None, w, 1e-6)
    torch.library.opcheck(ops.rms_norm_fwd_native.default, (x, r, w, 1e-6))
    torch.library.opcheck(ops.rms_norm_fwd_native.default, (x.transpose(0, 1), None, None, 1e-5))
    torch.library.opcheck(ops.rms_norm_bwd_native.default, (dy, x, w, rstd, r, True))
    torch.library.opcheck(ops.rms_norm_bwd_native.default, (dy, x, None, rstd, None, False))
    q, k = randn(2, 6, 3, 16, dtype=torch.bfloat16), randn(2, 6, 1, 16, dtype=torch.bfloat16)
    cos, sin = tables(8, 8)
    pos = torch.randint(0, 8, (2, 6))
    for op in (ops.rotary_fwd_native.default, ops.rotary_bwd_native.default):
        torch.library.opcheck(op, (q, k, cos, sin, pos, False))
        torch.library.opcheck(op, (q, k, cos, sin, None, True))


def test_errors_name_the_argument():
    x, w = torch.randn(4, 8), torch.randn(8)
    with pytest.raises(TypeError, match="x: expected dtype"):
        ops.rms_norm_fwd_native(x.long(), None, None, 1e-6)
    with pytest.raises(TypeError, match="x: expected dtype"):
        ops.rms_norm_fwd_native(x.double(), None, None, 1e-6)
    with pytest.raises(ValueError, match="weight: expected shape"):
        ops.rms_norm_fwd_native(x, None, torch.randn(7), 1e-6)
    with pytest.raises(ValueError, match="residual: expected shape"):
        ops.rms_norm_fwd_native(x, torch.randn(4, 9), None, 1e-6)
    with pytest.raises(TypeError, match="residual: expected dtype"):
        ops.rms_norm_fwd_native(x, x.bfloat16(), None, 1e-6)
    with pytest.raises(ValueError, match="eps: expected a finite value > 0"):
        ops.rms_norm_fwd_native(x, None, w, 0.0)
    with pytest.raises(ValueError, match="eps"):
        ops.rms_norm_fwd_native(x, None, w, float("nan"))
    with pytest.raises(ValueError, match="x: expected at least 1 dimension"):
        ops.rms_norm_fwd_native(torch.tensor(1.0), None, None, 1e-6)
    rstd = torch.ones(4)
    with pytest.raises(TypeError, match="rstd: expected dtype float32"):
        ops.rms_norm_bwd_native(x, x, w, rstd.double(), None, True)
    with pytest.raises(ValueError, match="rstd: expected shape"):
        ops.rms_norm_bwd_native(x, x, w, torch.ones(5), None, True)
    with pytest.raises(ValueError, match="dy: expected shape"):
        ops.rms_norm_bwd_native(torch.randn(4, 9), x, w, rstd, None, True)
    q, k = torch.randn(1, 3, 2, 8), torch.randn(1, 3, 1, 8)
    cos, sin = tables(4, 4)
    with pytest.raises(ValueError, match="q: expected 4 dims"):
        ops.rotary_fwd_native(q[0], k, cos, sin, None, False)
    with pytest.raises(ValueError, match="k: expected shape"):
        ops.rotary_fwd_native(q, torch.randn(1, 3, 1, 6), cos, sin, None, False)
    with pytest.raises(ValueError, match="cos: expected rotary_dim"):
        ops.rotary_fwd_native(q, k, *tables(4, 5), None, False)
    with pytest.raises(ValueError, match="sin: expected shape"):
        ops.rotary_fwd_native(q, k, cos, sin[:, :2], None, False)
    with pytest.raises(TypeError, match="position_ids: expected an integer dtype"):
        ops.rotary_fwd_native(q, k, cos, sin, torch.zeros(3), False)
    with pytest.raises(ValueError, match="position_ids: expected shape"):
        ops.rotary_fwd_native(q, k, cos, sin, torch.zeros(4, dtype=torch.long), False)
    with pytest.raises(TypeError, match="q: expected dtype"):
        ops.rotary_fwd_native(q.double(), k, cos, sin, None, False)


def test_capability_switch():
    assert _C.has_cpu() is True and isinstance(_C.has_cuda(), bool)
    assert _C.cpu_capability() == CAPS[-1]  # auto: the best this CPU runs
    with pytest.raises(ValueError, match="capability: expected one of"):
        _C.set_cpu_capability("sse9")
    with pytest.raises(TypeError, match="capability: expected a str"):
        _C.set_cpu_capability(2)
    _C.set_cpu_capability("default")
    try:
        assert _C.cpu_capability() == "default"
    finally:
        _C.set_cpu_capability("auto")
    assert _C.cpu_capability() == CAPS[-1]


def test_backend_reports_cpu_available():
    import titan_kernels as tk

    st = tk.available_backends("cpu")["cpu"]
    assert st.available, st.reason


# ------------------------------------------------------------------------------ CUDA (GPU machines)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3001, 512), (37, 4096), (5, 1000), (6, 7), (3, 40000)], ids=str)
def test_cuda_native_ops_match_float64(dtype, shape):
    """The csrc/cuda kernels through their torch binding: warp- and block-per-row layouts, unaligned
    rows, rows wider than the register cache, a persistent backward over many rows."""
    ok, why = _native.status("cuda")
    if not ok:
        pytest.skip(f"native cuda backend unavailable: {why}")
    dev = "cuda"
    x, r, dy, dres = (randn(*shape, dtype=dtype, scale=2.0).to(dev) for _ in range(4))
    w = randn(shape[-1], dtype=dtype).to(dev)
    y, h, rstd = ops.rms_norm_fwd_native(x, r, w, 1e-6)
    y64, h_ref, _ = f64_rms_norm_fwd(x.cpu(), r.cpu(), w.cpu(), 1e-6)
    assert rel_err(y.cpu(), y64) < TOL[dtype] and torch.equal(h.cpu(), h_ref)
    dx, dw = ops.rms_norm_bwd_native(dy, h, w, rstd, dres, True)
    dx64, dw64 = f64_rms_norm_bwd(dy.cpu(), h.cpu(), w.cpu(), dres.cpu())
    assert rel_err(dx.cpu(), dx64) < TOL[dtype] and rel_err(dw.cpu(), dw64) < TOL[dtype]
    q, k = randn(2, 9, 4, 128, dtype=dtype).to(dev), randn(2, 9, 1, 128, dtype=dtype).to(dev)
    cos, sin = tables(12, 64)
    pos = torch.randint(0, 12, (2, 9))
    for inter in (False, True):
        qo, ko = ops.rotary_fwd_native(q, k, cos.to(dev), sin.to(dev), pos.to(dev), inter)
        assert rel_err(qo.cpu(), f64_rotary(q.cpu(), cos, sin, pos, inter)) < TOL[dtype]
        assert rel_err(ko.cpu(), f64_rotary(k.cpu(), cos, sin, pos, inter)) < TOL[dtype]
