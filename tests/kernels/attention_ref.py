"""The float64 attention the attention tests compare against, and their shared helpers.

Independent of ``titan_kernels``: K/V repeated per head, an explicit boolean mask built from the
definitions (positions aligned bottom-right per document; window ``p - left <= j <= p + right``;
chunks ``j // c == p // c``), soft-capping ``c * tanh(s / c)``, sinks as an extra logit per head in
each row's softmax (its probability dropped), float64 autograd for the gradients.
"""
from __future__ import annotations

import math

import torch

from tests.conftest import TEST_DEVICE

DEV = torch.device(TEST_DEVICE)


def doc_mask(lens_q, lens_k, causal: bool = True, window=(-1, -1), chunk=None) -> torch.Tensor:
    """(total_q, total_k) bool: query i sees key j when both are in the same document and the
    document's mask lets it: position p = i + len_k - len_q within the document; causal: j <= p;
    window (left, right): p - left <= j <= p + right (-1 unbounded); chunk c: j // c == p // c."""
    left, right = window
    if causal:
        right = 0
    tq, tk_ = sum(lens_q), sum(lens_k)
    m = torch.zeros(tq, tk_, dtype=torch.bool, device=DEV)
    q0 = k0 = 0
    for lq, lk in zip(lens_q, lens_k):
        p = torch.arange(lq, device=DEV)[:, None] + (lk - lq)
        j = torch.arange(lk, device=DEV)[None, :]
        seen = torch.ones(lq, lk, dtype=torch.bool, device=DEV)
        if left >= 0:
            seen &= j >= p - left
        if right >= 0:
            seen &= j <= p + right
        if chunk:
            seen &= torch.floor(j / chunk) == torch.floor(p / chunk)
        m[q0:q0 + lq, k0:k0 + lk] = seen
        q0, k0 = q0 + lq, k0 + lk
    return m


def attention64(q, k, v, mask, scale, sinks=None, softcap=0.0):
    """Packed layout q (Tq, h, d), k (Tk, h_kv, d), v (Tk, h_kv, dv), mask (Tq, Tk) -> out (Tq, h, dv),
    lse (h, Tq): -inf for a row with no visible key and no sink; with sinks, the sink included."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("ihd,jhd->hij", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:  # one more logit per row; its probability multiplies nothing
        col = sinks.double()[:, None, None].expand(-1, s.shape[1], 1)
        s = torch.cat([s, col], -1)
        seen = torch.ones(s.shape[1], dtype=torch.bool, device=s.device)
    else:
        seen = mask.any(-1)  # rows with at least one visible key
    s = s.masked_fill(~seen[:, None], 0.0)
    lse_all = torch.logsumexp(s, -1)
    p = torch.exp(s - lse_all[..., None])
    if sinks is not None:
        p = p[..., :-1]
    p = p * mask
    out = torch.einsum("hij,jhd->ihd", p, v)
    return out, torch.where(seen, lse_all, torch.full_like(lse_all, float("-inf")))


def dense64(q, k, v, causal, scale, window=(-1, -1), chunk=None, sinks=None, softcap=0.0):
    """Dense layout through ``attention64``, batch by batch: out (b, sq, h, dv), lse (b, h, sq)."""
    outs, lses = [], []
    mask = doc_mask([q.shape[1]], [k.shape[1]], causal, window, chunk)
    for i in range(q.shape[0]):
        o, l = attention64(q[i], k[i], v[i], mask, scale, sinks, softcap)
        outs.append(o)
        lses.append(l)
    if not outs:
        return (q.new_zeros((*q.shape[:-1], v.shape[-1]), dtype=torch.float64),
                q.new_zeros((0, q.shape[2], q.shape[1]), dtype=torch.float64))
    return torch.stack(outs), torch.stack(lses)


def rel(a, b) -> float:
    """Relative norm error; a reference that is exactly 0 (e.g. dq with a single key) is compared
    against an RMS of 0.1 instead (unit-scale inputs), so rounding noise around 0 is not an infinite error."""
    a, b = a.double(), b.double()
    floor = 0.1 * math.sqrt(max(b.numel(), 1))
    return ((a - b).norm() / torch.clamp(b.norm(), min=floor)).item()


# Unit roundoff (half the machine epsilon) of each dtype.
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
# Half inputs: the kernels accumulate in float32 and round P and the outputs to the half dtype, so the
# half's rounding dominates: a few of its unit roundoffs, relative (out: bf16 2.6 u, fp16 4.1 u; the
# gradients 2-2.5x that). These are the tolerances the tests had; only float32's is derived.
_HALF_TOL = {torch.bfloat16: (1e-2, 2e-2), torch.float16: (2e-3, 5e-3)}


def attention_tol(dtype: torch.dtype, seq_q: int, seq_k: int, head_dim: int, head_dim_v: int | None = None,
                  grad: bool = False) -> float:
    """The relative norm error (``rel``) an attention output (``grad``: each of dq, dk, dv) may have
    against float64, from the problem's size and dtype.

    float32: a sum of n terms rounded in float32 errs by at most gamma_n ~ n u (u = 2^-24) relative to
    the sum of its absolute terms (Higham 2002, "Accuracy and Stability of Numerical Algorithms",
    Lemma 3.1 and eq. 3.5); to first order the errors of a chain of sums and roundings add. The
    forward's chain: the scores (head_dim terms), the softmax denominator (seq_k), P V (seq_k), and
    4 single roundings (scale, max shift, exp, division): (d + 2 s_k + 4) u. The backward's longest
    chain: P recomputed (d + s_k), dP = dO V^T (d_v), delta = rowsum(dO * O) (d_v), the gradient sums
    (dq over s_k keys; dk and dv over s_q queries: max(s_q, s_k)) and 6 roundings. This is the
    worst-case first-order bound, not a fit: at (2, 130, 130, 8/2 heads, 64) it is 2.7e-5 for the
    gradients, where a run measured 1.67e-5 once and typically 4e-7.
    bfloat16 / float16: ``_HALF_TOL`` (the half's own rounding dominates the float32 chain).
    """
    if dtype != torch.float32:
        return _HALF_TOL[dtype][grad]
    dv = head_dim if head_dim_v is None else head_dim_v
    if grad:
        n = head_dim + seq_k + 2 * dv + max(seq_q, seq_k) + 6
    else:
        n = head_dim + 2 * seq_k + 4
    return n * UNIT_ROUNDOFF[torch.float32]


def assert_lse(lse, lse64, atol):
    fin = torch.isfinite(lse64)
    assert torch.equal(torch.isneginf(lse), ~fin), "rows with no visible key must have lse = -inf"
    if fin.any():
        assert (lse.double()[fin] - lse64[fin]).abs().max().item() < atol


def grads(fn, inputs, cotangents):
    """(outputs, gradients of the inputs) for the given cotangents (None: that output unused)."""
    inputs = [t.detach().requires_grad_(True) for t in inputs]
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    used = [(o, c) for o, c in zip(outs, cotangents) if c is not None]
    return outs, torch.autograd.grad([o for o, _ in used], inputs, [c for _, c in used])


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=torch.float32).to(dtype).to(DEV)


def assert_compiled_equals_eager(f, inputs):
    """torch.compile(f, fullgraph=True, backend="aot_eager") equals eager f: its (scalar) output and
    the gradients of ``inputs`` (tensors requiring grad)."""
    torch._dynamo.reset()
    loss_c = torch.compile(f, fullgraph=True, backend="aot_eager")(*inputs)
    g_c = torch.autograd.grad(loss_c, inputs)
    loss_e = f(*inputs)
    torch.testing.assert_close(loss_c, loss_e)
    for a, e in zip(g_c, torch.autograd.grad(loss_e, inputs)):
        torch.testing.assert_close(a, e)
