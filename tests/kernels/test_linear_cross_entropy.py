"""linear_cross_entropy: every backend that runs here against float64 math, gradients, opcheck,
torch.compile, errors, double backward.

The float64 reference is ``F.cross_entropy(h @ W.T)`` on the same (rounded) inputs upcast to
float64, with autograd for the gradients. Triton kernels run under TRITON_INTERPRET=1 (set in
tests/conftest.py). Tolerances (relative norm error): fp32 1e-5, bf16 1e-2.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import titan_kernels as tk
from titan_kernels import backend
from titan_kernels.triton import triton_interpret
from titan_kernels.reference import cross_entropy as ref
from tests.conftest import TEST_DEVICE
from tests.kernels.helpers import TOL, backends_here

REDUCTIONS = ("mean", "sum", "none")
BACKENDS = backends_here(names=("reference", "triton"))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    if b.numel() == 0 or b.norm() == 0:
        return float((a - b).norm())
    return float((a - b).norm() / b.norm())


def inputs(n, d, v, dtype, ignore_every=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=torch.float64).to(dtype).to(TEST_DEVICE)
    w = (torch.randn(v, d, generator=g, dtype=torch.float64) / d**0.5 * 2).to(dtype).to(TEST_DEVICE)
    y = torch.randint(0, v, (n,), generator=g).to(TEST_DEVICE)
    if ignore_every:
        y[::ignore_every] = -100
    return h, w, y


def set_chunk_rows(monkeypatch, rows, v):
    """Chunks of ``rows`` tokens at vocabulary ``v`` (the budget and the floor patched)."""
    monkeypatch.setitem(ref.CHUNK_BYTES, TEST_DEVICE, rows * v * 4)
    monkeypatch.setitem(ref.MIN_CHUNK_ROWS, TEST_DEVICE, 1)
    assert ref.chunk_rows(10**6, v, torch.device(TEST_DEVICE)) == rows


def grad_output(reduction, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    if reduction == "none":
        return torch.rand(n, generator=g, dtype=torch.float64).to(TEST_DEVICE) + 0.5
    return torch.tensor(1.7, dtype=torch.float64, device=TEST_DEVICE)


def f64(h, w, y, reduction, gout, ignore_index=-100):
    """Loss and gradients in float64 (autograd of the unfused formula)."""
    h64 = h.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    loss = F.cross_entropy(h64 @ w64.T, y, ignore_index=ignore_index, reduction=reduction)
    dh, dw = torch.autograd.grad(loss, (h64, w64), gout) if h.shape[0] else (torch.zeros_like(h64), torch.zeros_like(w64))
    return loss.detach(), dh, dw


def run(be, h, w, y, reduction, gout, **kw):
    h = h.detach().requires_grad_()
    w = w.detach().requires_grad_()
    with tk.use_backend(be):
        loss = tk.linear_cross_entropy(h, w, y, reduction=reduction, **kw)
        loss.backward(gout.float())
    return loss, h.grad, w.grad


# --------------------------------------------------------------------------- against float64


def _interpreter_cost(be, dtype, reduction):
    # The Triton interpreter takes ~6 s per call at N = 1000, V = 5003: by default it runs the fused
    # forward (mean, fp32) and the recomputing backward (none, bf16) there; -m slow runs the rest
    # (test_smaller_shape_all_cases_match_float64 covers every case of it at a smaller shape).
    if be == "triton" and triton_interpret() and (dtype, reduction) not in (
            (torch.float32, "mean"), (torch.bfloat16, "none")):
        return [pytest.mark.slow]
    return []


AWKWARD = [pytest.param(be.values[0], dtype, reduction, marks=[*be.marks, *_interpreter_cost(be.values[0], dtype, reduction)],
                        id=f"{reduction}-{str(dtype)[6:]}-{be.values[0]}")
           for be in BACKENDS for dtype in (torch.float32, torch.bfloat16) for reduction in REDUCTIONS]


@pytest.mark.parametrize("be,dtype,reduction", AWKWARD)
def test_awkward_shape_matches_float64(be, dtype, reduction, monkeypatch):
    # N = 1000, D = 96, V = 5003 (prime), every 7th label ignored; chunks of 208 rows (the last of 168).
    set_chunk_rows(monkeypatch, 208, 5003)
    check_against_float64(be, dtype, reduction, 1000, 96, 5003, ignore_every=7)


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_smaller_shape_all_cases_match_float64(be, dtype, reduction, monkeypatch):
    set_chunk_rows(monkeypatch, 64, 1001)  # 5 chunks, the last of 44 rows
    check_against_float64(be, dtype, reduction, 300, 40, 1001, ignore_every=5)


def check_against_float64(be, dtype, reduction, n, d, v, ignore_every):
    h, w, y = inputs(n, d, v, dtype, ignore_every=ignore_every)
    gout = grad_output(reduction, n)
    loss, dh, dw = run(be, h, w, y, reduction, gout)
    loss64, dh64, dw64 = f64(h, w, y, reduction, gout)
    assert loss.dtype == torch.float32 and loss.shape == loss64.shape
    assert dh.dtype == dtype and dw.dtype == dtype
    # The loss: float32 logits and accumulation, so float32 accuracy even for bf16 inputs.
    assert rel_err(loss, loss64) < 1e-5
    assert rel_err(dh, dh64) < TOL[dtype]
    assert rel_err(dw, dw64) < TOL[dtype]
    if reduction == "none":
        assert torch.all(loss[::ignore_every] == 0)


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_many_chunks_and_remainder(be, reduction, monkeypatch):
    # 16 rows of 61 columns per chunk, the last one partial (100 = 6 * 16 + 4).
    set_chunk_rows(monkeypatch, 16, 61)
    h, w, y = inputs(100, 9, 61, torch.float32, ignore_every=5)
    gout = grad_output(reduction, 100)
    loss, dh, dw = run(be, h, w, y, reduction, gout)
    loss64, dh64, dw64 = f64(h, w, y, reduction, gout)
    assert rel_err(loss, loss64) < 1e-5 and rel_err(dh, dh64) < 1e-5 and rel_err(dw, dw64) < 1e-5


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_rows_ignored(be, dtype, reduction):
    h, w, y = inputs(13, 8, 17, dtype)
    y[:] = -100
    gout = grad_output(reduction, 13)
    loss, dh, dw = run(be, h, w, y, reduction, gout)
    loss64, _, _ = f64(h, w, y, reduction, gout)
    if reduction == "mean":  # 0 / 0, as F.cross_entropy; the gradients are zeros, not NaN
        assert torch.isnan(loss) and torch.isnan(loss64)
    else:
        assert torch.equal(loss, torch.zeros_like(loss))
    assert torch.equal(dh, torch.zeros_like(dh)) and torch.equal(dw, torch.zeros_like(dw))


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_zero_tokens(be, reduction):
    h, w, y = inputs(0, 8, 17, torch.float32)
    loss, dh, dw = run(be, h, w, y, reduction, grad_output(reduction, 0))
    ref_loss = F.cross_entropy(h @ w.T, y, reduction=reduction)
    assert loss.shape == ref_loss.shape
    if reduction == "mean":
        assert torch.isnan(loss) and torch.isnan(ref_loss)
    else:
        assert torch.equal(loss, ref_loss)
    assert dh.shape == (0, 8) and torch.equal(dw, torch.zeros_like(dw))


def test_chunk_rows_budget_and_floor():
    cpu = torch.device("cpu")
    assert ref.chunk_rows(8192, 32000, cpu) == 256  # 32 MiB of fp32 logits
    assert ref.chunk_rows(8192, 128256, cpu) == 256  # the floor: the dW GEMM needs rows
    assert ref.chunk_rows(100_000, 258, cpu) == 32512  # a small vocabulary: large chunks
    assert ref.chunk_rows(37, 32000, cpu) == 37 and ref.chunk_rows(0, 5, cpu) == 1
    assert ref.chunk_rows(100_000, 128256, torch.device("cuda")) == 512


@pytest.mark.parametrize("be", BACKENDS)
def test_views_leading_dims_and_custom_ignore_index(be):
    base_h = torch.randn(40, 2, 30, device=TEST_DEVICE)
    h = base_h[:, 1, :24].reshape(4, 10, 24)  # strided rows, 3-D (batch, seq, dim)
    w = torch.randn(24, 51, device=TEST_DEVICE).t()  # (51, 24), transposed storage
    y = torch.randint(0, 51, (4, 10), device=TEST_DEVICE)
    y[0, :3] = 7  # ignore_index 7 is also a real class: those tokens must be skipped
    for reduction in REDUCTIONS:
        gout = grad_output(reduction, 40)
        gout = gout.view(4, 10) if reduction == "none" else gout
        loss, dh, dw = run(be, h, w, y, reduction, gout, ignore_index=7)
        h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        l64 = F.cross_entropy((h64 @ w64.T).flatten(0, 1), y.flatten(), ignore_index=7, reduction=reduction)
        l64 = l64.view(4, 10) if reduction == "none" else l64
        dh64, dw64 = torch.autograd.grad(l64, (h64, w64), gout)
        assert loss.shape == l64.shape
        assert rel_err(loss, l64) < 1e-5 and rel_err(dh, dh64) < 1e-5 and rel_err(dw, dw64) < 1e-5, reduction


@pytest.mark.parametrize("be", BACKENDS)
def test_one_input_requires_grad_and_no_grad(be):
    h, w, y = inputs(50, 16, 33, torch.float32, ignore_every=4)
    loss64, dh64, dw64 = f64(h, w, y, "mean", torch.tensor(1.0, dtype=torch.float64))
    with tk.use_backend(be):
        hh = h.clone().requires_grad_()
        (dh,) = torch.autograd.grad(tk.linear_cross_entropy(hh, w, y), hh)  # frozen weight
        ww = w.clone().requires_grad_()
        (dw,) = torch.autograd.grad(tk.linear_cross_entropy(h, ww, y), ww)  # frozen hidden
        with torch.no_grad():
            loss = tk.linear_cross_entropy(hh, ww, y)
    assert rel_err(dh, dh64) < 1e-5 and rel_err(dw, dw64) < 1e-5
    assert rel_err(loss, loss64) < 1e-5 and not loss.requires_grad


def test_the_op_without_fused_gradients_recomputes_them():
    # Called directly with compute_dhidden/compute_dweight False, the backward recomputes the
    # gradients from lse instead of returning nothing.
    h, w, y = inputs(30, 8, 19, torch.float32, ignore_every=3)
    h, w = h.requires_grad_(), w.requires_grad_()
    loss = torch.ops.titan.linear_cross_entropy(h, w, y, -100, "mean", False, False, 0, -1, None)[0]
    dh, dw = torch.autograd.grad(loss, (h, w))
    _, dh64, dw64 = f64(h, w, y, "mean", torch.tensor(1.0, dtype=torch.float64))
    assert rel_err(dh, dh64) < 1e-5 and rel_err(dw, dw64) < 1e-5


def test_backward_runs_on_the_forwards_backend(monkeypatch):
    if not backend.backend_status("triton", TEST_DEVICE).available:
        pytest.skip(f"triton unavailable: {backend.backend_status('triton', TEST_DEVICE).reason}")
    from titan_kernels.triton import cross_entropy as tri

    calls = []
    real = tri._ce_grad_kernel
    monkeypatch.setattr(tri, "_ce_grad_kernel", type("Spy", (), {
        "__getitem__": lambda self, grid: (calls.append(grid), real[grid])[1]})())
    h, w, y = inputs(20, 8, 19, torch.float32)
    h.requires_grad_()
    with tk.use_backend("triton"):
        loss = tk.linear_cross_entropy(h, w, y, reduction="none")
    assert not calls  # "none": no gradient pass in the forward
    loss.sum().backward()  # outside the context: still the triton kernels
    assert calls


# --------------------------------------------------------------------------- double backward


@pytest.mark.parametrize("reduction", ["mean", "none"])  # saved gradients / recomputed ones
def test_double_backward_raises_naming_the_op(reduction):
    h, w, y = inputs(12, 8, 11, torch.float32)
    h.requires_grad_()
    w.requires_grad_()
    for call in (lambda: tk.linear_cross_entropy(h, w, y, reduction=reduction),
                 lambda: torch.ops.titan.linear_cross_entropy(h, w, y, -100, reduction, True, True, 0, -1, None)[0]):
        loss = call().sum()
        dh, dw = torch.autograd.grad(loss, (h, w), create_graph=True)
        with pytest.raises(RuntimeError, match="titan::linear_cross_entropy: double backward"):
            (dh.square().sum() + dw.sum()).backward()


# --------------------------------------------------------------------------- op machinery


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_opcheck(reduction):
    h, w, y = inputs(37, 8, 53, torch.float32, ignore_every=6)
    h.requires_grad_()
    w.requires_grad_()
    for flags in ((True, True), (True, False), (False, True), (False, False)):
        torch.library.opcheck(torch.ops.titan.linear_cross_entropy.default, (h, w, y, -100, reduction, *flags, 0, -1, None))
    lse = torch.logsumexp(h.detach() @ w.detach().T, 1)
    gl = torch.rand(37) if reduction == "none" else torch.tensor(0.7)
    torch.library.opcheck(torch.ops.titan.linear_cross_entropy_backward.default,
                          (gl, h.detach(), w.detach(), y, lse, -100, reduction, True, True, 0, "reference"))


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_compile_fullgraph_equals_eager(reduction):
    torch._dynamo.reset()
    h, w, y = inputs(45, 16, 37, torch.float32, ignore_every=4)
    gout = grad_output(reduction, 45).float()

    def step(h, w, y):
        return tk.linear_cross_entropy(h, w, y, reduction=reduction)

    compiled = torch.compile(step, fullgraph=True)
    hc, wc = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss_c = compiled(hc, wc, y)
    loss_c.backward(gout)
    he, we = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss_e = step(he, we, y)
    loss_e.backward(gout)
    assert torch.allclose(loss_c, loss_e, rtol=1e-6, atol=1e-6)
    assert torch.allclose(hc.grad, he.grad, rtol=1e-5, atol=1e-7)
    assert torch.allclose(wc.grad, we.grad, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------- errors


def test_errors():
    h, w, y = inputs(6, 8, 11, torch.float32)
    f = tk.linear_cross_entropy
    with pytest.raises(ValueError, match=r"weight: expected shape \(V, 8\)"):
        f(h, w[:, :7], y)
    with pytest.raises(ValueError, match="labels: expected shape"):
        f(h, w, y[:5])
    with pytest.raises(TypeError, match="weight: expected dtype torch.float32"):
        f(h, w.bfloat16(), y)
    with pytest.raises(TypeError, match="labels: expected dtype int64, got int32"):
        f(h, w, y.int())
    with pytest.raises(TypeError, match="hidden: expected dtype"):
        f(h.long(), w, y)
    with pytest.raises(ValueError, match="reduction: expected one of"):
        f(h, w, y, reduction="avg")
    with pytest.raises(TypeError, match="ignore_index: expected an int"):
        f(h, w, y, ignore_index=-100.0)
    with pytest.raises(ValueError, match="labels: expected device"):
        f(h, w, y.to("meta"))
    bad = y.clone()
    bad[3] = 11
    with pytest.raises(ValueError, match=r"labels: expected values in \[0, 11\).*got 11 at index 3"):
        f(h, w, bad)
    bad[3] = -5
    with pytest.raises(ValueError, match="got -5 at index 3"):
        f(h, w, bad)


def test_label_check_marks_instead_of_raising_off_cpu():
    # Off the CPU the check would wait for the device: bad tokens are marked (their loss NaN).
    y = torch.tensor([0, 5, -100, 11, -1], device="meta")
    bad = ref.check_labels(y, -100, 11)
    assert bad is not None and bad.shape == y.shape and bad.device.type == "meta"
