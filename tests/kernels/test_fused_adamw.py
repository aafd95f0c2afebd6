"""fused_adamw_: every backend against a float64 AdamW at awkward shapes, against torch.optim.AdamW's
trajectory, DTensor shards, stochastic rounding (unbiased, deterministic, resumable), one launch per
list, the native ISA builds, opcheck and errors.

Triton runs under TRITON_INTERPRET=1 (tests/conftest.py), so shapes stay small.
"""
from __future__ import annotations

import math

import pytest
import torch

import titan_kernels as tk
from titan_kernels.reference import fused_adamw as ref
from tests.conftest import TEST_DEVICE
from tests.kernels.helpers import backends_here, rel_err

BACKENDS = backends_here("fused_adamw")
DEV = torch.device(TEST_DEVICE)
HYPER = dict(lr=3e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def _awkward(dtype=torch.float32):
    """Parameters of odd, zero-size, 1-element, 3-D and non-contiguous (transposed, strided) shapes."""
    shapes = [(37, 19), (0, 5), (1,), (1000,), (3, 5, 7)]
    ts = [torch.randn(s, device=DEV, dtype=dtype) for s in shapes]
    ts.append(torch.randn(19, 37, device=DEV, dtype=dtype).t())
    ts.append(torch.randn(64, device=DEV, dtype=dtype)[::2])
    return ts


def _adamw64(p, g, m, v, step, lr, beta1, beta2, eps, weight_decay):
    """One AdamW step in float64 (torch.optim.AdamW's formula), written out."""
    p = p * (1 - lr * weight_decay)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    denom = (v.sqrt() / math.sqrt(1 - beta2 ** step)) + eps
    return p - lr / (1 - beta1 ** step) * m / denom, m, v


@pytest.mark.parametrize("be", BACKENDS)
def test_three_steps_equal_float64_at_awkward_shapes(be):
    params = _awkward()
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    p64 = [p.double() for p in params]
    m64 = [x.double() for x in m]
    v64 = [x.double() for x in v]
    for step in range(1, 4):
        grads = [torch.randn_like(p) for p in params]
        tk.fused_adamw_(params, grads, m, v, step=step, backend=be, **HYPER)
        for i, g in enumerate(grads):
            p64[i], m64[i], v64[i] = _adamw64(p64[i], g.double(), m64[i], v64[i], step, **HYPER)
    assert not params[5].is_contiguous() and not params[6].is_contiguous()  # written through their views
    for i in range(len(params)):
        for name, got, want in (("param", params[i], p64[i]), ("exp_avg", m[i], m64[i]), ("exp_avg_sq", v[i], v64[i])):
            assert rel_err(got, want) < 1e-5, (be, i, name, rel_err(got, want))


@pytest.mark.parametrize("be", BACKENDS)
def test_trajectory_equals_torch_adamw(be):
    """Ten steps against torch.optim.AdamW (float32 states): equal to float32 rounding."""
    torch.manual_seed(1)
    ours = [torch.randn(33, 17, device=DEV), torch.randn(65, device=DEV)]
    theirs = [p.clone().requires_grad_() for p in ours]
    opt = torch.optim.AdamW(theirs, lr=HYPER["lr"], betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    m = [torch.zeros_like(p) for p in ours]
    v = [torch.zeros_like(p) for p in ours]
    for step in range(1, 11):
        grads = [torch.randn_like(p) for p in ours]
        for t, g in zip(theirs, grads):
            t.grad = g.clone()
        opt.step()
        tk.fused_adamw_(ours, grads, m, v, step=step, backend=be, **HYPER)
    for a, b in zip(ours, theirs):
        assert rel_err(a, b.detach()) < 2e-7, rel_err(a, b.detach())
        assert (a - b.detach()).abs().max() <= 4 * torch.finfo(torch.float32).eps * b.detach().abs().max()


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("pdt,sdt", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                     (torch.bfloat16, torch.bfloat16)], ids=["bf16-param", "bf16-states", "bf16-both"])
def test_bf16_storage_equals_float64_to_bf16_rounding(be, pdt, sdt):
    params = [p.to(pdt) for p in _awkward()]
    m = [(0.1 * torch.randn_like(p, dtype=torch.float32)).to(sdt) for p in params]
    v = [(0.01 * torch.rand_like(p, dtype=torch.float32)).to(sdt) for p in params]
    grads = [torch.randn_like(p) for p in params]
    want = [_adamw64(p.double(), g.double(), a.double(), b.double(), 4, **HYPER) for p, g, a, b in
            zip(params, grads, m, v)]
    tk.fused_adamw_(params, grads, m, v, step=4, seed=3, backend=be, **HYPER)
    for i, (p64, m64, v64) in enumerate(want):
        for name, got, w in (("param", params[i], p64), ("exp_avg", m[i], m64), ("exp_avg_sq", v[i], v64)):
            assert got.dtype == (pdt if name == "param" else sdt)
            assert rel_err(got, w) < 1e-2, (i, name, rel_err(got, w))


def _bf16_up(b: torch.Tensor) -> torch.Tensor:
    """The next bf16 value above each (non-zero, finite) bf16 value: its bit pattern +-1."""
    i = b.view(torch.int16).to(torch.int32)
    return (i + torch.where(i >= 0, 1, -1)).to(torch.int16).view(torch.bfloat16)


def _neighbours(x64: torch.Tensor):
    """The bf16 values just below and above each (non-zero) float64 value (equal when it is one)."""
    near = x64.float().to(torch.bfloat16)
    down = (-_bf16_up(-near))  # the bf16 value below ``near``
    lo = torch.where(near.double() > x64, down, near)
    hi = torch.where(lo.double() == x64, lo, _bf16_up(lo))
    return lo.double(), hi.double()


@pytest.mark.parametrize("be", BACKENDS)
def test_stochastic_rounding_is_unbiased(be):
    """E[stored bf16 parameter] = the exact update. One step from the same state with seeds 0..S-1
    on M elements: each stored value is one of its two bf16 neighbours; the mean over seeds of
    (stored - exact) / gap has standard deviation <= 0.5 / sqrt(S) per element; we require every
    element within 6 standard deviations and the mean over all elements within 6 / sqrt(S M) x 0.5.
    (At S = 64 seeds and M = 2048 elements: per element 0.375 of a gap, overall 0.0083.)"""
    seeds, n = (64, 2048) if be != "triton" else (16, 512)
    torch.manual_seed(2)
    p0 = torch.randn(n, device=DEV).bfloat16()
    g = torch.randn(n, device=DEV)
    m0, v0 = 0.1 * torch.randn(n, device=DEV), 0.01 * torch.rand(n, device=DEV)
    exact, m64, v64 = _adamw64(p0.double(), g.double(), m0.double(), v0.double(), 5, **HYPER)
    lo, hi = _neighbours(exact)
    gap = (hi - lo).clamp_min(1e-30)
    frac = torch.zeros(n, dtype=torch.float64, device=DEV)
    ups = torch.zeros(n, dtype=torch.float64, device=DEV)
    for s in range(seeds):
        p, m, v = p0.clone(), m0.clone(), v0.clone()
        tk.fused_adamw_([p], [g], [m], [v], step=5, seed=s, backend=be, **HYPER)
        got = p.double()
        assert bool(((got == lo) | (got == hi)).all()), "a stochastic rounding is not a neighbour"
        frac += (got - exact) / gap
        ups += (got == hi).double()
    per_elem = frac / seeds
    sd = 0.5 / math.sqrt(seeds)
    assert per_elem.abs().max().item() < 6 * sd
    assert abs(per_elem.mean().item()) < 6 * sd / math.sqrt(n)
    assert 0.05 < (ups.sum() / (seeds * n)).item() < 0.95  # both directions occur


@pytest.mark.parametrize("be", BACKENDS)
def test_random_bits_are_deterministic_and_resumable(be):
    """The bits depend on (seed, step, key, element) only: the same call twice gives the same bits, a
    run split at any step (a resume) equals the run in one go, another seed or key differs."""
    torch.manual_seed(3)
    p0 = torch.randn(300, device=DEV).bfloat16()
    grads = [torch.randn(300, device=DEV) for _ in range(4)]

    def run(steps, seed=1, key=7, state=None):
        p, m, v = state or (p0.clone(), torch.zeros(300, device=DEV).bfloat16(), torch.zeros(300, device=DEV).bfloat16())
        for s in steps:
            tk.fused_adamw_([p], [grads[s - 1]], [m], [v], step=s, seed=seed, param_keys=[key], backend=be, **HYPER)
        return p, m, v

    whole = run(range(1, 5))
    half = run(range(1, 3))
    resumed = run(range(3, 5), state=tuple(t.clone() for t in half))
    assert all(torch.equal(a, b) for a, b in zip(whole, resumed))
    assert all(torch.equal(a, b) for a, b in zip(whole, run(range(1, 5))))
    assert not torch.equal(whole[0], run(range(1, 5), seed=2)[0])
    assert not torch.equal(whole[0], run(range(1, 5), key=8)[0])


def test_backends_draw_the_same_bits():
    """reference, Triton and the native kernel use one hash: bf16 results agree bit for bit."""
    names = [b.values[0] for b in BACKENDS if not b.marks]
    torch.manual_seed(4)
    base = [torch.randn(257, device=DEV).bfloat16(), torch.randn(3, 41, device=DEV).bfloat16()]
    grads = [torch.randn(p.shape, device=DEV) for p in base]
    out = {}
    for be in names:
        ps = [p.clone() for p in base]
        ms = [torch.zeros_like(p) for p in base]
        vs = [torch.zeros_like(p) for p in base]
        tk.fused_adamw_(ps, grads, ms, vs, step=2, seed=9, backend=be, **HYPER)
        out[be] = ps + ms + vs
    for be in names[1:]:
        assert all(torch.equal(a, b) for a, b in zip(out[be], out[names[0]])), be


def test_counter_past_two_to_the_32():
    """A stream offset near 2^32 (an element index of a huge shard) crosses the high word correctly."""
    n = 64
    p0 = torch.randn(n, device=DEV).bfloat16()
    g = torch.randn(n, device=DEV)
    out = {}
    for be in [b.values[0] for b in BACKENDS if not b.marks]:
        p, m, v = p0.clone(), torch.zeros(n, device=DEV).bfloat16(), torch.zeros(n, device=DEV).bfloat16()
        fn = tk.backend.kernels("fused_adamw", p.device, be).forward
        fn([p], [g], [m], [v], 1e-2, 0.9, 0.95, 1e-8, 0.0, 1, [12345], [2**32 - 20])
        out[be] = (p, m, v)
    want = torch.tensor([ref.hash32((c & ref.M32) + ref.hash32(12345 ^ (c >> 32))) for c in range(2**32 - 20, 2**32 + 44)])
    got = ref.random_bits(12345, 2**32 - 20, n, torch.device("cpu"))
    assert torch.equal(got, want)
    names = list(out)
    for be in names[1:]:
        assert all(torch.equal(a, b) for a, b in zip(out[be], out[names[0]])), be


def test_one_launch_per_list(monkeypatch):
    """The Triton backend launches one kernel for a list of tensors (of one dtype combination)."""
    if not tk.backend.backend_status("triton", DEV).available:
        pytest.skip("triton unavailable here")
    from titan_kernels.triton import fused_adamw as tri

    launches = []

    class Counting:
        def __init__(self, k):
            self.k = k

        def __getitem__(self, grid):
            launches.append(grid)
            return self.k[grid]

    monkeypatch.setattr(tri, "_adamw_kernel", Counting(tri._adamw_kernel))
    ps = [torch.randn(n, device=DEV) for n in (5, 4097, 1, 300)]
    tk.fused_adamw_(ps, [torch.randn_like(p) for p in ps], [torch.zeros_like(p) for p in ps],
                    [torch.zeros_like(p) for p in ps], step=1, backend="triton", **HYPER)
    assert len(launches) == 1


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the native CPU builds")
@pytest.mark.parametrize("cap", ["default", "avx2", "avx512"])
def test_native_isa_builds_equal_reference(cap):
    if not tk.backend.backend_status("cpu").available:
        pytest.skip("native extension not built")
    from titan_kernels import _C

    try:
        _C.set_cpu_capability(cap)
    except ValueError as e:
        pytest.skip(str(e))
    try:
        for pdt, sdt in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)):
            torch.manual_seed(5)
            base = [torch.randn(n).to(pdt) for n in (3, 33, 20000)]  # 20000: two chunks of the kernel
            grads = [torch.randn(p.shape) for p in base]
            res = {}
            for be in ("reference", "cpu"):
                torch.manual_seed(6)
                ps = [p.clone() for p in base]
                ms = [(0.1 * torch.randn(p.shape)).to(sdt) for p in base]
                vs = [(0.01 * torch.rand(p.shape)).to(sdt) for p in base]
                tk.fused_adamw_(ps, grads, ms, vs, step=3, seed=1, backend=be, **HYPER)
                res[be] = ps + ms + vs
            for a, b in zip(res["cpu"], res["reference"]):
                # float32: equal up to the FMA contraction of the AVX2/AVX512 builds (1-2 ulp); bf16: the
                # same bits except where the float32 value sits within an ulp of a rounding boundary.
                assert rel_err(a, b) < (1e-6 if a.dtype == torch.float32 else 1e-3), (cap, pdt, sdt, rel_err(a, b))
    finally:
        _C.set_cpu_capability("auto")


def test_opcheck():
    ps = [torch.randn(7, 5, device=DEV), torch.randn(3, device=DEV)]
    args = (ps, [torch.randn_like(p) for p in ps], [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps],
            1e-2, 0.9, 0.95, 1e-8, 0.1, 1, [1, 2], [0, 0])
    torch.library.opcheck(torch.ops.titan.fused_adamw_.default, args)


def test_compiles_fullgraph():
    ps = [torch.randn(9, 4, device=DEV), torch.randn(5, device=DEV)]
    gs = [torch.randn_like(p) for p in ps]
    eager = [p.clone() for p in ps]

    def step(ps, ms, vs):
        tk.fused_adamw_(ps, gs, ms, vs, step=2, seed=1, **HYPER)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    compiled(ps, [torch.ones_like(p) for p in ps], [torch.ones_like(p) for p in ps])
    step(eager, [torch.ones_like(p) for p in eager], [torch.ones_like(p) for p in eager])
    assert all(torch.equal(a, b) for a, b in zip(ps, eager))


def test_errors():
    p = [torch.randn(4, 3)]
    z = [torch.zeros(4, 3)]
    cases = [
        (dict(params=p, grads=[torch.randn(3, 4)], exp_avgs=z, exp_avg_sqs=z), ValueError, r"grads\[0\]: expected shape"),
        (dict(params=[p[0].half()], grads=[torch.randn(4, 3).half()], exp_avgs=z, exp_avg_sqs=z), TypeError,
         r"params\[0\]: expected dtype float32 or bfloat16"),
        (dict(params=p, grads=p, exp_avgs=z, exp_avg_sqs=[z[0].bfloat16()]), TypeError, r"exp_avg_sqs\[0\]: expected dtype"),
        (dict(params=p, grads=[], exp_avgs=z, exp_avg_sqs=z), ValueError, "grads: expected 1 tensors"),
        (dict(params=p, grads=[None], exp_avgs=z, exp_avg_sqs=z), TypeError, r"grads\[0\]: expected a torch.Tensor"),
        (dict(params=p, grads=p, exp_avgs=z, exp_avg_sqs=z, beta1=1.0), ValueError, "beta1"),
        (dict(params=p, grads=p, exp_avgs=z, exp_avg_sqs=z, eps=0.0), ValueError, "eps"),
        (dict(params=p, grads=p, exp_avgs=z, exp_avg_sqs=z, lr=-1.0), ValueError, "lr"),
        (dict(params=p, grads=p, exp_avgs=z, exp_avg_sqs=z, step=0), ValueError, "step"),
        (dict(params=p, grads=p, exp_avgs=z, exp_avg_sqs=z, param_keys=[1, 2]), ValueError, "param_keys"),
    ]
    for kw, exc, msg in cases:
        kw = {"lr": 1e-3, "step": 1, **kw}
        with pytest.raises(exc, match=msg):
            tk.fused_adamw_(kw.pop("params"), kw.pop("grads"), kw.pop("exp_avgs"), kw.pop("exp_avg_sqs"), **kw)
    leaf = [torch.randn(3, requires_grad=True)]
    with pytest.raises(RuntimeError, match="no_grad"):
        tk.fused_adamw_(leaf, [torch.randn(3)], [torch.zeros(3)], [torch.zeros(3)], lr=1e-3, step=1)


# ------------------------------------------------------------------------------------------ DTensor shards


def _dtensor_case(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    full = [torch.randn(37, 5).bfloat16(), torch.randn(6, 9)]  # uneven rows; a column split
    grads = [torch.randn(t.shape) for t in full]
    placements = [[Shard(0)], [Shard(1)]]
    dts = [distribute_tensor(t.clone(), mesh, pl) for t, pl in zip(full, placements)]
    dg = [distribute_tensor(g, mesh, pl) for g, pl in zip(grads, placements)]
    dm = [distribute_tensor(torch.zeros(t.shape, dtype=torch.bfloat16), mesh, pl) for t, pl in zip(full, placements)]
    dv = [distribute_tensor(torch.zeros(t.shape, dtype=torch.bfloat16), mesh, pl) for t, pl in zip(full, placements)]
    with CommDebugMode() as comm:
        tk.fused_adamw_(dts, dg, dm, dv, step=1, seed=4, param_keys=[10, 11], **HYPER)
    assert comm.get_total_counts() == 0  # no communication: local shards only
    one = [t.clone() for t in full]
    m1 = [torch.zeros(t.shape, dtype=torch.bfloat16) for t in full]
    v1 = [torch.zeros(t.shape, dtype=torch.bfloat16) for t in full]
    tk.fused_adamw_(one, grads, m1, v1, step=1, seed=4, param_keys=[10, 11], **HYPER)
    # Row shards use the global element counter: the same bits as one process. The column split
    # (another stream per shard) is equal to bf16 rounding.
    assert torch.equal(dts[0].full_tensor(), one[0]) and torch.equal(dm[0].full_tensor(), m1[0])
    assert rel_err(dts[1].full_tensor(), one[1]) < 1e-6
    assert rel_err(dm[1].full_tensor(), m1[1].double()) < 1e-2


def test_dtensor_shards_update_locally():
    from tests.distributed.launcher import run_distributed

    run_distributed(_dtensor_case, 2)


def _lists(n=2):
    return ([torch.randn(4, 3) for _ in range(n)], [torch.randn(4, 3) for _ in range(n)],
            [torch.zeros(4, 3) for _ in range(n)], [torch.zeros(4, 3) for _ in range(n)])


def _aliasing_cases():
    """(name, lists, the error's start): each computed wrong before (a silent answer), refused now."""
    ps, gs, ms, vs = _lists()
    x = torch.zeros(4, 6)
    flat = torch.zeros(24)
    return [
        ("states are one tensor", (ps, gs, ms, [vs[0], ms[1]]), r"exp_avgs\[1\] and exp_avg_sqs\[1\]: the same tensor"),
        ("grad is its param", (ps, [gs[0], ps[1]], ms, vs), r"params\[1\] and grads\[1\]: the same tensor"),
        ("a param twice", ([ps[0], ps[0]], gs, ms, vs), r"params\[0\] and params\[1\]: the same tensor"),
        ("state overlaps another param", ([flat[:12].view(4, 3), ps[1]], gs, [ms[0], flat[6:18].view(4, 3)], vs),
         r"params\[0\] and exp_avgs\[1\]: overlapping memory"),
        ("views overlap", ([flat[:12].view(4, 3), flat[9:21].view(4, 3)], gs, ms, vs),
         r"params\[0\] and params\[1\]: overlapping memory"),
        ("interleaved and overlapping", (ps, gs, [x[:, 0:3], ms[1]], [x[:, 2:5], vs[1]]),
         r"exp_avgs\[0\] and exp_avg_sqs\[0\]: overlapping memory"),
        ("an expanded state", (ps, gs, [torch.zeros(3).expand(4, 3), ms[1]], vs),
         r"exp_avgs\[0\]: several of its elements share one memory location"),
    ]


@pytest.mark.parametrize("case", range(7), ids=[c[0] for c in _aliasing_cases()])
def test_aliasing_is_refused(case):
    name, lists, msg = _aliasing_cases()[case]
    before = [[t.clone() for t in lst] for lst in lists]
    with pytest.raises(ValueError, match=msg):
        tk.fused_adamw_(*lists, lr=1e-3, step=1)
    assert all(torch.equal(a, b) for la, lb in zip(lists, before) for a, b in zip(la, lb))  # nothing written


def test_what_may_share_memory():
    # Gradients are only read: views of one flat buffer, or one tensor twice, are fine; so are
    # interleaved states that touch no common byte, and empty tensors.
    ps, _, ms, vs = _lists(3)
    flat = torch.randn(36)
    gs = list(flat.view(3, 4, 3).unbind(0))
    x = torch.zeros(4, 6)
    ms[0], vs[0] = x[:, 0::2], x[:, 1::2]
    e = torch.zeros(0)
    ref = [[t.clone() for t in lst] for lst in (ps, gs, ms, vs)]
    tk.fused_adamw_(ps + [e], gs + [e], ms + [e], vs + [e], lr=1e-2, step=1)
    tk.fused_adamw_(*ref, lr=1e-2, step=1, param_keys=[0, 1, 2])
    assert all(torch.equal(a, b) for a, b in zip(ps + ms + vs, ref[0] + ref[2] + ref[3]))
    tk.fused_adamw_(ps[:2], [gs[0], gs[0]], ms[:2], vs[:2], lr=1e-2, step=2)


@pytest.mark.parametrize("keys,exc,msg", [
    (5, TypeError, r"^param_keys: expected None or a list of 2 ints \(one per parameter\), got int$"),
    ("ab", TypeError, r"^param_keys: expected None or a list of 2 ints"),
    ([1, 2.5], TypeError, r"^param_keys\[1\]: expected an int, got 2.5 \(float\)$"),
    ([1, "a"], TypeError, r"^param_keys\[1\]: expected an int, got 'a' \(str\)$"),
    ([True, 1], TypeError, r"^param_keys\[0\]: expected an int, got True \(bool\)$"),
    ([1], ValueError, r"^param_keys: expected 2 integers"),
])
def test_param_keys_of_the_wrong_type(keys, exc, msg):
    with pytest.raises(exc, match=msg):
        tk.fused_adamw_(*_lists(), lr=1e-3, step=1, param_keys=keys)
    with pytest.raises(TypeError, match=r"^seed: expected an int, got 1.5"):
        tk.fused_adamw_(*_lists(), lr=1e-3, step=1, seed=1.5)


def test_numpy_scalars_are_numbers():
    import numpy as np

    a, b = _lists(), _lists()
    for x, y in zip(a, b):
        for s, t in zip(x, y):
            t.copy_(s)
    tk.fused_adamw_(*a, lr=np.float32(1e-3), beta1=np.float64(0.9), step=np.int64(3), param_keys=[np.int64(1), 2])
    tk.fused_adamw_(*b, lr=float(np.float32(1e-3)), beta1=0.9, step=3, param_keys=[1, 2])
    assert all(torch.equal(s, t) for x, y in zip(a, b) for s, t in zip(x, y))
