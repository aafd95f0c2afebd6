"""titan::grouped_mm against a float64 per-expert loop: every backend, awkward shapes (odd K/N, groups
not a multiple of any tile, empty experts, T = 0, rows past the last group), forward, dx and dw;
opcheck, torch.compile(fullgraph=True), validation errors, the backend choice and its reasons,
one backend for forward and backward, double backward refused."""
from __future__ import annotations

import pytest
import torch

import titan_kernels as tk
from titan_kernels.ops import grouped_mm as gmm
from tests.kernels.helpers import (
    DEV, GROUPED_CASES as CASES, backend_ctx as _ctx, case_id, check_compile_fullgraph, check_double_backward_refused,
    check_measured_order, check_one_backend, spied_kernels, grouped_grads, loop64, loop64_grads, make_offsets, noncontiguous_operands,
    opcheck_operands, rel_err as rel, validation_cases,
)

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float64: 1e-12}


def _backends():
    out = ["reference", "auto"]
    if DEV.type == "cpu" or torch.cuda.is_available():
        out.append("aten")
    st = tk.available_backends(DEV)["triton"]
    out.append(pytest.param("triton", marks=[] if st.available else pytest.mark.skip(reason=f"triton: {st.reason}")))
    return out




@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_against_float64_loop(case, dtype, backend):
    sizes, k, n = case
    if backend == "aten" and gmm.why_not("aten", DEV.type, DEV.index, dtype, k, n):
        pytest.skip(f"aten refuses: {gmm.why_not('aten', DEV.type, DEV.index, dtype, k, n)}")
    t, e = sum(sizes), len(sizes)
    x = torch.randn(t, k, device=DEV, dtype=dtype, requires_grad=True)
    w = (torch.randn(e, k, n, device=DEV, dtype=dtype) * k**-0.5).requires_grad_()
    offsets = make_offsets(sizes)
    y, dy, dx, dw = grouped_grads(backend, tk.grouped_mm, x, w, offsets)
    y64, dx64, dw64 = loop64_grads(x, w, offsets, dy)
    assert y.shape == (t, n) and y.dtype == dtype and dx.dtype == dtype and dw.dtype == dtype
    for got, want in ((y, y64), (dx, dx64), (dw, dw64)):
        assert rel(got, want) <= TOL[dtype]
    empty = [i for i, s in enumerate(sizes) if s == 0]
    assert torch.all(dw[empty] == 0)


@pytest.mark.parametrize("backend", _backends())
def test_rows_past_last_group_are_zero(backend):
    # Padding rows a caller keeps after the last group: output and dx rows 0, no effect on dw.
    sizes, k, n, tail = [4, 0, 6], 16, 8, 5
    x = torch.randn(sum(sizes) + tail, k, device=DEV, requires_grad=True)
    w = torch.randn(3, k, n, device=DEV, requires_grad=True)
    offsets = make_offsets(sizes)
    y, dy, dx, dw = grouped_grads(backend, tk.grouped_mm, x, w, offsets)
    assert torch.all(y[-tail:] == 0) and torch.all(dx[-tail:] == 0)
    y64, dx64, dw64 = loop64_grads(x[:-tail], w, offsets, dy[:-tail])
    assert rel(y[:-tail], y64) <= 1e-5 and rel(dx[:-tail], dx64) <= 1e-5 and rel(dw, dw64) <= 1e-5


@pytest.mark.parametrize("backend", _backends())
def test_noncontiguous_inputs(backend):
    x, ws, offsets = noncontiguous_operands()
    with _ctx(backend):
        for ww in ws:
            assert rel(tk.grouped_mm(x, ww, offsets), loop64(x, ww, offsets)) <= 1e-5


def test_gradcheck_float64_reference():
    x = torch.randn(9, 5, device=DEV, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 5, 4, device=DEV, dtype=torch.float64, requires_grad=True)
    offsets = make_offsets([4, 0, 5])
    assert gmm.backend_for(x, w)[0] == "reference"  # aten takes no float64: the reference does
    assert torch.autograd.gradcheck(lambda a, b: tk.grouped_mm(a, b, offsets), (x, w))


def test_one_backend_for_forward_and_backward():
    calls = []
    with spied_kernels(gmm.OP, calls):
        check_one_backend(calls, tk.grouped_mm, lambda x, w, o: torch.ops.titan.grouped_mm(x, w, o, "reference"))


def test_double_backward_refused():
    check_double_backward_refused("grouped_mm", tk.grouped_mm, torch.ops.titan.grouped_mm)


def test_opcheck():
    x, w, offsets, dy = opcheck_operands()
    for backend in (None, "reference"):
        torch.library.opcheck(torch.ops.titan.grouped_mm, (x, w, offsets, backend))
    for flags in ((True, True), (True, False), (False, True)):
        torch.library.opcheck(torch.ops.titan.grouped_mm_backward, (dy, x.detach(), w.detach(), offsets, *flags, None))


def test_compile_fullgraph():
    check_compile_fullgraph(tk.grouped_mm)


def test_backend_choice_and_reasons():
    x = torch.randn(4, 7, device=DEV)
    w = torch.randn(2, 7, 5, device=DEV)
    name, skipped = gmm.backend_for(x, w)
    assert name != "aten" and "16 bytes" in skipped["aten"]
    x = torch.randn(4, 16, device=DEV)
    w = torch.randn(2, 16, 8, device=DEV)
    if DEV.type == "cpu":
        assert gmm.backend_for(x, w)[0] == "aten"  # the measured fastest where it takes the case
    else:  # CUDA: aten where it takes float32 here, else (or if measured faster) our kernel
        assert gmm.backend_for(x, w)[0] in ("aten", "triton")
    with tk.use_backend(DEV.type), pytest.raises(RuntimeError, match="16 bytes"):
        tk.grouped_mm(torch.randn(4, 7, device=DEV), torch.randn(2, 7, 5, device=DEV), make_offsets([1, 3]))


def test_validation_errors():
    x, w, o, cases = validation_cases()
    cases += [
        ((x, w.double(), o), TypeError, "w: expected dtype float32"),  # float64 is grouped_mm's too
        ((x, w[:0], o[:0]), ValueError, "at least one expert"),
    ]
    for args, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            tk.grouped_mm(*args)


@pytest.mark.skipif(not tk.available_backends(DEV)["triton"].available, reason="triton cannot run on this device")
@pytest.mark.parametrize("use_tma", [False, True], ids=["pointer", "tma"])
def test_triton_kernels_both_paths(use_tma):
    # The TMA variant runs in the interpreter too (host tensor descriptors), so both are checked here:
    # K not a multiple of the K block (the 3-D descriptor must zero-fill, never read the next expert).
    if use_tma and (gmm_tri().TensorDescriptor is None):
        pytest.skip("this triton has no host tensor descriptors (needs triton >= 3.4)")
    tri = gmm_tri()
    sizes, k, n = [0, 21, 0, 6, 1], 40, 24
    x = torch.randn(sum(sizes) + 3, k, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(len(sizes), k, n, device=DEV, dtype=torch.bfloat16)
    dy = torch.randn(x.shape[0], n, device=DEV, dtype=torch.bfloat16)
    offsets = make_offsets(sizes)
    y = tri.grouped_mm_fwd(x, w, offsets, use_tma=use_tma)
    dx, dw = tri.grouped_mm_bwd(dy, x, w, offsets, use_tma=use_tma)
    dx64, dw64 = gmm._ref.grouped_mm_bwd(dy.double(), x.double(), w.double(), offsets)
    assert rel(y, gmm._ref.grouped_mm_fwd(x.double(), w.double(), offsets)) <= 1e-2
    assert rel(dx, dx64) <= 1e-2 and rel(dw, dw64) <= 1e-2
    assert torch.all(y[-3:] == 0) and torch.all(dx[-3:] == 0) and torch.all(dw[[0, 2]] == 0)


def gmm_tri():
    from titan_kernels.triton import grouped_mm

    return grouped_mm


def test_measured_choice_orders_by_time(monkeypatch):
    # The CUDA choice between aten and triton is timed once per key: the candidates really run here.
    check_measured_order(monkeypatch, gmm.measured_order, torch.float32, run_candidates=True)


def test_meta_tensors_give_shapes():
    # Meta tensors (shape-only, e.g. building a model on the meta device) run the op's fake: no values read.
    x, w = torch.empty(40, 32, device="meta"), torch.empty(4, 32, 16, device="meta")
    offsets = torch.empty(4, dtype=torch.int32, device="meta")
    for fn in (tk.grouped_mm, tk.fp8_grouped_mm):
        y = fn(x, w, offsets)
        assert y.shape == (40, 16) and y.device.type == "meta"
