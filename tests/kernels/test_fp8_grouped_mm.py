"""titan::fp8_grouped_mm against float64: a per-expert loop on the dequantized operands (tight: float32
accumulation, then the output rounding) and on the unquantized ones (float8 e4m3 tolerance), every
backend, awkward shapes (odd K/N, groups not a multiple of any tile, empty experts, T = 0, rows past the
last group), forward, dx and dw, both recipes, fp32/bf16; the quantizers against their float64
definitions and Triton's bit for bit against the reference; torch._scaled_grouped_mm's adaptation
(padding of K/N and of the token groups, layouts, scales) on the CPU through a stand-in that runs
torch's own meta checks and CUTLASS's device asserts; opcheck, torch.compile(fullgraph=True),
validation errors, the backend choice and its reasons, one backend for forward and backward, double
backward refused."""
from __future__ import annotations

import pytest
import torch

import titan_kernels as tk
from titan_kernels.ops.fp8 import grouped_mm as fgm
from titan_kernels.reference import fp8_grouped_mm as qref
from tests.kernels.helpers import (
    DEV, GROUPED_CASES as CASES, backend_ctx as _ctx, case_id, check_compile_fullgraph, check_double_backward_refused,
    check_measured_order, check_one_backend, spied_kernels, grouped_grads, loop64, loop64_grads, make_offsets, noncontiguous_operands,
    opcheck_operands, rel_err as rel, validation_cases,
)

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # against the dequantized operands
FP8_TOL = 7e-2  # e4m3 against the unquantized float64 product (DESIGN.md section 5)
E4M3 = torch.float8_e4m3fn
TRITON = tk.available_backends(DEV)["triton"]


def _backends():
    out = ["reference", "auto"]
    out.append(pytest.param("triton", marks=[] if TRITON.available else pytest.mark.skip(reason=f"triton: {TRITON.reason}")))
    if DEV.type == "cuda":
        why = fgm.why_not("aten", "cuda", DEV.index, torch.bfloat16)
        out.append(pytest.param("aten", marks=[pytest.mark.skip(reason=f"aten: {why}")] if why else []))
    return out


def dw_loop64(x, dy, offsets, e_count):
    b = [0] + offsets.tolist()
    return torch.stack([x[b[e]:b[e + 1]].double().t() @ dy[b[e]:b[e + 1]].double() for e in range(e_count)])


def dequantized_grads64(x, w, dy, offsets, recipe):
    """(y, dx, dw) in float64 from the operands each GEMM sees: the reference quantizers' codes times
    their scales (the quantizers are checked on their own below)."""
    xq, sx = qref.rows(x)
    wq, sw = qref.w_fwd(w)
    y = loop64(xq.double() * sx.double()[:, None], wq.double() * sw.double()[:, None, :], offsets)
    dq, sd = qref.rows(dy)
    wd, swd = qref.w_dgrad(w)
    dx = loop64(dq.double() * sd.double()[:, None], (wd.double() * swd.double()[:, :, None]).transpose(1, 2), offsets)
    if recipe == "rowwise":
        gid = qref.group_ids(offsets, x.shape[0]).clamp_max(w.shape[0] - 1)
        xc, sxc = qref.group_cols(x, offsets)
        dc, sdc = qref.group_cols(dy, offsets)
        dw = dw_loop64(xc.double() * sxc.double()[gid], dc.double() * sdc.double()[gid], offsets, w.shape[0])
    else:
        dw = dw_loop64(x, dy, offsets, w.shape[0])
    return y, dx, dw


def _run(backend, x, w, offsets, recipe):
    return grouped_grads(backend, lambda x, w, o: tk.fp8_grouped_mm(x, w, o, recipe=recipe), x, w, offsets)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_against_float64_loop(case, dtype, backend):
    sizes, k, n = case
    if backend == "aten" and dtype != torch.bfloat16:
        pytest.skip("torch._scaled_grouped_mm writes bfloat16 only")
    t, e = sum(sizes), len(sizes)
    x = (torch.randn(t, k, device=DEV) * 2).to(dtype).requires_grad_()
    w = (torch.randn(e, k, n, device=DEV) * k**-0.5).to(dtype).requires_grad_()
    offsets = make_offsets(sizes)
    y, dy, dx, dw = _run(backend, x, w, offsets, "rowwise")
    assert y.shape == (t, n) and y.dtype == dtype and dx.dtype == dtype and dw.dtype == dtype
    # Tight: the dequantized operands in float64.
    want = dequantized_grads64(x.detach(), w.detach(), dy, offsets, "rowwise")
    for name, got, ref in zip(("y", "dx", "dw"), (y, dx, dw), want):
        assert rel(got, ref) <= TOL[dtype], (name, rel(got, ref))
    # Float8 accuracy: the unquantized operands in float64.
    y64, dx64, dw64 = loop64_grads(x, w, offsets, dy)
    for name, got, ref in (("y", y, y64), ("dx", dx, dx64), ("dw", dw, dw64)):
        assert rel(got, ref) <= FP8_TOL, (name, rel(got, ref))
    empty = [i for i, s in enumerate(sizes) if s == 0]
    assert torch.all(dw[empty] == 0)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_weight_gradient_in_high_precision(backend, dtype):
    if backend == "aten" and dtype != torch.bfloat16:
        pytest.skip("torch._scaled_grouped_mm writes bfloat16 only")
    sizes, k, n = [9, 0, 14, 4], 24, 40
    x = torch.randn(sum(sizes), k, device=DEV).to(dtype).requires_grad_()
    w = (torch.randn(len(sizes), k, n, device=DEV) * k**-0.5).to(dtype).requires_grad_()
    offsets = make_offsets(sizes)
    y, dy, dx, dw = _run(backend, x, w, offsets, "rowwise_with_gw_hp")
    y64, dx64, dw64 = dequantized_grads64(x.detach(), w.detach(), dy, offsets, "rowwise_with_gw_hp")
    assert rel(y, y64) <= TOL[dtype] and rel(dx, dx64) <= TOL[dtype]
    assert rel(dw, dw64) <= TOL[dtype]  # no float8 in the weight gradient: the unquantized product
    assert torch.all(dw[1] == 0)


def test_weight_gradient_error_of_the_float8_recipe():
    # The measured cost of quantizing the weight gradient (the module docstring's claim): at a
    # 30B-A3B-like aspect (K > N, a few hundred tokens per expert) dw is as accurate as dx.
    torch.manual_seed(1)
    sizes, k, n = [300, 0, 150, 250], 256, 96
    x = torch.randn(sum(sizes), k, device=DEV, requires_grad=True)
    w = (torch.randn(len(sizes), k, n, device=DEV) * k**-0.5).requires_grad_()
    offsets = make_offsets(sizes)
    y, dy, dx, dw = _run("reference", x, w, offsets, "rowwise")
    y64, dx64, dw64 = loop64_grads(x, w, offsets, dy)
    err_y, err_dx, err_dw = rel(y, y64), rel(dx, dx64), rel(dw, dw64)
    assert 0.01 < err_dw < 0.06 and err_dw < 1.5 * err_dx, (err_y, err_dx, err_dw)


@pytest.mark.parametrize("backend", _backends())
def test_rows_past_last_group_are_zero(backend):
    sizes, k, n, tail = [4, 0, 6], 16, 8, 5
    dtype = torch.bfloat16 if backend == "aten" else torch.float32
    x = torch.randn(sum(sizes) + tail, k, device=DEV).to(dtype).requires_grad_()
    w = torch.randn(3, k, n, device=DEV).to(dtype).requires_grad_()
    offsets = make_offsets(sizes)
    y, dy, dx, dw = _run(backend, x, w, offsets, "rowwise")
    assert torch.all(y[-tail:] == 0) and torch.all(dx[-tail:] == 0)
    # The padding rows change nothing in dw: the same as without them.
    y0, dx0, dw0 = dequantized_grads64(x[:-tail].detach(), w.detach(), dy[:-tail], offsets, "rowwise")
    tol = TOL[dtype]
    assert rel(y[:-tail], y0) <= tol and rel(dx[:-tail], dx0) <= tol and rel(dw, dw0) <= tol


@pytest.mark.parametrize("backend", _backends())
def test_noncontiguous_inputs(backend):
    dtype = torch.bfloat16 if backend == "aten" else torch.float32
    x, ws, offsets = noncontiguous_operands(dtype)
    with _ctx(backend):
        for ww in ws:
            y = tk.fp8_grouped_mm(x, ww, offsets)
            xq, sx = qref.rows(x)
            wq, sw = qref.w_fwd(ww)
            want = loop64(xq.double() * sx.double()[:, None], wq.double() * sw.double()[:, None, :], offsets)
            assert rel(y, want) <= TOL[dtype]


# ----------------------------------------------------------------------------- quantizers


def _pow2_scale64(amax):
    """The scale's float64 definition: 1 / 2^floor(log2(448 / max(amax, 1e-12)))."""
    return 1.0 / torch.exp2(torch.floor(torch.log2(448.0 / amax.double().clamp_min(1e-12))))


def test_reference_quantizers_match_their_definition():
    sizes, k, n = [5, 0, 12, 3], 24, 40
    offsets = make_offsets(sizes)
    x = torch.randn(sum(sizes) + 2, k, device=DEV) * 5
    x[1] = 0.0  # an all-zero row: the floored amax
    w = torch.randn(len(sizes), k, n, device=DEV)

    def codes64(t, scale):
        return (t.double() / scale).clamp(-448, 448).to(E4M3)  # exact quotient: scales are powers of two

    c, s = qref.rows(x)
    s64 = _pow2_scale64(x.abs().amax(1))
    assert torch.equal(s.double(), s64) and torch.equal(c.float(), codes64(x, s64[:, None]).float())
    c, s = qref.w_fwd(w)
    s64 = _pow2_scale64(w.abs().amax(1))  # (E, N)
    assert c.stride() == (k * n, 1, k) and torch.equal(s.double(), s64)
    assert torch.equal(c.float(), codes64(w, s64[:, None, :]).float())
    c, s = qref.w_dgrad(w)
    s64 = _pow2_scale64(w.abs().amax(2))  # (E, K)
    assert c.is_contiguous() and torch.equal(s.double(), s64)
    assert torch.equal(c.float(), codes64(w, s64[:, :, None]).float())
    c, s = qref.group_cols(x, offsets)
    b = [0] + offsets.tolist()
    assert c.stride() == (1, x.shape[0])
    for e in range(len(sizes)):
        grp = x[b[e]:b[e + 1]]
        s64 = _pow2_scale64(grp.abs().amax(0) if grp.shape[0] else torch.zeros(k, device=DEV))
        assert torch.equal(s[e].double(), s64), e
        assert torch.equal(c[b[e]:b[e + 1]].float(), codes64(grp, s64).float()), e
    assert torch.all(c[b[-1]:].float() == 0)  # rows past the last group
    # Dequantized error within e4m3's half step (2^-4 relative) of the scaled value.
    c, s = qref.rows(x)
    err = (c.double() * s.double()[:, None] - x.double()).abs()
    assert torch.all(err <= x.double().abs() * 2.0**-4 + s.double()[:, None] * 2.0**-10)


@pytest.mark.skipif(not TRITON.available, reason=f"triton: {TRITON.reason}")
def test_triton_quantizers_bit_exact():
    from titan_kernels.triton import fp8_grouped_mm as tq

    sizes, k, n = [0, 21, 0, 6, 1], 40, 24
    offsets = make_offsets(sizes)
    x = torch.randn(sum(sizes) + 3, k, device=DEV, dtype=torch.bfloat16) * 3
    x[2] = 0.0  # an all-zero row (the floored amax)
    w = torch.randn(len(sizes), n, k, device=DEV).transpose(1, 2)  # strided weights
    for name, arg in (("rows", x), ("w_fwd", w), ("w_dgrad", w)):
        (cr, sr), (ct, st) = getattr(qref, name)(arg), getattr(tq, name)(arg)
        assert cr.stride() == ct.stride() and sr.shape == st.shape, name
        assert _same(cr, ct) and _same(sr, st), name
    (cr, sr), (ct, st) = qref.group_cols(x, offsets), tq.group_cols(x, offsets)
    last = int(offsets[-1])
    assert cr.stride() == ct.stride() and _same(cr[:last], ct[:last]) and _same(sr, st)


def _same(a, b) -> bool:
    """Bit for bit: the codes' bytes, the scales' values."""
    if a.dtype == E4M3:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def test_padded_groups_for_the_weight_gradient():
    sizes = [0, 5, 16, 17, 0, 40]
    offsets = make_offsets(sizes)
    t = sum(sizes) + 3  # and rows past the last group
    dest, pad_offsets, tp = fgm.padded_groups(offsets, t)
    padded = torch.diff(pad_offsets, prepend=pad_offsets.new_zeros(1)).tolist()
    assert all(p >= 16 and p % 16 == 0 and p >= s for p, s in zip(padded, sizes))
    assert tp % 16 == 0 and int(dest.max()) < tp and dest.unique().numel() == t  # injective, in bounds
    b, pb = [0] + offsets.tolist(), [0] + pad_offsets.tolist()
    for e, s in enumerate(sizes):  # each group's rows, in order, at the start of its padded group
        assert dest[b[e]:b[e + 1]].tolist() == list(range(pb[e], pb[e] + s))
    assert int(dest[b[-1]:].min()) >= pb[-1]


# ----------------------------------------------------------------------------- torch._scaled_grouped_mm


def _stand_in(original):
    """torch._scaled_grouped_mm on the CPU: torch's own meta checks (dtypes, layouts, 16-byte strides,
    scale shapes) on meta copies, CUTLASS's device asserts of the offsets (2-D x 2-D: every group
    non-empty, every group but the last a multiple of 16), then the math in float32, bf16 out, and
    NaN in the rows aten leaves uninitialized (past the last group of the 2-D x 3-D form)."""
    calls = []

    def meta(t):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

    def run(a, b, scale_a, scale_b, offs=None, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
        shape = original(meta(a), meta(b), meta(scale_a), meta(scale_b), offs=meta(offs), out_dtype=out_dtype).shape
        bounds = [0] + offs.tolist()
        sizes = [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])]
        if b.dim() == 2:
            assert all(s > 0 for s in sizes), f"CUTLASS: expected offsets to be greater than 0, got {sizes}"
            assert all(s % 16 == 0 for s in sizes[:-1]), f"CUTLASS: group sizes must be multiples of 16: {sizes}"
            k, n = a.shape[0], b.shape[1]
            out = torch.stack([(a[:, lo:hi].float() * scale_a[e * k:(e + 1) * k, None]).matmul(
                b[lo:hi].float() * scale_b[e * n:(e + 1) * n]) for e, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]))])
        else:
            out = torch.full((a.shape[0], b.shape[2]), float("nan"))
            for e, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
                out[lo:hi] = (a[lo:hi].float() * scale_a[lo:hi, None]) @ (b[e].float() * scale_b[e])
        calls.append("2d-2d" if b.dim() == 2 else "2d-3d")
        assert out.shape == shape
        return out.to(torch.bfloat16)

    return run, calls


@pytest.fixture
def aten_stand_in(monkeypatch):
    if DEV.type != "cpu":
        pytest.skip("the stand-in replaces the CPU's missing kernel; on CUDA aten runs itself")
    run, calls = _stand_in(torch._scaled_grouped_mm)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", run)
    fgm.why_not.cache_clear()
    fgm.aten_why_not.cache_clear()
    tk.backend.clear_choices()
    yield calls
    fgm.why_not.cache_clear()
    fgm.aten_why_not.cache_clear()
    tk.backend.clear_choices()


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_scaled_grouped_mm_adaptation(aten_stand_in, case):
    sizes, k, n = case
    t, e = sum(sizes), len(sizes)
    x = (torch.randn(t, k) * 2).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(e, k, n) * k**-0.5).to(torch.bfloat16).requires_grad_()
    offsets = make_offsets(sizes)
    assert fgm.why_not("aten", "cpu", None, torch.bfloat16) is None  # the probe passes with the stand-in
    y, dy, dx, dw = _run("cpu", x, w, offsets, "rowwise")  # "cpu": aten's kernel of the device
    want = dequantized_grads64(x.detach(), w.detach(), dy, offsets, "rowwise")
    for name, got, ref in zip(("y", "dx", "dw"), (y, dx, dw), want):
        assert got.dtype == torch.bfloat16 and rel(got, ref) <= TOL[torch.bfloat16], (name, rel(got, ref))
    if t:
        assert aten_stand_in[-3:] == ["2d-3d", "2d-3d", "2d-2d"]  # forward, dgrad, wgrad all on aten


def test_scaled_grouped_mm_tail_rows_zeroed(aten_stand_in):
    sizes, k, n = [3, 0, 18], 32, 16
    x = torch.randn(sum(sizes) + 4, k).to(torch.bfloat16)
    w = torch.randn(3, k, n).to(torch.bfloat16)
    y = fgm.forward(x, w, make_offsets(sizes), "rowwise", "aten")
    assert not y.isnan().any() and torch.all(y[-4:] == 0)


def test_scaled_grouped_mm_refusals():
    # float32 is refused (bf16 output only); on this torch's CPU the probe's reason is torch's own.
    assert "bfloat16 only" in fgm.why_not("aten", DEV.type, DEV.index, torch.float32)
    why = fgm.why_not("aten", "cpu", None, torch.bfloat16)
    assert why is None or why.startswith("torch._scaled_grouped_mm refuses it")
    if why is not None:
        x = torch.randn(4, 16, dtype=torch.bfloat16)
        w = torch.randn(2, 16, 16, dtype=torch.bfloat16)
        with tk.use_backend("cpu"), pytest.raises(RuntimeError, match="backend 'cpu' cannot run titan op 'fp8_grouped_mm'"):
            tk.fp8_grouped_mm(x, w, make_offsets([1, 3], "cpu"))


# ----------------------------------------------------------------------------- contract


def test_one_backend_for_forward_and_backward():
    calls = []
    with spied_kernels(fgm.OP, calls, forward="w_fwd", backward="w_dgrad"):
        check_one_backend(calls, tk.fp8_grouped_mm,
                          lambda x, w, o: torch.ops.titan.fp8_grouped_mm(x, w, o, "rowwise", "reference"))


def test_double_backward_refused():
    check_double_backward_refused("fp8_grouped_mm", tk.fp8_grouped_mm,
                                  lambda x, w, o: torch.ops.titan.fp8_grouped_mm(x, w, o, "rowwise"))


def test_opcheck():
    x, w, offsets, dy = opcheck_operands()
    for recipe in fgm.RECIPES:
        for backend in (None, "reference"):
            torch.library.opcheck(torch.ops.titan.fp8_grouped_mm, (x, w, offsets, recipe, backend))
    for recipe in fgm.RECIPES:
        for flags in ((True, True), (True, False), (False, True)):
            torch.library.opcheck(torch.ops.titan.fp8_grouped_mm_backward,
                                  (dy, x.detach(), w.detach(), offsets, recipe, *flags, None))


def test_compile_fullgraph():
    check_compile_fullgraph(tk.fp8_grouped_mm)


def test_backend_choice_and_reasons():
    x = torch.randn(4, 16, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(2, 16, 8, device=DEV, dtype=torch.bfloat16)
    name, skipped = fgm.backend_for(x, w)
    if DEV.type == "cpu":
        assert name == "reference" and skipped == {}  # the CPU's only automatic backend
    else:
        assert name in ("aten", "triton") or "aten" in skipped
    with tk.use_backend("triton"):
        if TRITON.available:
            assert fgm.backend_for(x, w)[0] == "triton"
        else:
            with pytest.raises(RuntimeError, match="backend 'triton' cannot run titan op 'fp8_grouped_mm'"):
                fgm.backend_for(x, w)
    other = "cuda" if DEV.type == "cpu" else "cpu"
    with tk.use_backend(other), pytest.raises(RuntimeError, match=f"backend '{other}' runs on {other} tensors"):
        tk.fp8_grouped_mm(x, w, make_offsets([1, 3]))


def test_measured_choice_orders_by_time(monkeypatch):
    # Not run: torch._scaled_grouped_mm has no CPU kernel (the stand-in timer alone orders them).
    check_measured_order(monkeypatch, fgm.measured_order, torch.bfloat16, run_candidates=False)


def test_validation_errors():
    x, w, o, shared = validation_cases()
    cases = [(args, {}, exc, msg) for args, exc, msg in shared] + [
        ((x.double(), w.double(), o), {}, TypeError, r"x: expected dtype in \(float32, bfloat16, float16\), got float64"),
        ((x, w, o), {"recipe": "tensorwise"}, ValueError, "recipe: expected one of"),
    ]
    for args, kw, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            tk.fp8_grouped_mm(*args, **kw)


def test_zero_size_dims():
    # K = 0: an empty sum; N = 0: no columns. Both give zeros (and zero gradients), no kernel.
    offsets = make_offsets([2, 3])
    for k, n in ((0, 4), (4, 0)):
        x = torch.randn(5, k, device=DEV, requires_grad=True)
        w = torch.randn(2, k, n, device=DEV, requires_grad=True)
        y = tk.fp8_grouped_mm(x, w, offsets)
        dx, dw = torch.autograd.grad(y.sum(), (x, w), allow_unused=True)
        assert y.shape == (5, n) and torch.all(y == 0)
        assert dx.shape == x.shape and dw.shape == w.shape
