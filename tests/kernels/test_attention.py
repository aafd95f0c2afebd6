"""flash_attn / flash_attn_varlen: every backend that runs here against a float64 reference.

The reference below is independent of ``titan_kernels.reference``: K/V repeated per head, an
explicit boolean mask (bottom-right causal, block-diagonal for packed documents), float64 autograd
for the gradients. Backends run here: reference, triton (under the interpreter) and sdpa_flash
(aten's CPU flash kernel with its own LSE and backward op: every dense, varlen and LSE-gradient test);
FlashAttention 2/3 and aten's CUDA kernels need CUDA (the FlashAttention adapters are tested with
stand-in modules, the aten CUDA adapters on meta tensors, in test_attention_dispatch.py).

Tensors live on ``TITAN_TEST_DEVICE`` (tests/conftest.py): the CPU by default, where Triton runs in
the interpreter; with ``TITAN_TEST_DEVICE=cuda`` the same tests run the kernels on a GPU, and a
backend that cannot run there is skipped with the reason.

Default run: about a minute on 2 CPU cores. ``pytest -m slow tests/kernels/test_attention.py`` adds
a wider sweep of sequence lengths and head dims through the Triton kernel.
"""
from __future__ import annotations

import pytest
import torch

import titan_kernels as tk
from titan_kernels import backend as _backend
from titan_kernels.attention_mask import AttentionArgs
from titan_kernels.reference import attention as R
from tests.conftest import TEST_DEVICE
from tests.kernels.attention_ref import (  # noqa: F401
    assert_compiled_equals_eager, assert_lse, attention64, attention_tol, dense64, doc_mask, grads, rand, rel,
)


def op_args(scale, causal=True, return_lse=False, max_q=0, max_k=0, left=-1, softcap=0.0, chunk=0):
    """The flat arguments of torch.ops.titan.flash_attn after (q, k, v, cu_q, cu_k, sinks)."""
    return AttentionArgs(scale, left, 0 if causal else -1, softcap, chunk, max_q, max_k, return_lse).op_args()

DEV = torch.device(TEST_DEVICE)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
GRAD_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _param(name: str):
    st = _backend.backend_status(name, DEV) if name in _backend.BACKENDS else None
    why = None if st is None or st.available else f"{name} cannot run on {DEV.type}: {st.reason}"
    return pytest.param(name, id=name, marks=[pytest.mark.skip(reason=why)] if why else [])


# Every backend that takes every case on this device (aten's CPU flash kernel does; its CUDA kernels
# do not, and are tested on the cases they take in test_sdpa_backends).
KERNEL_BACKENDS = [_param("reference"), _param("triton")] + ([_param("sdpa_flash")] if DEV.type == "cpu" else [])


@pytest.fixture(autouse=True)
def _default_tiles(monkeypatch):
    # On a GPU, autotuning each small test shape would cost minutes: use the default tiles.
    monkeypatch.setenv("TITAN_KERNELS_AUTOTUNE", "0")
# aten's kernels on this device ("cpu" / "cuda": the generic native backends, see titan_kernels.ops.attention.dispatch)
SDPA_BACKENDS = ["sdpa_flash", "cpu"] if DEV.type == "cpu" else ["sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "cuda"]


# ----------------------------------------------------------------------------- dense, every backend

# (batch, seq_q, seq_k, n_heads, n_kv_heads, head_dim, causal)
DENSE_CASES = [
    (2, 130, 130, 8, 2, 64, True),    # several blocks, GQA 4:1
    (1, 1, 1, 4, 1, 128, True),       # one token, MQA
    (2, 17, 17, 8, 1, 72, False),     # MQA 8:1, head_dim not a power of two
    (1, 64, 64, 4, 1, 104, True),     # GQA 4:1, head_dim 104
    (1, 37, 100, 4, 4, 64, True),     # seq_q < seq_k: bottom-right causal
    (1, 100, 37, 8, 2, 128, True),    # seq_q > seq_k: the first 63 rows see no key
    (2, 33, 130, 2, 2, 64, False),
    (1, 65, 1, 2, 1, 8, True),        # one key, head_dim 8
    (2, 19, 23, 4, 2, 12, True),      # head_dim 12: not FlashAttention's, but reference/Triton take it
]


def _run_dense(backend, case, dtype, dout_transposed=False):
    b, sq, sk, h, hkv, d, causal = case
    q, k, v = rand(b, sq, h, d, dtype=dtype), rand(b, sk, hkv, d, dtype=dtype), rand(b, sk, hkv, d, dtype=dtype)
    scale = 0.5 / d ** 0.5
    if dout_transposed:
        dout = rand(b, h, sq, d, dtype=dtype).transpose(1, 2)  # non-contiguous
    else:
        dout = rand(b, sq, h, d, dtype=dtype)
    dlse = rand(b, h, sq)
    fn = lambda q, k, v: tk.flash_attn(q, k, v, causal=causal, softmax_scale=scale, return_lse=True, backend=backend)  # noqa: E731
    (out, lse), g = grads(fn, (q, k, v), (dout, None))
    (out64, lse64), g64 = grads(lambda q, k, v: dense64(q, k, v, causal, scale), (q, k, v), (dout.double(), None))
    assert out.dtype == dtype and lse.dtype == torch.float32 and out.shape == q.shape and lse.shape == (b, h, sq)
    assert out.is_contiguous() and lse.is_contiguous()
    tol, grad_tol = (attention_tol(dtype, sq, sk, d, grad=g) for g in (False, True))  # from the size and dtype
    assert rel(out, out64) < tol, (backend, case, rel(out, out64), tol)
    assert_lse(lse, lse64, 1e-4 if dtype == torch.float32 else 2e-2)
    for name, a, e in zip("qkv", g, g64):
        assert a.dtype == dtype and a.shape == e.shape
        assert rel(a, e) < grad_tol, (backend, case, "d" + name, rel(a, e), grad_tol)
    return q, k, v, dlse, scale


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("case", DENSE_CASES, ids=lambda c: "b{}_q{}_k{}_h{}_{}_d{}_{}".format(*c[:6], "causal" if c[6] else "full"))
def test_dense_vs_float64(backend, case):
    _run_dense(backend, case, torch.float32)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dense_half_vs_float64(backend, dtype):
    _run_dense(backend, (2, 77, 77, 4, 2, 64, True), dtype)
    _run_dense(backend, (1, 40, 90, 8, 1, 128, False), dtype)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_noncontiguous_dout_under_mqa(backend):
    _run_dense(backend, (2, 50, 50, 8, 1, 64, True), torch.float32, dout_transposed=True)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_noncontiguous_inputs(backend):
    # q, k, v sliced from one packed (b, s, 3, h, d) projection, and head_dim strided.
    b, s, h, d = 2, 45, 4, 64
    qkv = rand(b, s, 3, h, d)
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    out = tk.flash_attn(q, k, v, backend=backend)
    out64, _ = dense64(q, k, v, True, d ** -0.5)
    assert rel(out, out64) < 1e-5
    wide = rand(b, s, h, 2 * d)[..., ::2]  # stride 2 on head_dim
    out = tk.flash_attn(wide, wide, wide, causal=False, backend=backend)
    assert rel(out, dense64(wide, wide, wide, False, d ** -0.5)[0]) < 1e-5


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_lse_gradient(backend):
    # A loss through the LSE too (as ring attention merges use it): d lse / d S = P.
    b, sq, sk, h, hkv, d = 1, 70, 50, 4, 2, 64
    q, k, v = rand(b, sq, h, d), rand(b, sk, hkv, d), rand(b, sk, hkv, d)
    w = rand(b, h, sq)

    def loss(q, k, v, impl):
        out, lse = impl(q, k, v)
        return (out * out).sum() + (lse.masked_fill(torch.isinf(lse), 0.0) * w.to(lse.dtype)).sum()

    ours = lambda q, k, v: tk.flash_attn(q, k, v, causal=True, return_lse=True, backend=backend)  # noqa: E731
    _, g = grads(lambda *t: loss(*t, ours), (q, k, v), (torch.tensor(1.0, device=DEV),))
    _, g64 = grads(lambda *t: loss(*t, lambda q, k, v: dense64(q, k, v, True, d ** -0.5)), (q, k, v),
                   (torch.tensor(1.0, dtype=torch.float64, device=DEV),))
    for a, e in zip(g, g64):
        assert rel(a, e) < 1e-5


def test_scale_default_and_bool_flags():
    q = rand(1, 20, 2, 32)
    out = tk.flash_attn(q, q, q)
    assert rel(out, dense64(q, q, q, True, 32 ** -0.5)[0]) < 1e-5
    out = tk.flash_attn(q, q, q, causal=False, softmax_scale=2)
    assert rel(out, dense64(q, q, q, False, 2.0)[0]) < 1e-5


# ----------------------------------------------------------------------------- varlen

# Documents (len_q, len_k), with empty ones at the start, in the middle and at the end.
DOCS = [(0, 0), (5, 9), (70, 70), (0, 4), (33, 20), (1, 0), (3, 3), (0, 0)]


def _packed(docs, h, hkv, d, dtype=torch.float32):
    lq, lk = [a for a, _ in docs], [b for _, b in docs]
    cu_q = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    q = rand(sum(lq), h, d, dtype=dtype)
    k, v = rand(sum(lk), hkv, d, dtype=dtype), rand(sum(lk), hkv, d, dtype=dtype)
    return q, k, v, cu_q, cu_k, max(lq), max(lk), lq, lk


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_vs_float64(backend, causal):
    q, k, v, cu_q, cu_k, mq, mk, lq, lk = _packed(DOCS, 8, 2, 64)
    scale = 0.3
    dout = rand(*q.shape)
    dlse = rand(q.shape[1], q.shape[0])
    fn = lambda q, k, v: tk.flash_attn_varlen(q, k, v, cu_q, cu_k, mq, mk, causal=causal, softmax_scale=scale,  # noqa: E731
                                              return_lse=True, backend=backend)
    mask = doc_mask(lq, lk, causal)
    (out, lse), g = grads(fn, (q, k, v), (dout, dlse))
    (out64, lse64), g64 = grads(lambda q, k, v: attention64(q, k, v, mask, scale), (q, k, v), (dout.double(), None))
    assert lse.shape == (8, q.shape[0])
    assert rel(out, out64) < 1e-5
    assert_lse(lse, lse64, 1e-4)
    # The LSE gradient of rows with no visible key is dropped (their lse is -inf, a constant).
    _, g64 = grads(lambda q, k, v: attention64(q, k, v, mask, scale), (q, k, v),
                   (dout.double(), dlse.double().masked_fill(torch.isinf(lse64), 0.0)))
    for a, e in zip(g, g64):
        assert rel(a, e) < 1e-5


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_varlen_equals_separate_documents(backend):
    q, k, v, cu_q, cu_k, mq, mk, lq, lk = _packed([(40, 40), (0, 0), (25, 25), (7, 7)], 4, 1, 64)
    packed = tk.flash_attn_varlen(q, k, v, cu_q, cu_k, mq, mk, backend=backend)
    for i in range(len(lq)):
        a, b = int(cu_q[i]), int(cu_q[i + 1])
        if a == b:
            continue
        alone = tk.flash_attn(q[None, a:b], k[None, a:b], v[None, a:b], backend=backend)[0]
        assert rel(packed[a:b], alone) < 1e-6


# ----------------------------------------------------------------------------- SDPA backends (CPU aten kernels)


@pytest.mark.parametrize("backend", SDPA_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [(2, 40, 40, 4, 2, 64, True), (1, 30, 50, 4, 1, 64, True),
                                  (1, 50, 30, 8, 2, 32, True), (2, 20, 33, 2, 2, 64, False)])
def test_sdpa_backends(backend, case, dtype):
    # aten's is_causal is top-left aligned: seq_q != seq_k is mapped to bottom-right (or refused, with why).
    b, sq, sk, h, hkv, d, causal = case
    q, k, v = rand(b, sq, h, d, dtype=dtype), rand(b, sk, hkv, d, dtype=dtype), rand(b, sk, hkv, d, dtype=dtype)
    try:
        tk.attention_backend(q, k, v, causal=causal, backend=backend)
    except RuntimeError as e:
        assert DEV.type == "cuda", f"aten's CPU kernel must take every case: {e}"
        pytest.skip(f"{backend} refuses this case on {DEV.type}: {e}")
    dout = rand(b, sq, h, d, dtype=dtype)
    fn = lambda q, k, v: tk.flash_attn(q, k, v, causal=causal, return_lse=True, backend=backend)  # noqa: E731
    (out, lse), g = grads(fn, (q, k, v), (dout, None))
    (out64, lse64), g64 = grads(lambda q, k, v: dense64(q, k, v, causal, d ** -0.5), (q, k, v), (dout.double(), None))
    assert rel(out, out64) < TOL[dtype]
    assert_lse(lse, lse64, 1e-4 if dtype == torch.float32 else 2e-2)
    for a, e in zip(g, g64):
        assert rel(a, e) < GRAD_TOL[dtype]


def test_cpu_flash_keeps_no_score_matrix():
    # The backward saves out and lse only: no (seq_q x seq_k) tensor is alive between forward and backward.
    if DEV.type != "cpu":
        pytest.skip("checks aten's CPU kernel")
    b, s, h, d = 1, 512, 2, 16
    q, k, v = (rand(b, s, h, d).requires_grad_() for _ in range(3))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        out = tk.flash_attn(q, k, v, backend="sdpa_flash")
    assert max(saved) <= b * s * h * d, saved  # q, k, v, out (b*s*h*d) and lse (b*h*s): never s*s
    out.sum().backward()


# ----------------------------------------------------------------------------- the Hopper kernel, interpreted


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_sm90_forward_kernel(varlen, causal):
    # Selected only on sm_90 in production; on the CPU the interpreter runs its TMA-descriptor code
    # (float32: the interpreter's bfloat16 dot is not usable, see titan_kernels.triton.flash_attn.tiles._dot).
    from titan_kernels.triton import flash_attn as T

    if DEV.type == "cuda":
        if torch.cuda.get_device_capability(DEV) != (9, 0):
            pytest.skip("the sm_90 kernel needs an sm_90 device")
        dtype, tol = torch.bfloat16, 1e-2
    elif not _backend.backend_status("triton", DEV).available:
        pytest.skip("Triton cannot run on CPU tensors without TRITON_INTERPRET=1")
    else:
        dtype, tol = torch.float32, 1e-5
    if varlen:
        q, k, v, cu_q, cu_k, mq, mk, lq, lk = _packed(DOCS, 4, 2, 64, dtype)
        dims = T._dims(q, k, cu_q, mq, mk)
        out, lse = torch.zeros_like(q), torch.full((4, q.shape[0]), float("-inf"), device=DEV)
        out64, lse64 = attention64(q, k, v, doc_mask(lq, lk, causal), 0.2)
    else:
        q, k, v, cu_q, cu_k = rand(2, 77, 4, 64, dtype=dtype), rand(2, 50, 1, 64, dtype=dtype), rand(2, 50, 1, 64, dtype=dtype), None, None
        dims = T._dims(q, k, None, 77, 50)
        out, lse = torch.empty_like(q), torch.empty(2, 4, 77, device=DEV)
        out64, lse64 = dense64(q, k, v, causal, 0.2)
    a = AttentionArgs(0.2, right=0 if causal else -1, max_q=dims[2], max_k=dims[3])
    T._launch_fwd_sm90(q, k, v, out, lse, cu_q, cu_k, dims, a, tiles=(64, 32))
    assert rel(out, out64) < tol
    assert_lse(lse, lse64, 1e-4 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("varlen", [False, True])
def test_cuda_default_tiles_interpreted(monkeypatch, varlen):
    # The launch path CUDA takes with TITAN_KERNELS_AUTOTUNE=0: each kernel's default (production)
    # tiles, here run by the interpreter.
    from titan_kernels.triton import flash_attn as T

    if DEV.type != "cpu" or not _backend.backend_status("triton", DEV).available:
        pytest.skip("runs the CUDA launch path in the interpreter (CPU with TRITON_INTERPRET=1)")
    monkeypatch.setattr(T, "triton_interpret", lambda: False)
    if varlen:
        q, k, v, cu_q, cu_k, mq, mk, lq, lk = _packed([(150, 150), (0, 3), (70, 40)], 4, 2, 64)
        out64, lse64 = attention64(q, k, v, doc_mask(lq, lk, True), 0.125)
        args, a = (cu_q, cu_k), AttentionArgs(0.125, right=0, max_q=mq, max_k=mk)
    else:
        q, k, v = rand(1, 150, 4, 64), rand(1, 150, 2, 64), rand(1, 150, 2, 64)
        out64, lse64 = dense64(q, k, v, True, 0.125)
        args, a = (None, None), AttentionArgs(0.125, right=0)
    out, lse = T.attention_fwd(q, k, v, *args, a)
    assert rel(out, out64) < 1e-5
    assert_lse(lse, lse64, 1e-4)
    dout = rand(*q.shape)
    got = T.attention_bwd(dout, q, k, v, out, lse, None, *args, a)
    want = R.attention_bwd(dout, q, k, v, out, lse, None, *args, a)
    for a, e in zip(got, want):
        assert rel(a, e) < 1e-5


# ----------------------------------------------------------------------------- the reference's own backward


def test_reference_gradcheck_float64():
    # The reference backward (from out and lse, with an LSE gradient) against finite differences.
    class Ref(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, cu_q, cu_k, causal):
            a = AttentionArgs(0.7, right=0 if causal else -1)
            out, lse = R.attention_fwd(q, k, v, cu_q, cu_k, a)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.meta = (cu_q, cu_k, a)
            return out, lse

        @staticmethod
        def backward(ctx, dout, dlse):
            q, k, v, out, lse = ctx.saved_tensors
            cu_q, cu_k, a = ctx.meta
            g = R.attention_bwd(dout, q, k, v, out, lse, dlse, cu_q, cu_k, a)
            return (*g, None, None, None)

    def finite(fn):
        def f(*a):
            out, lse = fn(*a)
            return out, lse.masked_fill(torch.isinf(lse), 0.0)
        return f

    q, k, v = (torch.randn(1, 5, 4, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    k2, v2 = (torch.randn(1, 3, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(finite(lambda q, k, v: Ref.apply(q, k, v, None, None, True)), (q, k2, v2))
    assert torch.autograd.gradcheck(finite(lambda q, k, v: Ref.apply(q, k, v, None, None, False)), (q, k, v))
    cu = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    cuk = torch.tensor([0, 1, 3, 3], dtype=torch.int32)
    qv, kv, vv = (torch.randn(5, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    assert torch.autograd.gradcheck(finite(lambda q, k, v: Ref.apply(q, k[:3], v[:3], cu, cuk, True)), (qv, kv, vv))


# ----------------------------------------------------------------------------- the dispatcher path


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_op_path_autograd(backend):
    # torch.ops.titan.flash_attn with register_autograd (the path torch.compile and DTensor take).
    b, sq, sk, h, hkv, d = 1, 40, 60, 4, 2, 64
    q, k, v = rand(b, sq, h, d), rand(b, sk, hkv, d), rand(b, sk, hkv, d)
    dout, dlse = rand(b, sq, h, d), rand(b, h, sq)
    op = lambda q, k, v: torch.ops.titan.flash_attn(q, k, v, None, None, None, *op_args(0.1, return_lse=True),  # noqa: E731
                                                    backend)
    (out, lse), g = grads(op, (q, k, v), (dout, dlse))
    (out64, lse64), g64 = grads(lambda q, k, v: dense64(q, k, v, True, 0.1), (q, k, v), (dout.double(), dlse.double()))
    assert rel(out, out64) < 1e-5
    for a, e in zip(g, g64):
        assert rel(a, e) < 1e-5


def _opcheck_args(backend, varlen):
    if varlen:
        q, k, v, cu_q, cu_k, mq, mk, _, _ = _packed([(5, 7), (0, 2), (9, 9)], 4, 2, 16)
    else:
        q, k, v, cu_q, cu_k, mq, mk = rand(2, 9, 4, 16), rand(2, 7, 2, 16), rand(2, 7, 2, 16), None, None, 0, 0
    args = op_args(0.25, return_lse=True, max_q=mq, max_k=mk)
    out, lse = torch.ops.titan.flash_attn(q, k, v, cu_q, cu_k, None, *args, backend)
    fwd = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), cu_q, cu_k, None, *args, backend)
    bwd = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, torch.randn_like(lse), cu_q, cu_k,
           None, *args, backend)
    return fwd, bwd


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_opcheck(backend, varlen):
    fwd, bwd = _opcheck_args(backend, varlen)
    torch.library.opcheck(torch.ops.titan.flash_attn.default, fwd)
    torch.library.opcheck(torch.ops.titan.flash_attn_backward.default, bwd)


def test_compile_fullgraph_matches_eager():
    q, k, v = rand(2, 24, 4, 32), rand(2, 24, 2, 32), rand(2, 24, 2, 32)
    qv, kv, vv, cu_q, cu_k, mq, mk, _, _ = _packed([(9, 9), (0, 0), (15, 15)], 4, 2, 32)

    def f(q, k, v, qv, kv, vv):
        a, lse = tk.flash_attn(q, k, v, causal=True, return_lse=True)
        b = tk.flash_attn_varlen(qv, kv, vv, cu_q, cu_k, mq, mk, causal=False)
        return (a * a).sum() + lse.sum() + (b * b).sum()

    assert_compiled_equals_eager(f, [t.requires_grad_() for t in (q, k, v, qv, kv, vv)])


@pytest.mark.slow
def test_compile_inductor_fullgraph():
    torch._dynamo.reset()
    q, k, v = rand(1, 16, 2, 32), rand(1, 16, 2, 32), rand(1, 16, 2, 32)
    inputs = [t.requires_grad_() for t in (q, k, v)]
    f = lambda q, k, v: (tk.flash_attn(q, k, v) ** 2).sum()  # noqa: E731
    loss_c = torch.compile(f, fullgraph=True)(*inputs)
    g_c = torch.autograd.grad(loss_c, inputs)
    g_e = torch.autograd.grad(f(*inputs), inputs)
    for a, e in zip(g_c, g_e):
        torch.testing.assert_close(a, e)


# ----------------------------------------------------------------------------- zero-size


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("shape", [(0, 10, 10), (2, 0, 10), (2, 10, 0)], ids=["batch0", "seq_q0", "seq_k0"])
def test_zero_size(backend, shape):
    b, sq, sk = shape
    q, k, v = rand(b, sq, 4, 16), rand(b, sk, 2, 16), rand(b, sk, 2, 16)
    lse_wanted = True
    (res, g) = grads(lambda q, k, v: tk.flash_attn(q, k, v, return_lse=lse_wanted, backend=backend), (q, k, v),
                     (torch.ones(b, sq, 4, 16, device=DEV),) + ((None,) if lse_wanted else ()))
    out = res[0]
    assert out.shape == q.shape and torch.count_nonzero(out) == 0
    if lse_wanted:
        assert res[1].shape == (b, 4, sq) and bool(torch.isneginf(res[1]).all())
    for a, t in zip(g, (q, k, v)):
        assert a.shape == t.shape and torch.count_nonzero(a) == 0


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_zero_size_varlen(backend):
    for docs in ([], [(0, 0), (0, 0)], [(0, 3)], [(4, 0)]):
        q, k, v, cu_q, cu_k, mq, mk, _, _ = _packed(docs, 2, 1, 16) if docs else (
            rand(0, 2, 16), rand(0, 1, 16), rand(0, 1, 16), torch.zeros(1, dtype=torch.int32, device=DEV),
            torch.zeros(1, dtype=torch.int32, device=DEV), 0, 0, [], [])
        out, lse = tk.flash_attn_varlen(q, k, v, cu_q, cu_k, mq, mk, return_lse=True, backend=backend)
        assert out.shape == q.shape and torch.count_nonzero(out) == 0 and lse.shape == (2, q.shape[0])
        assert bool(torch.isneginf(lse).all())


# ----------------------------------------------------------------------------- bad input


def test_bad_inputs():
    q, k = rand(2, 8, 4, 16), rand(2, 8, 2, 16)
    with pytest.raises(TypeError, match="q: expected a torch.Tensor"):
        tk.flash_attn([1.0], k, k)
    with pytest.raises(TypeError, match="k: expected dtype"):
        tk.flash_attn(q, k.double(), k.double())
    with pytest.raises(TypeError, match="v: expected dtype torch.float32"):
        tk.flash_attn(q, k, k.bfloat16())
    with pytest.raises(TypeError, match="q: expected dtype in"):
        tk.flash_attn(q.int(), k.int(), k.int())
    with pytest.raises(ValueError, match="q: expected 4 dims"):
        tk.flash_attn(q[0], k, k)
    with pytest.raises(ValueError, match="k: expected batch 2"):
        tk.flash_attn(q, k[:1], k[:1])
    with pytest.raises(ValueError, match="k: expected head_dim 16"):
        tk.flash_attn(q, rand(2, 8, 2, 24), rand(2, 8, 2, 24))
    with pytest.raises(ValueError, match="v: expected shape"):
        tk.flash_attn(q, k, rand(2, 9, 2, 16))
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        tk.flash_attn(q, rand(2, 8, 3, 16), rand(2, 8, 3, 16))
    with pytest.raises(ValueError, match="head_dim must be in \\[1, 256\\]"):
        tk.flash_attn(rand(1, 2, 1, 264), rand(1, 2, 1, 264), rand(1, 2, 1, 264))
    with pytest.raises(ValueError, match="softmax_scale"):
        tk.flash_attn(q, k, k, softmax_scale=float("nan"))
    with pytest.raises(TypeError, match="softmax_scale"):
        tk.flash_attn(q, k, k, softmax_scale="0.1")
    with pytest.raises(ValueError, match="backend: expected"):
        tk.flash_attn(q, k, k, backend="fa4")
    with pytest.raises(ValueError, match="k: expected device"):
        tk.flash_attn(q, k.to("meta"), k.to("meta"))


def test_bad_cu_seqlens():
    q, k, v, cu_q, cu_k, mq, mk, _, _ = _packed([(5, 5), (7, 7)], 2, 2, 16)
    call = lambda **kw: tk.flash_attn_varlen(**{**dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,  # noqa: E731
                                                        max_seqlen_q=mq, max_seqlen_k=mk), **kw})
    with pytest.raises(TypeError, match="cu_seqlens_q: expected dtype int32, got int64"):
        call(cu_seqlens_q=cu_q.long())
    with pytest.raises(ValueError, match="cu_seqlens_k: expected non-decreasing"):
        call(cu_seqlens_k=torch.tensor([0, 9, 7], dtype=torch.int32, device=DEV), max_seqlen_k=9)
    with pytest.raises(ValueError, match="cu_seqlens_q: expected to start at 0 and end at the total length 12"):
        call(cu_seqlens_q=torch.tensor([0, 5, 11], dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="cu_seqlens_q: expected to start at 0"):
        call(cu_seqlens_q=torch.tensor([1, 5, 12], dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="cu_seqlens_k: expected 3 entries"):
        call(cu_seqlens_k=torch.tensor([0, 12], dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="cu_seqlens_q: expected a 1-D"):
        call(cu_seqlens_q=cu_q[None])
    with pytest.raises(ValueError, match="max_seqlen_q: expected >= the longest document \\(7\\)"):
        call(max_seqlen_q=6)
    with pytest.raises(TypeError, match="max_seqlen_k: expected an int"):
        call(max_seqlen_k=7.0)
    with pytest.raises(ValueError, match="q: expected 3 dims"):
        call(q=q[None])


# ----------------------------------------------------------------------------- wider sweep (slow)


@pytest.mark.slow
@pytest.mark.parametrize("seq", [1, 2, 31, 63, 64, 65, 127, 128, 129, 130])
@pytest.mark.parametrize("d", [64, 128, 72, 104])
@pytest.mark.parametrize("gqa", [(4, 4), (8, 2), (8, 1)])
def test_triton_sweep(seq, d, gqa):
    h, hkv = gqa
    for causal in (True, False):
        _run_dense("triton", (1, seq, seq, h, hkv, d, causal), torch.float32)


def test_varlen_on_meta_tensors_gives_shapes():
    q = torch.empty(12, 4, 16, device="meta", requires_grad=True)
    kv = torch.empty(12, 2, 16, device="meta")
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    out, lse = tk.flash_attn_varlen(q, kv, kv, cu, cu, 7, 7, return_lse=True)
    assert out.shape == q.shape and lse.shape == (4, 12) and out.device.type == "meta"
    out.sum().backward()
    assert q.grad.shape == q.shape
