"""titan::moe_permute / titan::moe_unpermute against float64 math: every backend, awkward shapes
(odd dim, experts nobody picks, T = 0, top-1, padding alignment), forward and backward (x, the expert
outputs and the router scores); the routing index against a per-slot definition; opcheck,
torch.compile(fullgraph=True) of route -> grouped_mm -> combine, validation errors, double backward
refused."""
from __future__ import annotations

import pytest
import torch

import titan_kernels as tk
from tests.conftest import TEST_DEVICE
from tests.kernels.helpers import rel_err as rel

DEV = torch.device(TEST_DEVICE)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float64: 1e-12}


def _backends():
    st = tk.available_backends(DEV)["triton"]
    return ["reference", pytest.param("triton", marks=[] if st.available else pytest.mark.skip(reason=f"triton: {st.reason}"))]


def route(t, e, k, skip=()):
    """Each token's top-k distinct experts, never one in ``skip`` (experts nobody picks)."""
    allowed = torch.tensor([i for i in range(e) if i not in skip])
    idx = torch.stack([allowed[torch.randperm(len(allowed))[:k]] for _ in range(t)]) if t else torch.zeros(0, k)
    return idx.long().to(DEV)


def check_routing(idx, e, align, routing):
    """The definition: group e holds the slots routed to e in slot order, padded to align."""
    t, k = idx.shape
    counts = torch.bincount(idx.reshape(-1).cpu(), minlength=e)
    assert routing.counts.tolist() == counts.tolist()
    padded = (counts + align - 1) // align * align
    assert routing.offsets.dtype == torch.int32 and routing.offsets.tolist() == padded.cumsum(0).tolist()
    start = 0
    for ex in range(e):
        slots = [s for s in range(t * k) if idx.reshape(-1)[s] == ex]
        assert routing.dst.reshape(-1)[slots].tolist() == list(range(start, start + len(slots)))
        start += int(padded[ex])
    rows = routing.src.shape[0]
    assert rows == t * k + e * (align - 1)
    inv = torch.full((rows,), -1, dtype=torch.long)
    inv[routing.dst.reshape(-1).cpu()] = torch.arange(t * k)
    assert routing.src.tolist() == inv.tolist()


# (T, dim, E, top_k, align, experts nobody picks)
CASES = [(13, 24, 6, 2, 1, (2,)), (9, 17, 5, 3, 4, (0, 4)), (1, 8, 3, 1, 8, ()), (0, 16, 4, 2, 4, ()), (7, 40, 8, 8, 8, ())]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-D{c[1]}-E{c[2]}-k{c[3]}-a{c[4]}")
def test_permute_unpermute_against_float64(case, dtype, backend):
    t, d, e, k, align, skip = case
    idx = route(t, e, k, skip)
    x = torch.randn(d, t, device=DEV, dtype=dtype).t().requires_grad_()  # non-contiguous tokens
    scores = torch.rand(t, k, device=DEV, dtype=torch.float32).requires_grad_()
    w_e = torch.randn(e, device=DEV, dtype=torch.float64)  # a per-expert scale stands in for the experts
    with tk.use_backend(backend):
        xp, routing = tk.moe_permute(x, idx, e, align)
        check_routing(idx.cpu(), e, align, routing)
        ex_of_row = torch.searchsorted(routing.offsets.long(), torch.arange(xp.shape[0], device=DEV), right=True)
        row_scale = w_e[ex_of_row.clamp_max(e - 1)].to(dtype)
        yp = xp * row_scale[:, None]
        out = tk.moe_unpermute(yp, routing, scores)
        dout = torch.randn_like(out)
        dx, ds = torch.autograd.grad(out, (x, scores), dout)
    # float64 math per token: out[t] = sum_j s[t, j] * w_e[idx[t, j]] * x[t]
    x64, s64 = x.detach().double().requires_grad_(), scores.detach().double().requires_grad_()
    want = (s64 * w_e[idx]).sum(1, keepdim=True) * x64 if t else x64.new_zeros(0, d)
    dx64, ds64 = torch.autograd.grad(want, (x64, s64), dout.double()) if t else (x64, s64)
    tol = TOL[dtype] if backend == "reference" or dtype != torch.float64 else 1e-6  # kernels accumulate in fp32
    assert out.shape == (t, d) and out.dtype == dtype and ds.dtype == torch.float32
    assert rel(out, want) <= tol and rel(dx, dx64) <= tol and rel(ds, ds64) <= max(tol, 1e-5)
    pad = routing.src < 0
    assert torch.all(xp.detach()[pad] == 0)  # padding rows are zeros, as the grouped GEMM wants
    for tt in range(min(t, 3)):
        for j in range(k):
            assert torch.equal(xp.detach()[routing.dst[tt, j]], x.detach()[tt])


@pytest.mark.parametrize("backend", _backends())
def test_unpermute_without_scores_and_yp_gradient(backend):
    t, d, e, k = 7, 12, 4, 2
    idx = route(t, e, k)
    x = torch.randn(t, d, device=DEV)
    yp0 = torch.randn(t * k + e * 3, d, device=DEV, requires_grad=True)
    with tk.use_backend(backend):
        _, routing = tk.moe_permute(x, idx, e, 4)
        out = tk.moe_unpermute(yp0, routing)
        dout = torch.randn_like(out)
        (dyp,) = torch.autograd.grad(out, (yp0,), dout)
    want = yp0.detach()[routing.dst].sum(1)
    assert rel(out, want) <= 1e-6
    want_dyp = torch.zeros_like(yp0)
    want_dyp[routing.dst.reshape(-1)] = dout.repeat_interleave(k, 0)
    assert rel(dyp, want_dyp) <= 1e-6 and torch.all(dyp[routing.src < 0] == 0)


def _compiled_moe_layer_matches_eager(tol, **compile_kw):
    """route -> grouped_mm -> combine under torch.compile(fullgraph=True, **compile_kw) equals eager
    within ``tol``, output and gradients; returns (y, x, router_w, w, idx)."""
    t, d, h, e, k = 10, 16, 8, 4, 2

    def layer(x, router_w, w, idx):
        scores = torch.softmax(x @ router_w, -1).gather(1, idx)
        xp, routing = tk.moe_permute(x, idx, e, 4)
        return tk.moe_unpermute(tk.grouped_mm(xp, w, routing.offsets), routing, scores)

    x = torch.randn(t, d, device=DEV, requires_grad=True)
    router_w = torch.randn(d, e, device=DEV, requires_grad=True)
    w = torch.randn(e, d, h, device=DEV, requires_grad=True)
    idx = route(t, e, k)
    y = torch.compile(layer, fullgraph=True, **compile_kw)(x, router_w, w, idx)
    g = torch.autograd.grad(y.sum(), (x, router_w, w))
    y0 = layer(x, router_w, w, idx)
    g0 = torch.autograd.grad(y0.sum(), (x, router_w, w))
    assert rel(y, y0) <= tol and all(rel(a, b) <= tol for a, b in zip(g, g0))
    return y, x, router_w, w, idx


def test_moe_layer_compiles_fullgraph_and_matches_eager():
    y, x, router_w, w, idx = _compiled_moe_layer_matches_eager(1e-6, backend="aot_eager")
    # and against the float64 per-token definition
    x64, w64 = x.detach().double(), w.detach().double()
    s64 = torch.softmax(x64 @ router_w.detach().double(), -1).gather(1, idx)
    want = sum(s64[:, j:j + 1] * torch.einsum("td,tdh->th", x64, w64[idx[:, j]]) for j in range(idx.shape[1]))
    assert rel(y, want) <= 1e-5


@pytest.mark.slow  # Inductor's CPU code generation: ~45 s on our shared 2-core machine
def test_moe_layer_compiles_with_inductor():
    _compiled_moe_layer_matches_eager(1e-5)


def test_opcheck():
    t, d, e, k = 6, 8, 3, 2
    idx = route(t, e, k)
    x = torch.randn(t, d, device=DEV, requires_grad=True)
    routing = tk.moe_routing(idx, e, 2)
    yp = torch.randn(routing.src.shape[0], d, device=DEV, requires_grad=True)
    scores = torch.rand(t, k, device=DEV, requires_grad=True)
    torch.library.opcheck(torch.ops.titan.moe_permute, (x, routing.src, routing.dst, None))
    torch.library.opcheck(torch.ops.titan.moe_unpermute, (yp, routing.src, routing.dst, scores, None))
    torch.library.opcheck(torch.ops.titan.moe_unpermute, (yp, routing.src, routing.dst, None, "reference"))
    torch.library.opcheck(torch.ops.titan.moe_permute_backward, (yp.detach(), routing.dst, None))
    dout = torch.randn(t, d, device=DEV)
    for need in (True, False):
        torch.library.opcheck(torch.ops.titan.moe_unpermute_backward,
                              (dout, yp.detach(), routing.src, routing.dst, scores.detach(), need, None))


def test_double_backward_refused():
    idx = route(5, 3, 2)
    x = torch.randn(5, 4, device=DEV, requires_grad=True)
    scores = torch.rand(5, 2, device=DEV, requires_grad=True)
    xp, routing = tk.moe_permute(x, idx, 3)
    for yp in (xp.square(), xp):
        with pytest.raises(RuntimeError, match="titan::moe_unpermute.*double backward"):
            torch.autograd.grad(tk.moe_unpermute(yp, routing, scores).sum(), (x, scores), create_graph=True)
        out = torch.ops.titan.moe_unpermute(yp, routing.src, routing.dst, scores)
        with pytest.raises(RuntimeError, match="titan::moe_unpermute.*double backward"):
            torch.autograd.grad(out.sum(), (x, scores), create_graph=True)
    xp = torch.ops.titan.moe_permute(x, routing.src, routing.dst)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(xp.square().sum(), (x,), create_graph=True)


def test_validation_errors():
    x = torch.randn(5, 4, device=DEV)
    idx = route(5, 3, 2)
    cases = [
        (lambda: tk.moe_permute(x.long(), idx, 3), TypeError, "x: expected dtype"),
        (lambda: tk.moe_permute(x, idx.float(), 3), TypeError, "expert_indices: expected dtype int32 or int64"),
        (lambda: tk.moe_permute(x, idx[0], 3), ValueError, "expert_indices: expected 2 dims"),
        (lambda: tk.moe_permute(x, idx[:4], 3), ValueError, r"expert_indices: expected shape \(5, top_k\)"),
        (lambda: tk.moe_permute(x, idx, 0), ValueError, "num_experts: expected an int >= 1"),
        (lambda: tk.moe_permute(x, idx, 3, 0), ValueError, "align: expected an int >= 1"),
        (lambda: tk.moe_permute(x, idx, 3.0), TypeError, "num_experts: expected an int"),
        (lambda: tk.moe_permute(x[0], idx, 3), ValueError, "x: expected 2 dims"),
    ]
    if DEV.type == "cpu":  # value checks run where they cost no device sync
        cases.append((lambda: tk.moe_permute(x, idx + 1, 3), ValueError, r"expected values in \[0, 3\)"))
    xp, routing = tk.moe_permute(x, idx, 3)
    cases += [
        (lambda: tk.moe_unpermute(xp[1:], routing), ValueError, r"yp: expected shape \(10, dim\)"),
        (lambda: tk.moe_unpermute(xp, routing, torch.rand(5, 3, device=DEV)), ValueError, r"scores: expected shape \(5, 2\)"),
        (lambda: tk.moe_unpermute(xp, routing, torch.ones(5, 2, dtype=torch.long, device=DEV)), TypeError, "scores: expected dtype"),
        (lambda: tk.moe_unpermute(xp, tuple(routing)), TypeError, "routing: expected the MoERouting"),
    ]
    for fn, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            fn()
