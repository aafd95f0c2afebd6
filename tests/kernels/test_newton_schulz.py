"""newton_schulz: every backend against the float64 iteration at awkward shapes (tall, wide, 1-row,
1-column, odd, batched, non-contiguous, zero-size), with the orthogonality of the result reported;
convergence to the polar factor U V^T; torch.optim.Muon's iteration; opcheck, compile, DTensor, errors.

Tolerances (relative norm error against float64): float32 1e-5. A bfloat16 iteration rounds X, A and
B to bf16 at each of its 5 steps (15 products), so its error is that of a chain of bf16 roundings:
3e-2 (measured about 2e-2 on every backend, and torch.optim.Muon's own bf16 iteration agrees with
ours to the same level).
"""
from __future__ import annotations

import pytest
import torch

import titan_kernels as tk
from titan_kernels.reference import newton_schulz as ref
from tests.conftest import TEST_DEVICE
from tests.kernels.helpers import backends_here, rel_err

DEV = torch.device(TEST_DEVICE)
BACKENDS = backends_here("newton_schulz", ("reference", "triton", TEST_DEVICE))
BF16_TOL = 3e-2

SHAPES = {
    "tall": (50, 17), "wide": (17, 50), "1-row": (1, 40), "1-col": (40, 1), "odd-square": (33, 33),
    "many-tiles": (70, 90), "batched": (3, 17, 29), "batched-tall": (2, 45, 12),
}


def _ns64(g: torch.Tensor, steps=5, coefficients=ref.COEFFICIENTS) -> torch.Tensor:
    """The iteration in float64, written out (not the reference module)."""
    a, b, c = coefficients
    x = g.double()
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp_min(ref.EPS)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    for _ in range(steps):
        am = x @ x.mT
        x = a * x + (b * am + c * am @ am) @ x
    return x.mT if tall else x


def orthogonality(o: torch.Tensor) -> tuple[float, float, float]:
    """(min, max singular value, ||O O^T - I||_F / sqrt(r)) over the batch, r = min(m, n)."""
    o = o.double().reshape(-1, *o.shape[-2:])
    s = torch.linalg.svdvals(o)
    w = o if o.shape[-2] <= o.shape[-1] else o.mT
    eye = torch.eye(w.shape[-2], dtype=torch.float64, device=o.device)
    err = torch.linalg.matrix_norm(w @ w.mT - eye).max().item() / w.shape[-2] ** 0.5
    return s.min().item(), s.max().item(), err


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_equals_float64_with_orthogonality_reported(be, dtype, shape, record_property):
    g = torch.randn(shape, device=DEV)
    want = _ns64(g)
    got = tk.newton_schulz(g, dtype=dtype, backend=be)
    assert got.shape == g.shape and got.dtype == g.dtype and got.is_contiguous()
    tol = 1e-5 if dtype == torch.float32 or be == "reference" else BF16_TOL
    err = rel_err(got, want)
    smin, smax, orth = orthogonality(got)
    record_property("newton_schulz", {"backend": be, "dtype": str(dtype), "shape": shape, "rel_err": err,
                                      "sigma": (smin, smax), "orth_err": orth})
    print(f"\nnewton_schulz {be} {dtype} {shape}: rel err {err:.1e}, singular values [{smin:.3f}, {smax:.3f}], "
          f"||OO^T - I||/sqrt(r) {orth:.3f}")
    assert err < tol, (be, dtype, shape, err)
    # Jordan's quintic maps every singular value into about [0.7, 1.2] (not 1: its design), except the
    # smallest of a near-singular matrix (a random square one), which 5 steps cannot lift that far.
    assert smax < 1.3 and (smin > 0.5 or shape[-1] == shape[-2]), (smin, smax)


@pytest.mark.parametrize("be", BACKENDS)
def test_noncontiguous_and_zero_size(be):
    g = torch.randn(29, 41, device=DEV).t()  # a transposed view (41, 29)
    assert rel_err(tk.newton_schulz(g, backend=be), _ns64(g)) < 1e-5
    b = torch.randn(3, 40, 24, device=DEV)[:, ::2]  # strided rows
    assert rel_err(tk.newton_schulz(b, backend=be), _ns64(b)) < 1e-5
    for shape in [(0, 5), (3, 0, 4), (0, 2, 3)]:
        out = tk.newton_schulz(torch.randn(shape, device=DEV), backend=be)
        assert out.shape == shape


@pytest.mark.parametrize("be", BACKENDS)
def test_converges_to_the_polar_factor(be):
    """With the classic cubic (a, b, c) = (1.5, -0.5, 0) and enough steps the iteration reaches U V^T."""
    torch.manual_seed(1)
    u, _ = torch.linalg.qr(torch.randn(24, 24, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(40, 24, dtype=torch.float64))
    g = (u @ torch.diag(torch.linspace(1.0, 3.0, 24, dtype=torch.float64)) @ v.T).float().to(DEV)
    got = tk.newton_schulz(g, steps=30, coefficients=(1.5, -0.5, 0.0), backend=be)
    assert rel_err(got, (u @ v.T).to(DEV)) < 1e-5
    assert orthogonality(got)[2] < 1e-5


def test_matches_torch_muon_iteration():
    """torch.optim.Muon's bf16 iteration and ours in bf16 agree to bf16 precision; in float32 ours
    equals the float64 iteration (test above)."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    g = torch.randn(48, 80, device=DEV)
    theirs = _zeropower_via_newtonschulz(g, ref.COEFFICIENTS, 5, ref.EPS)
    ours = tk.newton_schulz(g, dtype=torch.bfloat16)
    assert rel_err(ours, theirs.float()) < BF16_TOL


def test_flops():
    assert ref.newton_schulz_flops(4096, 4096) == 5 * (4 * 4096**3 + 2 * 4096**3)
    assert ref.newton_schulz_flops(8192, 28672) == ref.newton_schulz_flops(28672, 8192) == 5 * (4 * 8192**2 * 28672 + 2 * 8192**3)


def test_opcheck_and_compile():
    g = torch.randn(12, 20, device=DEV)
    torch.library.opcheck(torch.ops.titan.newton_schulz.default, (g, 5, *ref.COEFFICIENTS, ref.EPS, None, None))
    torch._dynamo.reset()
    f = torch.compile(lambda x: tk.newton_schulz(x) * 2, fullgraph=True, backend="aot_eager")
    assert torch.equal(f(g), tk.newton_schulz(g) * 2)


def test_errors():
    g = torch.randn(4, 6)
    for kw, exc, msg in [
        (dict(g=torch.randn(5)), ValueError, "g: expected at least 2 dims"),
        (dict(g=g.long()), TypeError, "g: expected dtype"),
        (dict(g=g, steps=-1), ValueError, "steps"),
        (dict(g=g, coefficients=(1.0, 2.0)), ValueError, "coefficients"),
        (dict(g=g, eps=0.0), ValueError, "eps"),
        (dict(g=g, dtype=torch.int32), TypeError, "dtype"),
        (dict(g=torch.randn(4, 6, requires_grad=True)), RuntimeError, "no autograd"),
    ]:
        with pytest.raises(exc, match=msg):
            tk.newton_schulz(kw.pop("g"), **kw)
    other = "cuda" if DEV.type == "cpu" else "cpu"
    with pytest.raises(RuntimeError, match=f"runs on {other} tensors"):
        tk.newton_schulz(g, backend=other)


def _dtensor_case(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    experts = torch.randn(4, 10, 14)
    want = tk.newton_schulz(experts)
    dt = distribute_tensor(experts, mesh, [Shard(0)])
    with CommDebugMode() as comm:
        out = tk.newton_schulz(dt)
    assert comm.get_total_counts() == 0  # per-expert matrices are whole on each rank: no communication
    assert out.placements == (Shard(0),) and torch.equal(out.full_tensor(), want)
    cut = distribute_tensor(experts[0], mesh, [Shard(1)])  # a matrix dim split: DTensor gathers it first
    assert rel_err(tk.newton_schulz(cut).full_tensor(), want[0]) < 1e-6


def test_dtensor_batch_dims_run_locally():
    from tests.distributed.launcher import run_distributed

    run_distributed(_dtensor_case, 2)


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("scale", [1e19, 3e36, 2.0 ** 100], ids=["1e19", "3e36", "2^100"])
def test_scale_invariant_for_huge_finite_norms(be, scale):
    # float32 entries of 1e19 have ||G||^2 past float32's range: the norm was inf and the result
    # zeros. The normalisation divides by a power of two first: X(c G) = X(G) for every finite G.
    g = torch.randn(2, 9, 13, device=DEV)
    got = tk.newton_schulz(g * scale, backend=be)
    assert torch.isfinite(got).all()
    assert rel_err(got, _ns64(g)) < 1e-5
    if scale == 2.0 ** 100:  # a power of two: exactly the same bits as G's
        assert torch.equal(got, tk.newton_schulz(g, backend=be))


@pytest.mark.parametrize("be", BACKENDS)
def test_tiny_and_zero_matrices(be):
    # Below eps (the floor of the norm) a matrix is divided by eps, not normalised: a zero matrix gives
    # zeros and a tiny one stays tiny (documented). With eps below its norm, a tiny G is scale-invariant
    # too (entries near 1e-19: the squares of the norm would underflow to 0).
    g = torch.randn(2, 9, 6, device=DEV)
    assert torch.count_nonzero(tk.newton_schulz(torch.zeros(2, 9, 6, device=DEV), backend=be)) == 0
    tiny = tk.newton_schulz(g * 1e-12, backend=be)  # ||G|| about 1e-11 < eps: the iteration on G / eps
    assert rel_err(tiny, _ns64(g * 1e-12)) < 1e-5 and orthogonality(tiny)[1] < 0.1
    assert rel_err(tk.newton_schulz(g * 1e-19, eps=1e-30, backend=be), _ns64(g)) < 1e-5
    mixed = torch.stack([g[0] * 1e19, torch.zeros(9, 6, device=DEV)])  # per matrix: one huge, one zero
    out = tk.newton_schulz(mixed, backend=be)
    assert rel_err(out[0], _ns64(g[0])) < 1e-5 and torch.count_nonzero(out[1]) == 0
