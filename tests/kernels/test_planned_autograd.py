"""The autograd of ``tk.flash_attn``'s eager planned call (plain tensors, a gradient recorded, full or
causal): its two carriers of the op's one setup and grads, the native node
(``titan_kernels._C.autograd_apply``, csrc/autograd_node.cpp) and the autograd.Function (where the
extension is not built), against float64 and against each other, and what a node of the autograd
graph must do: saved-tensor hooks (activation offload), checkpointing, retain_graph, the errors of a
second backward, of an input modified in place, of double backward and of forward-mode AD, a Python
exception in the backward reaching the caller as itself, and no reference cycle keeping the graph.

The native carrier is tested where the extension is built (CI: ``TITAN_KERNELS_REQUIRE_NATIVE=1``,
where its absence fails); the Function carrier everywhere.
"""
from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch

import titan_kernels as tk
from titan_kernels import _native
from titan_kernels.ops import _scaffold
from titan_kernels.ops.attention import op as attention_op
from tests.kernels.attention_ref import attention_tol, dense64, grads, rel

_NATIVE = _native.autograd_apply() is not None
if not _NATIVE and os.environ.get("TITAN_KERNELS_REQUIRE_NATIVE") == "1":
    raise RuntimeError("TITAN_KERNELS_REQUIRE_NATIVE=1 but the native extension has no autograd_apply: "
                       f"{_native.status('cpu')[1]}")
_DEF = attention_op.flash_attn_def
CARRIERS = [pytest.param("native", marks=pytest.mark.skipif(not _NATIVE, reason="the native extension is not built")),
            "function"]


@pytest.fixture(params=CARRIERS)
def carrier(request, monkeypatch):
    """Every planned call in the test goes through this carrier."""
    d = _DEF._forward
    apply = _scaffold.planned_carrier(d) if request.param == "native" else d.planned_apply
    monkeypatch.setattr(_DEF, "eager_apply", apply)
    return request.param


def _qkv(b, sq, sk, h, h_kv, d, grad=(True, True, True)):
    torch.manual_seed(sq * 31 + sk)
    return [torch.randn(b, s, n, d).requires_grad_(g) for s, n, g in ((sq, h, grad[0]), (sk, h_kv, grad[1]),
                                                                     (sk, h_kv, grad[2]))]


@pytest.mark.parametrize("shape", [(2, 13, 13, 6, 2, 24), (1, 1, 1, 1, 1, 8), (3, 70, 70, 4, 4, 40)],
                         ids=["gqa_odd", "one_token", "long"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("return_lse", [False, True])
def test_against_float64(carrier, shape, causal, return_lse):
    b, sq, sk, h, h_kv, d = shape
    q, k, v = _qkv(b, sq, sk, h, h_kv, d)
    dout = torch.randn(b, sq, h, d)
    dlse = torch.randn(b, h, sq) if return_lse else None

    def run(q, k, v):
        return tk.flash_attn(q, k, v, causal=causal, return_lse=return_lse)

    outs, g = grads(run, (q, k, v), (dout, dlse))
    assert outs[0].grad_fn is not None
    if carrier == "native":
        assert outs[0].grad_fn.name() == "titan::flash_attnBackward"
    else:
        assert type(outs[0].grad_fn).__name__ == "flash_attn_plannedBackward"
    outs64, g64 = grads(lambda q, k, v: dense64(q, k, v, causal, d ** -0.5), [t.double() for t in (q, k, v)],
                        (dout.double(), None if dlse is None else dlse.double()))
    assert rel(outs[0], outs64[0]) < attention_tol(torch.float32, sq, sk, d)
    if return_lse:
        assert (outs[1].double() - outs64[1]).abs().max().item() < 1e-5
    for name, got, want in zip("qkv", g, g64):
        assert rel(got, want) < attention_tol(torch.float32, sq, sk, d, grad=True), name


def test_carriers_agree_bitwise_and_on_strided_inputs(monkeypatch):
    if not _NATIVE:
        pytest.skip("the native extension is not built")
    # (b, s, h, d) views of a (b, h, s, d) buffer: the kernel takes them without a copy
    base = [torch.randn(2, 5, 11, 16) for _ in range(3)]
    results = []
    for apply in (_scaffold.planned_carrier(_DEF._forward), _DEF._forward.planned_apply):
        monkeypatch.setattr(_DEF, "eager_apply", apply)
        q, k, v = (t.clone().requires_grad_() for t in base)
        out = tk.flash_attn(*(t.transpose(1, 2) for t in (q, k, v)), causal=True)
        out.backward(torch.ones_like(out))
        results.append((out.detach(), q.grad, k.grad, v.grad))
    for native, function in zip(*results):
        assert torch.equal(native, function)


def test_only_some_inputs_need_grad(carrier):
    q, k, v = _qkv(1, 9, 9, 2, 2, 16, grad=(False, True, False))
    out = tk.flash_attn(q, k, v)
    out.sum().backward()
    assert q.grad is None and v.grad is None and k.grad is not None and k.grad.abs().sum() > 0


def test_saved_tensor_hooks_see_every_saved_tensor(carrier):
    # Activation offload packs saved tensors into another place and unpacks them for the backward.
    q, k, v = _qkv(2, 7, 7, 4, 2, 16)
    want = torch.autograd.grad(tk.flash_attn(q, k, v).square().sum(), (q, k, v))
    packed, unpacked = [], []

    def pack(t):
        packed.append(t.shape)
        return t.clone()  # (a copy: the backward must use what unpack gives)

    def unpack(t):
        unpacked.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = tk.flash_attn(q, k, v)
    got = torch.autograd.grad(out.square().sum(), (q, k, v))
    # q, k, v, out and the lse: every tensor the backward uses
    assert len(packed) == 5 and sorted(unpacked) == sorted(packed)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_checkpoint_recomputes_to_the_same_gradients(carrier):
    from torch.utils.checkpoint import checkpoint

    q, k, v = _qkv(1, 12, 12, 2, 1, 16)

    def block(q, k, v):
        return tk.flash_attn(q * 1.5, k, v).tanh()

    want = torch.autograd.grad(block(q, k, v).sum(), (q, k, v))
    got = torch.autograd.grad(checkpoint(block, q, k, v, use_reentrant=False).sum(), (q, k, v))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_retain_graph_and_a_second_backward(carrier):
    q, k, v = _qkv(1, 6, 6, 2, 2, 8)
    out = tk.flash_attn(q, k, v)
    out.sum().backward(retain_graph=True)
    first = q.grad.clone()
    out.sum().backward()
    torch.testing.assert_close(q.grad, 2 * first)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        out.sum().backward()


def test_input_modified_in_place_is_refused(carrier):
    q, k, v = _qkv(1, 6, 6, 2, 2, 8)
    x = q * 1.0
    out = tk.flash_attn(x, k, v)
    with torch.no_grad():
        x.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_double_backward_is_refused_by_the_op(carrier):
    q, k, v = _qkv(1, 6, 6, 2, 2, 8)
    out = tk.flash_attn(q, k, v)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out.sum(), q, create_graph=True)


def test_forward_mode_ad_is_refused(carrier):
    import torch.autograd.forward_ad as fwAD

    q, k, v = _qkv(1, 6, 6, 2, 2, 8)
    with fwAD.dual_level():
        dual = fwAD.make_dual(q, torch.randn_like(q))
        # (the native node names the op; torch's Function says it lacks a jvp)
        error, message = ((RuntimeError, "titan::flash_attn: forward-mode AD") if carrier == "native"
                          else (NotImplementedError, "must implement the jvp function"))
        with pytest.raises(error, match=message):
            tk.flash_attn(dual, k, v)


def test_an_exception_in_the_backward_reaches_the_caller(carrier, monkeypatch):
    class Boom(Exception):
        pass

    def grads(*args, **kwargs):
        raise Boom("from the backward")

    q, k, v = _qkv(1, 6, 6, 2, 2, 8)
    out = tk.flash_attn(q, k, v)
    monkeypatch.setattr(attention_op, "run_backward", grads)
    with pytest.raises(Boom, match="from the backward"):
        out.sum().backward()


def test_the_graph_is_freed_with_its_outputs(carrier):
    # No reference cycle between the node, its context and the saved tensors: once the output (the
    # graph's only owner) is gone, so is a non-leaf input the node saved.
    q, k, v = _qkv(1, 6, 6, 2, 2, 8)
    x = q * 2.0
    out = tk.flash_attn(x, k, v)
    ref = weakref.ref(x)
    del x
    assert ref() is not None
    gc.disable()  # (freed by reference counting, not by the cycle collector)
    try:
        del out
        assert ref() is None
    finally:
        gc.enable()


def test_threads_differentiate_one_retained_graph_at_once(carrier):
    # Thread A is held on entering the op's grads (before it reads ctx.saved_tensors) while thread B
    # runs the same node to its end: each backward call has its own saved tensors (the native node
    # never writes them onto the shared ctx).
    import sys
    import threading
    import time

    q, k, v = _qkv(1, 4, 4, 1, 1, 8)
    out = tk.flash_attn(q, k, v)
    want = torch.autograd.grad(out.sum(), (q,), retain_graph=True)[0]
    inside = threading.Event()

    def hold_in_grads(frame, event, arg):
        if event == "call" and frame.f_code is attention_op._grads.__code__:
            inside.set()
            time.sleep(0.3)  # (the GIL is free: B runs meanwhile)

    got = {}

    def run(name):
        if name == "A":
            sys.settrace(hold_in_grads)
        try:
            got[name] = torch.autograd.grad(out.sum(), (q,), retain_graph=True)[0]
        except Exception as e:  # (reported below, with the thread's name)
            got[name] = e
        finally:
            sys.settrace(None)

    a = threading.Thread(target=run, args=("A",), name="A")
    a.start()
    assert inside.wait(30)
    b = threading.Thread(target=run, args=("B",), name="B")
    b.start()
    b.join(30)
    a.join(30)
    for name in "AB":
        assert isinstance(got[name], torch.Tensor), (name, got[name])
        torch.testing.assert_close(got[name], want, rtol=0, atol=0)


@pytest.mark.parametrize("failure", ["pack_hook", "modified_output"])
def test_a_failing_save_or_backward_leaks_nothing(carrier, failure):
    q, k, v = _qkv(1, 16, 16, 2, 2, 16)
    x = q * 1.0
    ref = weakref.ref(x)
    if failure == "pack_hook":
        calls = []

        def pack(t):
            calls.append(1)
            if len(calls) == 2:
                raise ValueError("pack fails")
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with pytest.raises(ValueError, match="pack fails"):
                tk.flash_attn(x, k, v)
    else:
        out = tk.flash_attn(x, k, v)
        with torch.no_grad():
            out.mul_(2.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()
        del out
    del x
    gc.collect()
    assert ref() is None


def test_compiled_autograd(carrier):
    from torch._dynamo import compiled_autograd

    q, k, v = _qkv(1, 6, 6, 2, 2, 8)
    want = torch.autograd.grad(tk.flash_attn(q, k, v).sum(), (q, k, v))
    # On around the forward too (as a training step enables it): the node is one it can trace.
    with compiled_autograd._enable(torch.compile(backend="eager")):
        tk.flash_attn(q, k, v).sum().backward()
    for t, w in zip((q, k, v), want):
        torch.testing.assert_close(t.grad, w)
    if carrier == "native":
        # On only at the backward of a node recorded without it: refused, saying what to do.
        out = tk.flash_attn(q, k, v)
        with compiled_autograd._enable(torch.compile(backend="eager")):
            with pytest.raises(RuntimeError, match="compiled autograd cannot trace this node"):
                out.sum().backward()


def test_a_gradient_of_the_wrong_shape_is_refused():
    # autograd checks the gradients it passes; a direct call of the backward op's body (or of the
    # native node, whose grad_fn is callable) is checked by the op: a clear error, never a read past
    # dout's end.
    q, k, v = _qkv(1, 16, 16, 2, 2, 8)
    with torch.no_grad():
        out, lse = tk.flash_attn(q, k, v, return_lse=True)
        flat = (0, 0, 8 ** -0.5, -1, 0, 0.0, 0, True)
        with pytest.raises(ValueError, match=r"dout: expected shape \(1, 16, 2, 8\)"):
            attention_op.backward(torch.ones(1, 1, 1, 8), q, k, v, out, lse, None, None, None, None, *flat)
        with pytest.raises(ValueError, match=r"dlse: expected shape \(1, 2, 16\)"):
            attention_op.backward(torch.ones_like(out), q, k, v, out, lse, torch.ones(1, 16), None, None, None, *flat)
    if _NATIVE:
        out = tk.flash_attn(q, k, v)
        assert out.grad_fn.name() == "titan::flash_attnBackward"
        with torch.no_grad(), pytest.raises(ValueError, match=r"dout: expected shape \(1, 16, 2, 8\)"):
            out.grad_fn(torch.ones(1, 1, 1, 8))
