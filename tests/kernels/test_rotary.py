"""Rotary embedding: every backend that runs on the test device against float64 formulas, gradients, tables,
opcheck, torch.compile, errors and the RotaryEmbedding module.

The float64 formulas are written independently of the code under test: a complex multiplication
for the interleaved (Meta) layout and rotate-half for the Hugging Face layout. Triton kernels run
on CPU tensors under TRITON_INTERPRET=1 (set in tests/conftest.py), so shapes stay small; with
TITAN_TEST_DEVICE=cuda the same tests run on a GPU.
"""
from __future__ import annotations

import math

import pytest
import torch

import titan_kernels as tk
from titan_kernels import backend
from titan_kernels.nn import RotaryEmbedding
from titan_kernels.reference import rotary as ref
from tests.conftest import TEST_DEVICE
from tests.kernels.helpers import TOL, backends_here, llama31_scaled_freqs64, rel_err

DEV = torch.device(TEST_DEVICE)

LLAMA31 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)

BACKENDS = backends_here("rotary")


def randn(*shape, dtype=torch.float32):
    return (torch.randn(*shape, dtype=torch.float64) + 0.1).to(dtype).to(DEV)


def ids(data, dtype=torch.int64) -> torch.Tensor:
    return torch.tensor(data, dtype=dtype, device=DEV)


def tables(max_positions: int, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random angles (not a RoPE frequency ladder), so every pair gets a distinct rotation."""
    ang = torch.rand(max_positions, half, dtype=torch.float64, device=DEV) * 2 * math.pi
    return ang.cos().float(), ang.sin().float()


def f64_rope(x, cos, sin, position_ids, interleaved):
    """Float64 formula. x (B, S, H, D); cos/sin (P, R); position_ids None, (S,) or (B, S)."""
    batch, seq, _, head_dim = x.shape
    half = cos.shape[1]
    rd = 2 * half
    pos = torch.arange(seq, device=x.device) if position_ids is None else position_ids.long()
    c = cos.double()[pos]  # (S, R) or (B, S, R)
    s = sin.double()[pos]
    if c.dim() == 2:
        c, s = c.expand(batch, seq, half), s.expand(batch, seq, half)
    c, s = c[:, :, None, :], s[:, :, None, :]
    x64 = x.double()
    xr, rest = x64[..., :rd], x64[..., rd:]
    if interleaved:
        z = torch.view_as_complex(xr.reshape(*xr.shape[:-1], half, 2).contiguous())
        out = torch.view_as_real(z * torch.complex(c, s)).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        rotate_half = torch.cat((-x2, x1), -1)
        out = xr * torch.cat((c, c), -1) + rotate_half * torch.cat((s, s), -1)
    return torch.cat((out, rest), -1)


def run(be, q, k, cos, sin, **kw):
    with tk.use_backend(be):
        return tk.apply_rotary_emb(q, k, cos, sin, **kw)


def check(q, k, cos, sin, qo, ko, position_ids, interleaved, tol):
    assert qo.shape == q.shape and ko.shape == k.shape
    assert qo.dtype == q.dtype and ko.dtype == k.dtype
    assert qo.is_contiguous() and ko.is_contiguous()
    assert rel_err(qo, f64_rope(q, cos, sin, position_ids, interleaved)) < tol
    assert rel_err(ko, f64_rope(k, cos, sin, position_ids, interleaved)) < tol


# --------------------------------------------------------------------------- forward


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("interleaved", [True, False], ids=["meta", "hf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("positions", ["none", "1d", "2d"])
def test_forward_matches_float64(be, interleaved, dtype, positions):
    # Awkward sizes: odd batch/seq, 6 q heads over 2 kv heads, head_dim 24 (12 pairs).
    batch, seq, n_heads, n_kv_heads, head_dim, max_pos = 3, 7, 6, 2, 24, 19
    q, k = randn(batch, seq, n_heads, head_dim, dtype=dtype), randn(batch, seq, n_kv_heads, head_dim, dtype=dtype)
    cos, sin = tables(max_pos, head_dim // 2)
    pos = {
        "none": None,
        "1d": torch.randperm(max_pos, device=DEV)[:seq],
        "2d": torch.randint(0, max_pos, (batch, seq), device=DEV),
    }[positions]
    qo, ko = run(be, q, k, cos, sin, interleaved=interleaved, position_ids=pos)
    check(q, k, cos, sin, qo, ko, pos, interleaved, TOL[dtype])


@pytest.mark.parametrize("be", BACKENDS)
def test_rows_of_one_batch_use_their_own_positions(be):
    # Packed documents: each row restarts at its own offsets; equal tokens at equal positions
    # must give equal outputs, whatever row they sit in (Liger PR 477 ignored per-row positions).
    cos, sin = tables(32, 8)
    pos = ids([[0, 1, 2, 0, 1, 2], [5, 6, 7, 8, 9, 10], [31, 0, 30, 1, 29, 2]], torch.int32)
    q = randn(3, 6, 4, 16)
    k = randn(3, 6, 2, 16)
    q[0, 3:] = q[0, :3]  # row 0 holds two documents with equal tokens at positions 0, 1, 2
    q[1] = q[0]
    for interleaved in (True, False):
        qo, ko = run(be, q, k, cos, sin, interleaved=interleaved, position_ids=pos)
        check(q, k, cos, sin, qo, ko, pos, interleaved, 1e-5)
        assert torch.equal(qo[0, :3], qo[0, 3:])
        # Row 1 holds the same q as row 0 but other positions: the outputs must differ.
        assert not torch.allclose(qo[1], qo[0])
        # Each row alone gives the same result as inside the batch.
        for b in range(3):
            qb, kb = run(be, q[b : b + 1], k[b : b + 1], cos, sin, interleaved=interleaved, position_ids=pos[b])
            assert torch.equal(qb[0], qo[b]) and torch.equal(kb[0], ko[b])


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("interleaved", [True, False], ids=["meta", "hf"])
def test_mqa_and_seq_one_leave_inputs_unmodified(be, interleaved):
    # One kv head (Liger #342) and a single token (decode step at an offset).
    cos, sin = tables(50, 5)
    for seq, pos in ((1, ids([37])), (9, None)):
        q, k = randn(2, seq, 7, 10), randn(2, seq, 1, 10)
        q0, k0 = q.clone(), k.clone()
        qo, ko = run(be, q, k, cos, sin, interleaved=interleaved, position_ids=pos)
        assert torch.equal(q, q0) and torch.equal(k, k0)
        assert qo.data_ptr() != q.data_ptr() and ko.data_ptr() != k.data_ptr()
        check(q, k, cos, sin, qo, ko, pos, interleaved, 1e-5)


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("interleaved", [True, False], ids=["meta", "hf"])
@pytest.mark.parametrize("rotary_dim", [2, 12, 18])
def test_partial_rotary_dim_passes_the_rest_through(be, interleaved, rotary_dim):
    q, k = randn(2, 5, 3, 20, dtype=torch.bfloat16), randn(2, 5, 3, 20, dtype=torch.bfloat16)
    cos, sin = tables(8, rotary_dim // 2)
    qo, ko = run(be, q, k, cos, sin, interleaved=interleaved)
    assert torch.equal(qo[..., rotary_dim:], q[..., rotary_dim:])
    assert torch.equal(ko[..., rotary_dim:], k[..., rotary_dim:])
    check(q, k, cos, sin, qo, ko, None, interleaved, TOL[torch.bfloat16])


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("interleaved", [True, False], ids=["meta", "hf"])
def test_strided_inputs(be, interleaved):
    batch, seq, n_heads, n_kv_heads, head_dim = 2, 5, 4, 2, 12
    cos, sin = tables(16, 6)
    pos = torch.randint(0, 16, (batch, seq), device=DEV)
    # Slices of a fused qkv projection: token stride (n_heads + 2 n_kv_heads) * head_dim.
    qkv = randn(batch, seq, (n_heads + 2 * n_kv_heads) * head_dim)
    q = qkv[..., : n_heads * head_dim].view(batch, seq, n_heads, head_dim)
    k = qkv[..., n_heads * head_dim : (n_heads + n_kv_heads) * head_dim].view(batch, seq, n_kv_heads, head_dim)
    qkv0 = qkv.clone()
    qo, ko = run(be, q, k, cos, sin, interleaved=interleaved, position_ids=pos)
    check(q, k, cos, sin, qo, ko, pos, interleaved, 1e-5)
    assert torch.equal(qkv, qkv0)
    # (batch, heads, seq, head_dim) memory seen through a transpose; strided cos/sin and positions.
    qt = randn(batch, n_heads, seq, head_dim).transpose(1, 2)
    kt = randn(batch, n_kv_heads, seq, head_dim).transpose(1, 2)
    wide = randn(16, 12)
    cos_s, sin_s = wide[:, ::2], wide[:, 1::2]  # column stride 2
    pos_t = torch.randint(0, 16, (seq, batch), device=DEV).t()
    qo, ko = run(be, qt, kt, cos_s, sin_s, interleaved=interleaved, position_ids=pos_t)
    check(qt, kt, cos_s, sin_s, qo, ko, pos_t, interleaved, 1e-5)
    # A broadcast (stride-0) k, e.g. one kv head expanded for every batch row.
    kb = randn(1, seq, n_kv_heads, head_dim).expand(batch, -1, -1, -1)
    qo, ko = run(be, qt, kb, cos, sin, interleaved=interleaved)
    check(qt, kb, cos, sin, qo, ko, None, interleaved, 1e-5)


@pytest.mark.parametrize("be", BACKENDS)
def test_zero_size(be):
    cos, sin = tables(8, 4)
    for shape_q, shape_k, pos in (
        ((0, 3, 4, 8), (0, 3, 2, 8), None),
        ((2, 0, 4, 8), (2, 0, 2, 8), None),
        ((2, 0, 4, 8), (2, 0, 2, 8), ids([[], []])),
    ):
        q = torch.randn(shape_q, device=DEV, requires_grad=True)
        k = torch.randn(shape_k, device=DEV, requires_grad=True)
        qo, ko = run(be, q, k, cos, sin, position_ids=pos)
        assert qo.shape == shape_q and ko.shape == shape_k
        with tk.use_backend(be):
            dq, dk = torch.autograd.grad((qo.sum() + ko.sum()), (q, k))
        assert dq.shape == shape_q and dk.shape == shape_k


@pytest.mark.parametrize("be", BACKENDS)
def test_layouts_are_a_permutation_of_each_other(be):
    # The Meta layout on x equals the HF layout on x with its pairs regrouped (the wq/wk row
    # permutation used when converting checkpoints).
    q, k = randn(2, 6, 3, 16), randn(2, 6, 1, 16)
    cos, sin = tables(6, 8)
    # perm[j]: the Meta-layout index of Hugging Face slot j.
    perm = torch.cat((torch.arange(0, 16, 2, device=DEV), torch.arange(1, 16, 2, device=DEV)))
    qm, km = run(be, q, k, cos, sin, interleaved=True)
    qh, kh = run(be, q[..., perm], k[..., perm], cos, sin, interleaved=False)
    torch.testing.assert_close(qh, qm[..., perm], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kh, km[..., perm], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("be", BACKENDS)
def test_wide_heads_loop_over_blocks(be):
    # More pairs and heads than one Triton block (MAX_BLOCK_R, MAX_BLOCK_H): the in-kernel loops run.
    from titan_kernels.triton.rotary import MAX_BLOCK_H, MAX_BLOCK_R

    head_dim = 2 * MAX_BLOCK_R + 2 * 3 + 10  # 3 pairs past one block, 10 pass-through dims
    q, k = randn(1, 3, 2 * (MAX_BLOCK_H + 1), head_dim), randn(1, 3, MAX_BLOCK_H + 1, head_dim)
    cos, sin = tables(5, MAX_BLOCK_R + 3)
    for interleaved in (True, False):
        qo, ko = run(be, q, k, cos, sin, interleaved=interleaved, position_ids=ids([4, 0, 2]))
        check(q, k, cos, sin, qo, ko, ids([4, 0, 2]), interleaved, 1e-5)


# --------------------------------------------------------------------------- positions out of range


def test_out_of_range_positions_raise_in_eager():
    q, k = randn(2, 4, 2, 8), randn(2, 4, 1, 8)
    cos, sin = tables(10, 4)
    for bad in (ids([0, 1, 10, 2]), ids([[0, 1, 2, 3], [-1, 0, 0, 0]])):
        for be in ("reference", "triton"):  # the check runs before any backend
            with pytest.raises(ValueError, match=r"position_ids: expected values in \[0, 10\)"):
                run(be, q, k, cos, sin, position_ids=bad)
    with pytest.raises(ValueError, match="seq = 4"):
        tk.apply_rotary_emb(q, k, cos[:3], sin[:3])


@pytest.mark.parametrize("be", BACKENDS)
def test_kernels_never_read_out_of_range_rows(be):
    # Where no check can run (torch.compile), an out-of-range position yields NaN in its rotated
    # dims: the kernels mask the table read instead of reading past the end.
    q, k = randn(1, 4, 2, 10), randn(1, 4, 1, 10)
    cos, sin = tables(6, 4)
    pos = ids([[0, 6, -3, 5]])
    fwd, bwd = backend.kernels("rotary", DEV, be)
    for fn in (fwd, bwd):
        qo, ko = fn(q, k, cos, sin, pos, True)
        for out, x in ((qo, q), (ko, k)):
            assert out[0, [1, 2], :, :8].isnan().all()
            assert not out[0, [0, 3]].isnan().any()
            assert torch.equal(out[..., 8:], x[..., 8:])


# --------------------------------------------------------------------------- gradients


class _RefFn(torch.autograd.Function):
    """The reference forward/backward pair, so gradcheck tests the reference's analytic backward."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, pos, interleaved):
        ctx.save_for_backward(cos, sin, pos)
        ctx.interleaved = interleaved
        return ref.rotary_fwd(q, k, cos, sin, pos, interleaved)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin, pos = ctx.saved_tensors
        return (*ref.rotary_bwd(dq, dk, cos, sin, pos, ctx.interleaved), None, None, None, None)


@pytest.mark.parametrize("interleaved", [True, False], ids=["meta", "hf"])
def test_reference_backward_gradcheck_float64(interleaved):
    q = randn(2, 3, 2, 10, dtype=torch.float64).requires_grad_()
    k = randn(2, 3, 1, 10, dtype=torch.float64).requires_grad_()
    ang = torch.rand(7, 4, dtype=torch.float64, device=DEV) * 6
    pos = ids([[6, 0, 3], [1, 1, 5]])
    assert torch.autograd.gradcheck(
        lambda a, b: _RefFn.apply(a, b, ang.cos(), ang.sin(), pos, interleaved), (q, k)
    )


def test_op_autograd_gradcheck_and_gradgradcheck_float64():
    # The registered autograd of titan::rotary and titan::rotary_backward (double backward), on the
    # reference backend, which keeps float64 inputs in float64.
    q = randn(2, 3, 4, 6, dtype=torch.float64).requires_grad_()
    k = randn(2, 3, 2, 6, dtype=torch.float64).requires_grad_()
    ang = torch.rand(5, 2, dtype=torch.float64, device=DEV) * 6
    pos = ids([4, 0, 2])
    with tk.use_backend("reference"):
        f = lambda a, b: torch.ops.titan.rotary(a, b, ang.cos(), ang.sin(), pos, False)  # noqa: E731
        assert torch.autograd.gradcheck(f, (q, k))
        assert torch.autograd.gradgradcheck(f, (q, k))


def _f64_grads(q, k, cos, sin, pos, interleaved, gq, gk):
    q64, k64 = (t.detach().double().requires_grad_() for t in (q, k))
    qo, ko = _RefFn.apply(q64, k64, cos.double(), sin.double(), pos, interleaved)
    return torch.autograd.grad((qo, ko), (q64, k64), (gq.double(), gk.double()))


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("interleaved", [True, False], ids=["meta", "hf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_matches_float64(be, interleaved, dtype):
    q = randn(3, 5, 4, 14, dtype=dtype).requires_grad_()
    k = randn(3, 5, 2, 14, dtype=dtype).requires_grad_()
    cos, sin = tables(9, 6)  # rotary_dim 12 < head_dim 14
    pos = torch.randint(0, 9, (3, 5), device=DEV)
    gq = randn(3, 5, 4, 14, dtype=dtype).transpose(0, 1).contiguous().transpose(0, 1)  # non-contiguous grad
    gk = randn(3, 5, 2, 14, dtype=dtype)
    with tk.use_backend(be):
        qo, ko = tk.apply_rotary_emb(q, k, cos, sin, interleaved=interleaved, position_ids=pos)
        dq, dk = torch.autograd.grad((qo, ko), (q, k), (gq, gk))
        # The dispatcher path (what torch.compile and DTensor see) gives the same gradients.
        qo2, ko2 = torch.ops.titan.rotary(q, k, cos, sin, pos, interleaved)
        dq2, dk2 = torch.autograd.grad((qo2, ko2), (q, k), (gq, gk))
    dq64, dk64 = _f64_grads(q, k, cos, sin, pos, interleaved, gq, gk)
    assert dq.dtype == dtype and dk.dtype == dtype
    assert rel_err(dq, dq64) < TOL[dtype] and rel_err(dk, dk64) < TOL[dtype]
    assert torch.equal(qo, qo2) and torch.equal(ko, ko2)
    assert torch.equal(dq, dq2) and torch.equal(dk, dk2)


@pytest.mark.parametrize("be", BACKENDS)
def test_backward_when_only_one_output_is_used(be):
    q, k = randn(2, 3, 2, 8).requires_grad_(), randn(2, 3, 2, 8).requires_grad_()
    cos, sin = tables(3, 4)
    with tk.use_backend(be):
        for call in (
            lambda: tk.apply_rotary_emb(q, k, cos, sin),
            lambda: torch.ops.titan.rotary(q, k, cos, sin, None, False),
        ):
            qo, _ = call()
            dq, dk = torch.autograd.grad(qo.square().sum(), (q, k), allow_unused=True)
            dq64, _ = _f64_grads(q, k, cos, sin, None, False, 2 * qo.detach(), torch.zeros_like(k))
            assert rel_err(dq, dq64) < 1e-5
            assert dk is None or not dk.any()
        # k frozen: only q's gradient is asked for.
        qo, ko = tk.apply_rotary_emb(q, k.detach(), cos, sin)
        (dq,) = torch.autograd.grad(qo.sum() + ko.sum(), (q,))
        assert dq.shape == q.shape


# --------------------------------------------------------------------------- tables


def f64_llama_freqs(rotary_dim: int, theta: float, scaling: dict | None) -> list[float]:
    """Inverse frequencies, then Llama 3.1 ``apply_scaling`` as a per-frequency Python loop."""
    freqs = [1.0 / theta ** (i / rotary_dim) for i in range(0, rotary_dim, 2)]
    return freqs if scaling is None else llama31_scaled_freqs64(freqs, scaling)


# Llama 4 Scout: equal low and high factors, no blended band.
@pytest.mark.parametrize("scaling", [None, LLAMA31, dict(LLAMA31, factor=16.0, high_freq_factor=1.0)],
                         ids=["plain", "llama3.1", "llama4-scout"])
@pytest.mark.parametrize("head_dim,rotary_dim,theta", [(128, None, 500000.0), (64, 40, 10000.0)])
def test_rope_cos_sin_matches_float64(scaling, head_dim, rotary_dim, theta):
    max_pos = 131072  # Llama 3.1 context: large angles, where float32 angle math would drift
    cos, sin = tk.rope_cos_sin(head_dim, max_pos, theta, scaling, rotary_dim=rotary_dim, device=DEV)
    cos, sin = cos.cpu(), sin.cpu()
    rd = rotary_dim or head_dim
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == sin.shape == (max_pos, rd // 2)
    freqs = torch.tensor(f64_llama_freqs(rd, theta, scaling), dtype=torch.float64)
    rows = torch.cat((torch.arange(64), torch.randint(0, max_pos, (200,)), torch.tensor([max_pos - 1])))
    ang = rows.double()[:, None] * freqs
    assert rel_err(cos[rows], ang.cos()) < 1e-6 and rel_err(sin[rows], ang.sin()) < 1e-6
    # Elementwise: no row far off (float32 angles would be ~1e-2 off at position 1e5).
    assert (cos[rows].double() - ang.cos()).abs().max() < 1e-6


def test_llama31_scaling_changes_only_low_frequencies():
    plain = torch.tensor(f64_llama_freqs(128, 500000.0, None))
    scaled = torch.tensor(f64_llama_freqs(128, 500000.0, LLAMA31))
    cos_p, _ = tk.rope_cos_sin(128, 2, 500000.0)
    cos_s, _ = tk.rope_cos_sin(128, 2, 500000.0, LLAMA31)
    # Row 1 holds cos(freq): high frequencies kept, the lowest divided by 8.
    keep = 2 * math.pi / plain < 8192 / 4
    assert keep.any() and (~keep).any()
    assert torch.equal(cos_s[1][keep], cos_p[1][keep])
    assert not torch.equal(cos_s[1][~keep], cos_p[1][~keep])
    torch.testing.assert_close(scaled[-1], plain[-1] / 8, rtol=1e-12, atol=0)
    # A Hugging Face rope_scaling dict gives the same tables.
    hf = dict(LLAMA31, rope_type="llama3")
    assert torch.equal(tk.rope_cos_sin(128, 2, 500000.0, hf)[0], cos_s)


def test_rope_cos_sin_errors():
    with pytest.raises(ValueError, match="rotary_dim"):
        tk.rope_cos_sin(16, 8, rotary_dim=7)
    with pytest.raises(ValueError, match="rotary_dim"):
        tk.rope_cos_sin(15, 8)
    with pytest.raises(ValueError, match="rotary_dim"):
        tk.rope_cos_sin(16, 8, rotary_dim=18)
    with pytest.raises(ValueError, match="head_dim"):
        tk.rope_cos_sin(0, 8)
    with pytest.raises(TypeError, match="head_dim"):
        tk.rope_cos_sin(16.0, 8)
    with pytest.raises(ValueError, match="max_positions"):
        tk.rope_cos_sin(16, -1)
    for theta in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="theta"):
            tk.rope_cos_sin(16, 8, theta)
    with pytest.raises(ValueError, match="scaling"):
        tk.rope_cos_sin(16, 8, scaling=dict(factor=8.0))
    with pytest.raises(ValueError, match="scaling"):
        tk.rope_cos_sin(16, 8, scaling=dict(LLAMA31, beta=1.0))
    with pytest.raises(ValueError, match="high_freq_factor >= low_freq_factor"):
        tk.rope_cos_sin(16, 8, scaling=dict(LLAMA31, high_freq_factor=0.5))
    with pytest.raises(ValueError, match=r"scaling\['factor'\]"):
        tk.rope_cos_sin(16, 8, scaling=dict(LLAMA31, factor=0.0))
    with pytest.raises(ValueError, match="YaRN takes keys .* got unknown .'high_freq_factor'"):
        tk.rope_cos_sin(16, 8, scaling=dict(LLAMA31, rope_type="yarn"))
    with pytest.raises(ValueError, match="rope_type 'dynamic' is not implemented"):
        tk.rope_cos_sin(16, 8, scaling=dict(LLAMA31, rope_type="dynamic"))
    with pytest.raises(ValueError, match="missing .'original_max_position_embeddings'"):
        tk.rope_cos_sin(16, 8, scaling=dict(rope_type="yarn", factor=4.0))
    with pytest.raises(TypeError, match="scaling"):
        tk.rope_cos_sin(16, 8, scaling=8.0)


@pytest.mark.parametrize("params", [
    dict(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
         mscale_all_dim=1.0),  # DeepSeek-V3
    dict(factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, truncate=False),  # GPT-OSS
    dict(factor=4.0, original_max_position_embeddings=64, mscale=0.707, mscale_all_dim=0.707),  # V2-Lite style
], ids=["deepseek-v3", "gpt-oss", "mscale"])
def test_yarn_tables_match_transformers(params):
    transformers = pytest.importorskip("transformers", reason="the YaRN reference is transformers' implementation")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_dim, theta = 64, 150000.0
    cfg = transformers.PretrainedConfig(hidden_size=head_dim, num_attention_heads=1, head_dim=head_dim,
                                         max_position_embeddings=1 << 17,
                                         rope_parameters={"rope_type": "yarn", "rope_theta": theta, **params})
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    pos = torch.arange(300, dtype=torch.float64)
    want_cos = torch.outer(pos, inv_freq.double()).cos() * factor
    cos, sin = tk.rope_cos_sin(head_dim, 300, theta, {"rope_type": "yarn", **params})
    # transformers' inverse frequencies are float32: the angles agree to ~1e-7 relative
    assert (cos.double() - want_cos).abs().max() < 3e-5
    assert sin.abs().max() <= factor * (1 + 1e-6)


# --------------------------------------------------------------------------- op contract


@pytest.mark.parametrize("be", BACKENDS)
def test_opcheck(be):
    cos, sin = tables(11, 5)
    q = randn(2, 3, 4, 12).requires_grad_()
    k = randn(2, 3, 2, 12).requires_grad_()
    qt = randn(2, 4, 3, 12).transpose(1, 2)  # non-contiguous q
    cases = [
        (q, k, cos, sin, None, True),
        (q, k, cos, sin, ids([10, 0, 5]), False),
        (qt, k.detach(), cos, sin, torch.randint(0, 11, (2, 3), dtype=torch.int32, device=DEV), True),
    ]
    with tk.use_backend(be):
        for args in cases:
            torch.library.opcheck(torch.ops.titan.rotary.default, args)
            torch.library.opcheck(torch.ops.titan.rotary_backward.default, args)


@pytest.mark.parametrize("be", BACKENDS)
def test_compile_fullgraph_matches_eager(be):
    cos, sin = tk.rope_cos_sin(16, 32, scaling=LLAMA31, device=DEV)
    q = randn(2, 5, 4, 16).requires_grad_()
    k = randn(2, 5, 2, 16).requires_grad_()
    pos = torch.randint(0, 32, (2, 5), device=DEV)

    def f(q, k, pos):
        qo, ko = tk.apply_rotary_emb(q * 2, k, cos, sin, interleaved=True, position_ids=pos)
        q2, k2 = tk.apply_rotary_emb(qo, ko, cos, sin, interleaved=False)
        return (q2 * k2.repeat_interleave(2, dim=2)).sum(-1)

    with tk.use_backend(be):
        eager = f(q, k, pos)
        g_eager = torch.autograd.grad(eager.sum(), (q, k))
        torch._dynamo.reset()
        cf = torch.compile(f, fullgraph=True, backend="aot_eager")
        compiled = cf(q, k, pos)
        g_comp = torch.autograd.grad(compiled.sum(), (q, k))
        # Out-of-range positions inside a compiled graph: no check runs, nothing is read out of
        # bounds, and the rotated dims of those tokens come out NaN.
        bad = cf(q.detach(), k.detach(), ids([[0, 1, 2, 3, 4], [0, 99, 2, 3, 4]]))
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    for a, b in zip(g_comp, g_eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert bad[1, 1].isnan().all() and not bad[0].isnan().any()


# --------------------------------------------------------------------------- errors


def test_bad_input_errors():
    q, k = randn(2, 4, 6, 8), randn(2, 4, 2, 8)
    cos, sin = tables(10, 4)
    cases = [
        (TypeError, "q", dict(q=q.to(torch.int32))),
        (TypeError, "q", dict(q=q.double(), k=k.double())),
        (ValueError, "q", dict(q=q[0])),
        (ValueError, "k", dict(k=k[0])),
        (TypeError, "k", dict(k=k.bfloat16())),
        (ValueError, "k: expected batch", dict(k=randn(3, 4, 2, 8))),
        (ValueError, "k: expected seq", dict(k=randn(2, 5, 2, 8))),
        (ValueError, "k: expected head_dim", dict(k=randn(2, 4, 2, 10))),
        (ValueError, "n_kv_heads", dict(k=randn(2, 4, 4, 8))),
        (ValueError, "n_kv_heads", dict(k=randn(2, 4, 0, 8))),
        (TypeError, "cos", dict(cos=cos.bfloat16())),
        (ValueError, "cos", dict(cos=cos[:, :, None])),
        (ValueError, "cos", dict(cos=tables(10, 5)[0], sin=tables(10, 5)[1])),  # rotary_dim 10 > head_dim 8
        (ValueError, "sin", dict(sin=sin[:, :3])),
        (ValueError, "cos", dict(cos=cos.clone().requires_grad_())),
        (ValueError, "device", dict(sin=sin.to("meta"))),
        (TypeError, "position_ids", dict(position_ids=torch.zeros(4, device=DEV))),
        (ValueError, "position_ids", dict(position_ids=ids([0] * 5))),
        (ValueError, "position_ids", dict(position_ids=ids([[0] * 4] * 3))),
        (ValueError, "position_ids", dict(position_ids=ids([[[0] * 4] * 2]))),
        (TypeError, "interleaved", dict(interleaved=1)),
    ]
    for exc, match, kw in cases:
        args = dict(q=q, k=k, cos=cos, sin=sin)
        args.update(kw)
        opts = {key: args.pop(key) for key in ("interleaved", "position_ids") if key in args}
        with pytest.raises(exc, match=match):
            tk.apply_rotary_emb(args["q"], args["k"], args["cos"], args["sin"], **opts)


# --------------------------------------------------------------------------- module


def test_rotary_embedding_module():
    mod = RotaryEmbedding(16, 64, theta=10000.0, scaling=LLAMA31, interleaved=False, device=DEV)
    cos, sin = tk.rope_cos_sin(16, 64, 10000.0, LLAMA31, device=DEV)
    assert torch.equal(mod.cos, cos) and torch.equal(mod.sin, sin)
    assert "cos" not in mod.state_dict() and "sin" not in mod.state_dict()
    q, k = randn(2, 5, 4, 16), randn(2, 5, 2, 16)
    pos = torch.randint(0, 64, (2, 5), device=DEV)
    qo, ko = mod(q, k, pos)
    qr, kr = tk.apply_rotary_emb(q, k, cos, sin, position_ids=pos)
    assert torch.equal(qo, qr) and torch.equal(ko, kr)
    assert "interleaved=False" in repr(mod)
    # Default layout is Meta's (interleaved), as the trainer's checkpoints.
    assert RotaryEmbedding(8, 4).interleaved is True
    with pytest.raises(ValueError, match="rotary_dim"):
        RotaryEmbedding(16, 8, rotary_dim=5)


def test_rotary_embedding_meta_init_then_to_empty():
    with torch.device("meta"):
        mod = RotaryEmbedding(32, 128, scaling=LLAMA31, rotary_dim=24)
    assert mod.cos.is_meta
    mod.to_empty(device=DEV)
    mod.reset_parameters()
    cos, sin = tk.rope_cos_sin(32, 128, scaling=LLAMA31, rotary_dim=24, device=DEV)
    assert torch.equal(mod.cos, cos) and torch.equal(mod.sin, sin)


def test_rotary_embedding_tables_stay_float32_under_dtype_casts():
    mod = RotaryEmbedding(16, 4096).to(DEV, torch.bfloat16)
    cos, sin = tk.rope_cos_sin(16, 4096, device=DEV)
    assert mod.cos.dtype == torch.float32 and torch.equal(mod.cos, cos) and torch.equal(mod.sin, sin)
    q, k = randn(1, 3, 2, 16, dtype=torch.bfloat16), randn(1, 3, 2, 16, dtype=torch.bfloat16)
    qo, _ = mod(q, k, ids([4000, 4001, 4095]))
    assert qo.dtype == torch.bfloat16
