"""flash_attn dispatch: backend order, overrides, skips with reasons, and the FlashAttention adapters.

No CUDA here, so FlashAttention 2/3 are replaced by stand-in modules with the signatures of their
private forward/backward functions (flash-attn 2.6+ and FA3's ``hopper/flash_attn_interface.py``,
plus an older FA3 layout), computing with the reference and FlashAttention's conventions (+inf LSE
for a row with no visible key, dq/dk/dv written into given buffers). The adapters run on CPU
tensors; the choice among CUDA backends is checked on synthetic CUDA cases with the device queries
patched. What is not checked here: the real libraries on a GPU (bench/run_gpu.sh runs them).
"""
from __future__ import annotations

import sys
import types

import pytest
import torch

import titan_kernels as tk
from titan_kernels import backend as _backend
from titan_kernels.attention_mask import AttentionArgs
from titan_kernels.ops.attention import aten as AT
from titan_kernels.ops.attention import dispatch as A
from titan_kernels.ops.attention.flash_lib import flash_lib
from titan_kernels.reference import attention as R
from tests.kernels.attention_ref import attention64, dense64, doc_mask, rel
from tests.kernels.test_attention import op_args

# ----------------------------------------------------------------------------- stand-in libraries


def _fa_args(causal, scale, left=-1, right=-1, softcap=0.0, chunk=0):
    # FlashAttention's own reading of its arguments: causal sets the window's right side to 0.
    return AttentionArgs(scale, left, 0 if causal else right, softcap, chunk)


def _fa_fwd(q, k, v, cu_q, cu_k, causal, scale, *window):
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1, "FlashAttention wants unit stride on head_dim"
    out, lse = R.attention_fwd(q, k, v, cu_q, cu_k, _fa_args(causal, scale, *window))
    return out, lse.masked_fill(torch.isneginf(lse), float("inf"))  # FlashAttention's convention


def _fa_bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, causal, scale, *window):
    assert not bool(torch.isneginf(lse).any()), "FlashAttention's backward expects +inf, not -inf, for empty rows"
    g = R.attention_bwd(dout, q, k, v, out, lse.masked_fill(torch.isposinf(lse), float("-inf")), None, cu_q, cu_k,
                        _fa_args(causal, scale, *window))
    for buf, x in zip((dq, dk, dv), g):
        buf.copy_(x)
    return torch.empty(0)  # softmax_d


def make_fa3(calls: list, old_layout: bool = False) -> types.ModuleType:
    m = types.ModuleType("flash_attn_interface")
    if old_layout:
        # An earlier FA3 layout: window_size as a pair, causal / softmax_scale without defaults.
        def _flash_attn_forward(q, k, v, k_new, v_new, qv, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new,
                                seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k,
                                rotary_cos, rotary_sin, q_descale, k_descale, v_descale, softmax_scale, causal,
                                window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, num_splits=1,
                                pack_gqa=None, sm_margin=0):
            assert k_new is None and page_table is None
            calls.append(("fa3.fwd", cu_seqlens_q is not None))
            o, l = _fa_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale, *window_size, softcap)
            return o, l, None, None
    else:
        def _flash_attn_forward(q, k, v, k_new=None, v_new=None, qv=None, out_=None, cu_seqlens_q=None,
                                cu_seqlens_k=None, cu_seqlens_k_new=None, seqused_q=None, seqused_k=None,
                                max_seqlen_q=None, max_seqlen_k=None, page_table=None, kv_batch_idx=None,
                                leftpad_k=None, rotary_cos=None, rotary_sin=None, seqlens_rotary=None, q_descale=None,
                                k_descale=None, v_descale=None, softmax_scale=None, causal=False, window_size_left=-1,
                                window_size_right=-1, attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                                scheduler_metadata=None, num_splits=1, pack_gqa=None, sm_margin=0):
            assert (cu_seqlens_q is None) == (max_seqlen_q is None)
            calls.append(("fa3.fwd", cu_seqlens_q is not None))
            o, l = _fa_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale, window_size_left,
                           window_size_right, softcap, attention_chunk)
            return o, l, torch.empty(0), torch.empty(0)

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q=None, cu_seqlens_k=None, sequed_q=None,
                             sequed_k=None, max_seqlen_q=None, max_seqlen_k=None, dq=None, dk=None, dv=None,
                             softmax_scale=None, is_causal=False, window_size_left=-1, window_size_right=-1,
                             softcap=0.0, deterministic=False, sm_margin=0):
        calls.append(("fa3.bwd", cu_seqlens_q is not None))
        return _fa_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, is_causal,
                       softmax_scale, window_size_left, window_size_right, softcap)

    m._flash_attn_forward = _flash_attn_forward
    m._flash_attn_backward = _flash_attn_backward
    return m


def make_fa2(calls: list, version: str = "2.7.4") -> tuple[types.ModuleType, types.ModuleType]:
    pkg = types.ModuleType("flash_attn")
    pkg.__version__ = version
    m = types.ModuleType("flash_attn.flash_attn_interface")

    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                            alibi_slopes, return_softmax):
        assert dropout_p == 0.0 and alibi_slopes is None and not return_softmax
        calls.append(("fa2.fwd", False))
        o, l = _fa_fwd(q, k, v, None, None, causal, softmax_scale, window_size_left, window_size_right, softcap)
        return o, l, torch.empty(0), torch.empty(2, dtype=torch.int64)

    def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                   softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                                   alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None,
                                   seqused_k=None):
        assert isinstance(max_seqlen_q, int) and dropout_p == 0.0
        calls.append(("fa2.fwd", True))
        o, l = _fa_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale, window_size_left, window_size_right,
                       softcap)
        return o, l, torch.empty(0), torch.empty(2, dtype=torch.int64)

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                             window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
        calls.append(("fa2.bwd", False))
        return _fa_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, None, None, causal, softmax_scale,
                       window_size_left, window_size_right, softcap)

    def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                    max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left,
                                    window_size_right, softcap, alibi_slopes, deterministic, rng_state=None,
                                    zero_tensors=False):
        calls.append(("fa2.bwd", True))
        return _fa_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale,
                       window_size_left, window_size_right, softcap)

    for f in (_flash_attn_forward, _flash_attn_varlen_forward, _flash_attn_backward, _flash_attn_varlen_backward):
        setattr(m, f.__name__, f)
    pkg.flash_attn_interface = m
    return pkg, m


@pytest.fixture
def libs(monkeypatch):
    """Install stand-in flash-attn libraries; returns the list their calls are recorded in."""
    calls: list = []
    pkg, fa2 = make_fa2(calls)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", make_fa3(calls))
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", fa2)
    A.clear_caches()
    yield calls
    A.clear_caches()


@pytest.fixture
def no_libs(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)  # import raises ImportError
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", None)
    A.clear_caches()
    yield
    A.clear_caches()


# ----------------------------------------------------------------------------- adapters


@pytest.mark.parametrize("kind", ["fa3", "fa2", "fa3_old"])
@pytest.mark.parametrize("varlen", [False, True])
def test_flash_adapters(monkeypatch, kind, varlen):
    calls: list = []
    if kind.startswith("fa3"):
        monkeypatch.setitem(sys.modules, "flash_attn_interface", make_fa3(calls, old_layout=kind == "fa3_old"))
    else:
        pkg, m = make_fa2(calls)
        monkeypatch.setitem(sys.modules, "flash_attn", pkg)
        monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", m)
    A.clear_caches()
    name = kind[:3]
    lib, why = flash_lib(name)
    assert lib is not None, why
    scale = 0.3
    if varlen:
        lq, lk = [0, 7, 3, 12], [4, 7, 0, 5]  # an empty query doc, a doc with no key, seq_q > seq_k
        cu_q = torch.tensor([0, 0, 7, 10, 22], dtype=torch.int32)
        cu_k = torch.tensor([0, 4, 11, 11, 16], dtype=torch.int32)
        q, k, v = torch.randn(22, 4, 16), torch.randn(16, 2, 16), torch.randn(16, 2, 16)
        args, a = (cu_q, cu_k), AttentionArgs(scale, right=0, max_q=12, max_k=7)
        out64, lse64 = attention64(q, k, v, doc_mask(lq, lk, True), scale)
    else:
        q = torch.randn(2, 24, 8, 128)[..., ::2]  # strided head_dim: the adapter makes it contiguous
        k, v = torch.randn(2, 10, 2, 64), torch.randn(2, 10, 2, 64)
        args, a = (None, None), AttentionArgs(scale, right=0)
        out64, lse64 = dense64(q, k, v, True, scale)
    out, lse = A.impl(name, "cuda")[0](q, k, v, *args, a)
    assert calls == [(f"{name}.fwd", varlen)]
    assert rel(out, out64) < 1e-5
    fin = torch.isfinite(lse64)
    assert torch.equal(torch.isneginf(lse), ~fin), "+inf from FlashAttention must come back as -inf"
    dout = torch.randn_like(out)
    dq, dk, dv = A.impl(name, "cuda")[1](dout, q, k, v, out, lse, None, *args, a)
    assert calls[-1] == (f"{name}.bwd", varlen)
    ref = R.attention_bwd(dout, q, k, v, out, lse, None, *args, a)
    for a, e in zip((dq, dk, dv), ref):
        assert a.shape == e.shape and rel(a, e) < 1e-6


def test_unsupported_releases(monkeypatch):
    m = types.ModuleType("flash_attn_interface")
    m._flash_attn_forward = lambda q, k, v, mystery_flag: None
    m._flash_attn_backward = lambda dout, q, k, v, out, softmax_lse: None
    monkeypatch.setitem(sys.modules, "flash_attn_interface", m)
    pkg, fa2 = make_fa2([], version="2.5.9")
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", fa2)
    A.clear_caches()
    try:
        lib, why = flash_lib("fa3")
        assert lib is None and "unsupported release" in why and "mystery_flag" in why
        lib, why = flash_lib("fa2")
        assert lib is None and "too old" in why
    finally:
        A.clear_caches()


# ----------------------------------------------------------------------------- the CUDA order, on synthetic cases


def cuda_case(dtype=torch.bfloat16, varlen=False, backward=False, has_dlse=False, causal=True, seq_q=64, seq_k=64,
              head_dim=128):
    return A.AttentionCase(torch.device("cuda", 0), dtype, 2, seq_q, seq_k, 8, 2, head_dim, causal, varlen,
                           backward=backward, has_dlse=has_dlse)


@pytest.fixture
def fake_cuda(monkeypatch):
    """Device queries patched: an sm_90 device, Triton available, SDPA's checks say yes."""
    state = {"cap": (9, 0), "triton": None, "sdpa": {"sdpa_cudnn": True, "sdpa_flash": True, "sdpa_efficient": True}}
    monkeypatch.setattr(A, "_cuda_capability", lambda device: state["cap"])
    monkeypatch.setattr(A, "_why_not_triton", lambda case: state["triton"])
    monkeypatch.setattr(A, "_sdpa_can_use", lambda name, case: state["sdpa"][name])
    A.clear_caches()
    yield state
    A.clear_caches()


def names(choice):
    return choice.backend, [n for n, _ in choice.skipped]


def test_cuda_order(libs, fake_cuda):
    def choose(**kw):
        A.clear_caches()  # the device state changed: forget the cached answers
        return A.choose_backend(cuda_case(**kw))

    assert names(choose()) == ("fa3", [])
    assert choose(varlen=True).backend == "fa3"
    fake_cuda["cap"] = (8, 0)  # A100: no FA3
    choice = choose()
    assert names(choice) == ("fa2", ["fa3"]) and "sm_90" in choice.skipped[0][1]
    fake_cuda["cap"] = (9, 0)
    choice = choose(dtype=torch.float32)  # FlashAttention, cuDNN and aten's flash: half types only
    assert names(choice) == ("triton", ["fa3", "fa2", "sdpa_cudnn", "sdpa_flash"])
    assert "float16/bfloat16" in choice.skipped[0][1] and "float16/bfloat16" in choice.skipped[2][1]
    choice = choose(head_dim=12)  # FlashAttention: multiples of 8 only; torch's checks decide for aten's
    assert names(choice) == ("sdpa_cudnn", ["fa3", "fa2"]) and "not a multiple of 8" in choice.skipped[0][1]
    choice = choose(backward=True, has_dlse=True)  # an LSE gradient: only Triton's backward takes it
    assert names(choice) == ("triton", ["fa3", "fa2", "sdpa_cudnn", "sdpa_flash"])
    assert all("LSE" in why for _, why in choice.skipped)
    choice = choose(seq_q=32)  # bottom-right causal: not aten's top-left kernels
    assert names(choice) == ("fa3", [])
    fake_cuda["cap"] = (8, 0)
    choice = choose(seq_q=32)
    assert names(choice) == ("fa2", ["fa3"])
    fake_cuda["cap"] = (9, 0)
    fake_cuda["triton"] = "the triton package is not installed"
    choice = choose(dtype=torch.float32)
    assert names(choice) == ("sdpa_efficient", ["fa3", "fa2", "sdpa_cudnn", "sdpa_flash", "triton"])
    fake_cuda["sdpa"]["sdpa_efficient"] = False
    with pytest.raises(RuntimeError, match="no backend can run titan op 'flash_attn' on cuda.*can_use_efficient_attention"):
        choose(dtype=torch.float32)
    # varlen in float32 without Triton: nothing automatic takes it, and the reference is only explicit.
    with pytest.raises(RuntimeError, match="backend='reference' runs anything"):
        choose(dtype=torch.float32, varlen=True)


def test_cuda_order_without_flash_libraries(no_libs, fake_cuda):
    choice = A.choose_backend(cuda_case())
    assert names(choice) == ("sdpa_cudnn", ["fa3", "fa2"])
    assert "not importable" in choice.skipped[0][1]


def test_capabilities_are_cached(libs, fake_cuda, monkeypatch):
    calls = []
    monkeypatch.setattr(A, "_sdpa_can_use", lambda name, case: calls.append(name) or True)
    A.clear_caches()
    fake_cuda["cap"] = (8, 0)
    fake_cuda["triton"] = "the triton package is not installed"
    for _ in range(5):
        assert A.choose_backend(cuda_case(dtype=torch.float32)).backend == "sdpa_efficient"
        assert A.choose_backend(cuda_case()).backend == "fa2"
    assert calls == ["sdpa_efficient"]  # asked once for the key, then cached (FA2 takes the bf16 case)


def test_runtime_failure_falls_back_once(monkeypatch):
    # An automatically chosen kernel that raises on this device is recorded (with a warning) and the
    # next backend runs; an explicit request re-raises.
    q, k, v = (torch.randn(1, 12, 2, 16) for _ in range(3))
    A.clear_caches()
    calls = []

    def broken(*args, **kw):
        calls.append(1)
        raise RuntimeError("no kernel image is available for execution on the device")

    orders = dict(A.ORDER)
    _backend.set_order(A.OP, {**orders, "cpu": ("sdpa_flash", "reference")})
    swap = _backend.replace_impl(A.OP, "sdpa_flash", (broken, broken), family="cpu")
    try:
        swap.__enter__()
        with pytest.warns(RuntimeWarning, match="sdpa_flash.*no kernel image"):
            out = tk.flash_attn(q, k, v)
        assert rel(out, dense64(q, k, v, True, 16 ** -0.5)[0]) < 1e-5
        out = tk.flash_attn(q, k, v)  # remembered: no second try
        assert calls == [1]
        assert "raised at run time" in dict(tk.attention_backend(q, k, v).skipped)["sdpa_flash"]
        with pytest.raises(RuntimeError, match="no kernel image"):
            tk.flash_attn(q, k, v, backend="sdpa_flash")
    finally:
        swap.__exit__(None, None, None)
        _backend.set_order(A.OP, orders)
        A.clear_caches()


def test_aten_cuda_adapters_on_meta():
    # The CUDA adapters' argument plumbing against aten's meta kernels (no GPU here): shapes, dtypes and
    # the GQA repeat / group sum.
    b, s, h, hkv, d = 2, 48, 8, 2, 64
    q = torch.empty(b, s, h, d, device="meta", dtype=torch.bfloat16)
    k = torch.empty(b, s, hkv, d, device="meta", dtype=torch.bfloat16)
    for name in ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient"):
        fwd, bwd = AT.IMPLS[(name, "cuda")]
        kk = k if name != "sdpa_flash" else torch.empty(b, s, h, d, device="meta", dtype=torch.bfloat16)
        a = AttentionArgs(0.125, right=0)
        out, lse = fwd(q, kk, kk, None, None, a)
        assert out.shape == q.shape and lse.shape == (b, h, s) and lse.dtype == torch.float32, name
        dq, dk, dv = bwd(out, q, kk, kk, out, lse, None, None, None, a)
        assert dq.shape == q.shape and dk.shape == kk.shape and dv.shape == kk.shape, name


def test_overrides(libs, fake_cuda):
    assert A.choose_backend(cuda_case(), "fa2").backend == "fa2"
    assert A.choose_backend(cuda_case(), "sdpa_efficient").backend == "sdpa_efficient"
    with tk.use_backend("triton"):
        choice = A.choose_backend(cuda_case())
        assert choice.backend == "triton" and "use_backend" in choice.reason
        assert A.choose_backend(cuda_case(), "fa3").backend == "fa3"  # the argument wins
    with tk.use_backend("cuda"):  # the native CUDA kernels: FA3 > FA2 > aten's, never Triton
        assert A.choose_backend(cuda_case()).backend == "fa3"
        fake_cuda["cap"] = (8, 0)
        A.clear_caches()
        assert A.choose_backend(cuda_case()).backend == "fa2"
        assert A.choose_backend(cuda_case(dtype=torch.float32)).backend == "sdpa_efficient"
    with pytest.raises(RuntimeError, match="backend 'fa3' cannot run titan op 'flash_attn'.*sm_90"):
        A.choose_backend(cuda_case(), "fa3")
    with pytest.raises(RuntimeError, match="fa2.*float16/bfloat16"):
        A.choose_backend(cuda_case(dtype=torch.float32), "fa2")


def _triton_on_cpu():
    st = _backend.backend_status("triton", "cpu")
    return pytest.mark.skipif(not st.available, reason=f"Triton cannot run on CPU tensors here: {st.reason}")


def test_cpu_choices(backend_env):
    q = torch.randn(1, 8, 4, 16)
    k = torch.randn(1, 8, 2, 16)
    choice = tk.attention_backend(q, k, k)
    assert choice.backend == "sdpa_flash" and str(choice).startswith("sdpa_flash:")
    if _backend.backend_status("triton", "cpu").available:  # the interpreter
        with tk.use_backend("triton"):
            assert tk.attention_backend(q, k, k).backend == "triton"
        backend_env("triton")
        assert tk.attention_backend(q, k, k).backend == "triton"
        backend_env("auto")
    else:
        with tk.use_backend("triton"), pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            tk.attention_backend(q, k, k)
    assert tk.attention_backend(q, k, k, backend="cpu").backend == "sdpa_flash"
    assert tk.attention_backend(q, k, k, backend="reference").backend == "reference"
    with pytest.raises(RuntimeError, match="backend 'cuda' runs on cuda tensors"):
        tk.attention_backend(q, k, k, backend="cuda")
    with pytest.raises(RuntimeError, match="fa3.*runs on CUDA tensors"):
        tk.flash_attn(q, k, k, backend="fa3")
    with pytest.raises(RuntimeError, match="sdpa_cudnn.*runs on CUDA tensors, not cpu"):
        tk.flash_attn(q, k, k, backend="sdpa_cudnn")


def test_cpu_varlen_runs_natively():
    q, k = torch.randn(8, 4, 16), torch.randn(8, 2, 16)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    for backend in ("cpu", None):
        choice = tk.attention_backend(q, k, k, cu_seqlens_q=cu, max_seqlen_q=5, max_seqlen_k=5, backend=backend)
        assert choice.backend == "sdpa_flash"


def test_backward_uses_the_forwards_backend():
    # The request is captured at the forward: a forward under use_backend("reference") runs the
    # reference backward too, outside the context; a forward with no request runs the automatic
    # backward even inside use_backend("reference"). Both on the fast path and the op path.
    q, k, v = (torch.randn(1, 20, 2, 16, requires_grad=True) for _ in range(3))
    seen = []
    spy = (R.attention_fwd, lambda *a, **kw: seen.append("reference") or R.attention_bwd(*a, **kw))
    with _backend.replace_impl("flash_attn", "reference", spy):
        for path in ("fast", "op"):
            seen.clear()
            with tk.use_backend("reference"):
                if path == "fast":
                    out = tk.flash_attn(q, k, v)
                else:
                    out = torch.ops.titan.flash_attn(q, k, v, None, None, None, *op_args(0.25), "reference")[0]
            out.sum().backward()
            assert seen == ["reference"], path
            seen.clear()
            if path == "fast":
                out = tk.flash_attn(q, k, v)
            else:  # what the op path is handed when nothing was requested
                out = torch.ops.titan.flash_attn(q, k, v, None, None, None, *op_args(0.25), _backend.AUTO)[0]
            with tk.use_backend("reference"):
                out.sum().backward()
            assert seen == [], path


def test_explicit_backend_refuses_lse_gradient_in_both_paths(libs, monkeypatch):
    # An explicit backend whose backward takes no LSE gradient raises, whichever path ran.
    q, k, v = (torch.randn(1, 20, 2, 16, requires_grad=True) for _ in range(3))
    case = A.make_case(q, k, v, None, AttentionArgs(0.25, right=0, return_lse=True), True, True)
    monkeypatch.setattr(A, "why_not", lambda name, c: "its backward takes no gradient for the LSE"
                        if c.has_dlse and name == "sdpa_flash" else None)
    out, lse = tk.flash_attn(q, k, v, return_lse=True, backend="sdpa_flash")
    with pytest.raises(RuntimeError, match="sdpa_flash.*LSE"):
        (out.sum() + lse.sum()).backward()
    out, lse = torch.ops.titan.flash_attn(q, k, v, None, None, None, *op_args(0.25, return_lse=True), "sdpa_flash")
    with pytest.raises(RuntimeError, match="sdpa_flash.*LSE"):
        (out.sum() + lse.sum()).backward()
    assert case.has_dlse


def test_double_backward_is_refused():
    q, k, v = (torch.randn(1, 10, 2, 16, dtype=torch.float32, requires_grad=True) for _ in range(3))
    for fn in (lambda: tk.flash_attn(q, k, v),
               lambda: torch.ops.titan.flash_attn(q, k, v, None, None, None, *op_args(0.25), None)[0]):
        out = fn()
        with pytest.raises(RuntimeError, match="titan::flash_attn: double backward"):
            torch.autograd.grad(out.sum(), (q, k, v), create_graph=True)


@_triton_on_cpu()
def test_backward_on_another_backend_is_correct():
    # Every backend shares the out/lse conventions, so a backward that runs elsewhere (use_backend
    # around the forward only) is still right: Triton forward, reference backward, via the op path.
    q, k, v = (torch.randn(1, 30, 4, 32, requires_grad=True) for _ in range(3))
    with tk.use_backend("triton"):
        out, lse = torch.ops.titan.flash_attn(q, k, v, None, None, None, *op_args(0.2, return_lse=True), None)
    dout = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    g64 = torch.autograd.grad(dense64(q64, k64, v64, True, 0.2)[0], (q64, k64, v64), dout.double())
    for a, e in zip(g, g64):
        assert rel(a, e) < 1e-5


def test_cuda_order_for_variants(libs, fake_cuda):
    # Windows and soft-capping: FlashAttention natively, else Triton (aten's CUDA kernels refuse with
    # the reason); chunks: FA3's forward only (seq_q == seq_k), its backward and FA2 skip.
    def choose(backward=False, seq_q=64, **mask):
        A.clear_caches()
        case = cuda_case(backward=backward, seq_q=seq_q)
        for name, value in mask.items():
            setattr(case, name, value)
        return A.choose_backend(case)

    assert names(choose(left=127)) == ("fa3", [])
    assert names(choose(softcap=30.0, backward=True)) == ("fa3", [])
    choice = choose(chunk=64, backward=True)
    assert names(choice) == ("triton", ["fa3", "fa2", "sdpa_cudnn", "sdpa_flash"])
    assert "backward takes no attention_chunk" in dict(choice.skipped)["fa3"]
    assert "no chunked attention" in dict(choice.skipped)["fa2"]
    assert "only full or causal" in dict(choice.skipped)["sdpa_cudnn"]
    assert "seq_q == seq_k" in dict(choose(chunk=64, seq_q=32).skipped)["fa3"]
    fake_cuda["cap"] = (8, 0)  # no FA3: FA2 takes soft-capping
    assert names(choose(softcap=5.0)) == ("fa2", ["fa3"])
    fake_cuda["cap"] = (7, 5)  # no FlashAttention at all: Triton
    choice = choose(softcap=5.0)
    assert choice.backend == "triton" and "soft-capping" in dict(choice.skipped)["sdpa_cudnn"]


def test_plain_calls_decide_once_per_case_and_still_follow_the_request():
    # The plain dense call caches its validation, record and dispatch key per case (api._plain_plans);
    # the backend is still chosen per call under the request in force, and a bad call of a cached
    # shape still raises.
    from titan_kernels.ops.attention import api

    q, k, v = (torch.randn(1, 9, 4, 16) for _ in range(3))
    api._plain_plans.clear()
    first = tk.flash_attn(q, k, v)
    assert len(api._plain_plans) == 1
    seen = []
    spy = (lambda *a, **kw: seen.append(1) or R.attention_fwd(*a, **kw), R.attention_bwd)
    with _backend.replace_impl("flash_attn", "reference", spy):
        with tk.use_backend("reference"):
            again = tk.flash_attn(q, k, v)
        tk.flash_attn(q, k, v)
    assert seen == [1] and len(api._plain_plans) == 1
    torch.testing.assert_close(again, first)
    with pytest.raises(TypeError, match="k: expected dtype"):
        tk.flash_attn(q, k.double(), v)
    with pytest.raises(TypeError, match="softmax_scale"):
        tk.flash_attn(q, k, v, softmax_scale=[0.5])
    with pytest.raises(ValueError, match="softmax_scale"):
        tk.flash_attn(q, k, v, softmax_scale=-1.0)
    assert len(api._plain_plans) == 1
