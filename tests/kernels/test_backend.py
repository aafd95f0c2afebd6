"""The one backend registry (``titan_kernels.backend``): precedence, families and named implementations,
the automatic order with capability and auto predicates, cached choices, recorded failures, errors.

A toy op registered for the test (and removed after) keeps the checks independent of which real
kernels this machine has.
"""
from __future__ import annotations

import pytest
import torch

import titan_kernels as tk
from titan_kernels import backend

OP = "toy_op_for_test_backend"
CPU = torch.device("cpu")


def _kernel(name: str):
    """A stand-in kernel that says which it is."""
    def kernel():
        return name

    return kernel


REF, FAST, CPU_FN, GPU, SPY = map(_kernel, ("ref", "fast", "cpu", "gpu", "spy"))


@pytest.fixture
def toy():
    """A toy op: reference; two CPU implementations "fast" (refuses odd keys; passed over
    automatically for key 'slow') and "cpu"; a CUDA-only "gpu"; counts the capability probes."""
    probes = []

    def fast_why_not(device, case):
        probes.append(case)
        return "odd keys are not taken" if isinstance(case, int) and case % 2 else None

    backend.register_impl(OP, "reference", REF)
    backend.register_impl(OP, "cpu", FAST, name="fast", why_not=fast_why_not,
                          auto=lambda device, case: "measured slower here" if case == "slow" else None)
    backend.register_impl(OP, "cpu", CPU_FN, why_not=lambda device, case: None)
    backend.register_impl(OP, "cuda", GPU, name="gpu", why_not=lambda device, case: None)
    backend.set_order(OP, {"cpu": ("fast", "cpu", "reference")}, hint="ask for 'reference'")
    try:
        yield probes
    finally:
        backend.unregister(OP)


def test_automatic_order_and_skips(toy):
    c = backend.choose(OP, CPU, 2)
    assert (c.backend, c.family, c.kernels.forward, c.explicit) == ("fast", "cpu", FAST, False)
    c = backend.choose(OP, CPU, 3)  # fast refuses: the next one, with the reason kept
    assert c.backend == "cpu" and c.skipped == (("fast", "odd keys are not taken"),)
    c = backend.choose(OP, CPU, "slow")  # fast can run but the automatic choice passes it over
    assert c.backend == "cpu" and c.skipped == (("fast", "measured slower here"),)
    assert "that takes this case" in c.reason and str(c).startswith("cpu: ")


def test_choices_are_cached_per_key(toy):
    for _ in range(5):
        backend.choose(OP, CPU, 2)
        backend.choose(OP, CPU, 4)
    assert toy == [2, 4]  # one probe per key
    backend.clear_choices()
    backend.choose(OP, CPU, 2)
    assert toy == [2, 4, 2]


def test_precedence(toy, backend_env):
    backend_env("reference")
    assert backend.choose(OP, CPU, 2).backend == "reference"
    with tk.use_backend("cpu"):  # the context beats the environment; a family: its implementations in order
        c = backend.choose(OP, CPU, 2)
        assert (c.backend, c.explicit) == ("fast", True) and "use_backend('cpu')" in c.reason
        assert backend.choose(OP, CPU, 3).backend == "cpu"  # fast refuses, the family's next one runs
        assert backend.choose(OP, CPU, "slow").backend == "fast"  # asked for: taken even where slower
        assert backend.choose(OP, CPU, 2, backend="reference").backend == "reference"  # the argument wins
        assert backend.choose(OP, CPU, 2, backend=backend.AUTO).backend == "fast"  # AUTO: whatever the context
    backend_env(None)
    assert backend.choose(OP, CPU, 2).backend == "fast"


def test_named_implementation_requests(toy):
    assert backend.choose(OP, CPU, 2, backend="cpu").backend == "fast"
    assert backend.choose(OP, CPU, 2, backend="fast").backend == "fast"
    with pytest.raises(RuntimeError, match=r"backend 'fast' cannot run titan op '.*' on cpu \(requested by "
                                           r"backend='fast'\): odd keys are not taken"):
        backend.choose(OP, CPU, 3, backend="fast")
    with pytest.raises(RuntimeError, match="'gpu'.*runs on CUDA tensors, not cpu"):
        backend.choose(OP, CPU, 2, backend="gpu")
    with pytest.raises(RuntimeError, match="backend 'cuda' runs on cuda tensors, got cpu tensors"):
        backend.choose(OP, CPU, 2, backend="cuda")
    with pytest.raises(RuntimeError, match="does not implement titan op .*implemented: "):
        backend.choose(OP, CPU, 2, backend="triton")
    with pytest.raises(ValueError, match="backend: expected one of"):
        backend.choose(OP, CPU, 2, backend="nonsense")
    # A context naming another op's own implementation applies to that op only: here, automatic.
    with tk.use_backend("sdpa_flash"):
        assert backend.choose(OP, CPU, 2).backend == "fast"
    with pytest.raises(RuntimeError, match="does not implement"):
        backend.choose(OP, CPU, 2, backend="sdpa_flash")


def test_no_candidate_names_every_reason_and_the_hint(toy):
    backend.set_order(OP, {"cpu": ("fast",)})
    with pytest.raises(RuntimeError, match=r"no backend can run titan op .* on cpu \(fast: odd keys are not "
                                           r"taken\); ask for 'reference'"):
        backend.choose(OP, CPU, 3)


def test_failures_are_recorded_and_passed_over(toy):
    c = backend.choose(OP, CPU, 2)
    with pytest.warns(RuntimeWarning, match="'fast' raised at run time: RuntimeError: no kernel image"):
        backend.mark_failed(OP, c, CPU, 2, RuntimeError("no kernel image\nmore"))
    c = backend.choose(OP, CPU, 2)
    assert c.backend == "cpu" and "raised at run time" in dict(c.skipped)["fast"]
    assert backend.choose(OP, CPU, 4).backend == "fast"  # other keys are not affected


def test_replace_impl_swaps_and_restores(toy):
    with backend.replace_impl(OP, "fast", SPY) as old:
        assert old.forward is FAST and backend.kernels(OP, CPU, key=2).forward is SPY
    assert backend.kernels(OP, CPU, key=2).forward is FAST
    assert backend.implementation(OP, "fast").kernels.forward is FAST
    with pytest.raises(KeyError, match="no implementation 'nope'"):
        with backend.replace_impl(OP, "nope", SPY):
            pass


def test_rank_reorders_the_runnable_candidates(toy):
    seen = []

    def rank(device, case, names):
        seen.append(names)
        return tuple(reversed(names))

    backend.set_order(OP, {"cpu": ("fast", "cpu", "reference")}, rank=rank)
    assert backend.choose(OP, CPU, 2).backend == "reference"
    assert seen == [("fast", "cpu", "reference")]


def test_every_op_is_registered_with_the_one_registry():
    import titan_kernels.ops  # noqa: F401  (registers every op)

    for op in ("rms_norm", "rotary", "swiglu", "flash_attn", "fp8_gemm", "fp8_quantize", "grouped_mm",
               "moe_permute", "linear_cross_entropy"):
        assert backend.implemented_backends(op), op
        assert "reference" in backend.implementation_names(op), op
    assert "scaled_mm" in backend.implementation_names("fp8_gemm")
    assert {"sdpa_flash", "fa3", "fa2"} <= set(backend.implementation_names("flash_attn"))


def test_a_context_request_applies_to_the_ops_that_have_it(toy):
    # A family or name an op lacks: that op chooses automatically (its backward too); an op's own
    # backend= argument naming it still raises (test_named_implementation_requests).
    with tk.use_backend("gpu"):  # the toy op's own name: taken (and refused on CPU tensors) by the toy op
        with pytest.raises(RuntimeError, match="'gpu'.*runs on CUDA tensors"):
            backend.choose(OP, CPU, 2)
        assert backend.requested_backend("rms_norm") is None and backend.requested_backend(OP) == "gpu"
    assert "triton" not in backend.implementation_names(OP)
    with tk.use_backend("triton"):
        assert backend.choose(OP, CPU, 2).backend == "fast"
        assert backend.capture_request(OP) == backend.AUTO  # what the forward hands its backward
    x, w = torch.randn(4, 8), torch.ones(8, requires_grad=True)
    q = torch.randn(1, 4, 2, 8)
    cos, sin = tk.rope_cos_sin(8, 4)
    h, wv = torch.randn(6, 8, requires_grad=True), torch.randn(11, 8, requires_grad=True)
    labels = torch.randint(0, 11, (6,))
    with tk.use_backend("sdpa_flash"):  # attention's own: rotary and rms_norm (with its backward) choose themselves
        ref = tk.apply_rotary_emb(q, q, cos, sin)
        tk.rms_norm(x, w).sum().backward()
        out = tk.flash_attn(q, q, q)
    torch.testing.assert_close(ref, tk.apply_rotary_emb(q, q, cos, sin))
    torch.testing.assert_close(out, tk.flash_attn(q, q, q, backend="sdpa_flash"))
    with tk.use_backend("cpu"):  # linear_cross_entropy has no native CPU kernel: automatic
        tk.linear_cross_entropy(h, wv, labels).backward()
    assert h.grad is not None and torch.isfinite(h.grad).all()


def test_a_kernel_module_that_does_not_import_is_a_reason_not_a_traceback():
    # Triton kernels register as LazyKernel (imported at the first call, not by ``import titan_kernels``):
    # a module that does not import is why the implementation cannot run, named in the refusal.
    from titan_kernels.backend import LazyKernel

    bad = LazyKernel("titan_kernels.triton.no_such_kernels", "fwd")
    assert "no_such_kernels does not import" in bad.why_not()
    with pytest.raises(RuntimeError, match="no_such_kernels does not import"):
        bad(torch.ones(1))
    x, w = torch.randn(3, 16), torch.randn(16)
    with backend.replace_impl("rms_norm", "reference", (bad, bad)):
        with pytest.raises(RuntimeError, match="cannot run titan op 'rms_norm'.*no_such_kernels does not import"):
            with backend.use_backend("reference"):
                tk.rms_norm(x, w)
    good = LazyKernel("titan_kernels.reference.rms_norm", "rms_norm_fwd")
    assert good.why_not() is None and callable(good.fn)


def test_every_op_registers_through_its_op():
    # One extension idiom (DESIGN.md section 2): an op module registers its implementations and its
    # order through its ``Op`` (register*, set_order), never through the registry's functions directly.
    import ast
    import pathlib

    ops = pathlib.Path(tk.__file__).parent / "ops"
    direct = []
    for path in sorted(ops.rglob("*.py")):
        if path.name == "_scaffold.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in ("register_impl", "set_order") \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in ("_backend", "backend", "registry"):
                direct.append(f"{path.relative_to(ops)}:{node.lineno} {node.func.value.id}.{node.func.attr}")
    assert not direct, "registered around the op's Op:\n" + "\n".join(direct)
