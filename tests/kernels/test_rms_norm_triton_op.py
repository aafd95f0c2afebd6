"""The triton_op variant of RMSNorm (titan_kernels/ops/rms_norm_triton_op.py), checked without a GPU.

1. Eager results and gradients of ``rms_norm_triton_op`` / ``add_rms_norm_triton_op`` against float64
   on every backend that runs here (Triton in the interpreter on the CPU), so the autograd wiring and
   the shared launcher are right.
2. Tracing with fake CUDA tensors (a subprocess with TRITON_INTERPRET=0, Triton's NVIDIA backend
   standing in for the driver at sm_90): AOT autograd decomposes the variant into
   ``triton_kernel_wrapper_functional`` nodes for our forward and backward kernels, with only the
   kernels' fresh outputs in ``tensors_to_clone`` (Inductor sees that the inputs are only read), and
   the public ``rms_norm`` routes there only when asked (``enable_triton_op()``); otherwise
   the graph holds the opaque custom op.

Not checkable here: ``opcheck`` and ``torch.compile`` of the variant (the interpreter would run the
kernel on fake tensors, FIELD-NOTES) and its speed: bench/run_gpu.sh compiles both variants with
``fullgraph=True`` on the GPU and times them.

Run the trace by hand: ``python -m tests.kernels.test_rms_norm_triton_op``.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from titan_kernels import backend
from tests.conftest import TEST_DEVICE
from tests.kernels.helpers import TOL, backends_here, rel_err

ROOT = pathlib.Path(__file__).resolve().parents[2]
def f64_rms_norm(h, w, eps):
    h64 = h.double()
    return h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("be", backends_here())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(7, 40), (2, 3, 96), (0, 24)], ids=["2d", "3d", "empty"])
def test_triton_op_matches_float64(be, dtype, shape):
    from titan_kernels.ops.rms_norm_triton_op import rms_norm_triton_op

    x = (torch.randn(*shape, dtype=torch.float64) + 0.1).to(dtype).to(TEST_DEVICE).requires_grad_()
    w = (torch.rand(shape[-1], dtype=torch.float64) + 0.5).to(dtype).to(TEST_DEVICE).requires_grad_()
    g = torch.randn(shape, dtype=torch.float64).to(dtype).to(TEST_DEVICE)
    with backend.use_backend(be):
        y = rms_norm_triton_op(x, w, 1e-6)
        dx, dw = torch.autograd.grad(y, (x, w), g)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = f64_rms_norm(x64, w64, 1e-6)
    dx64, dw64 = torch.autograd.grad(y64, (x64, w64), g.double())
    assert y.dtype == dtype and y.shape == x.shape
    for name, ours, want in (("y", y, y64), ("dx", dx, dx64), ("dw", dw, dw64)):
        assert rel_err(ours, want) <= TOL[dtype], (name, rel_err(ours, want))


@pytest.mark.parametrize("be", backends_here())
def test_add_triton_op_matches_float64_on_a_transposed_input(be):
    from titan_kernels.ops.rms_norm_triton_op import add_rms_norm_triton_op

    x = torch.randn(40, 9, dtype=torch.float64).float().to(TEST_DEVICE).t().requires_grad_()  # (9, 40), strided
    r = torch.randn(9, 40, dtype=torch.float64).float().to(TEST_DEVICE).requires_grad_()
    w = (torch.rand(40, dtype=torch.float64) + 0.5).float().to(TEST_DEVICE).requires_grad_()
    gy, gh = torch.randn(9, 40).to(TEST_DEVICE), torch.randn(9, 40).to(TEST_DEVICE)
    with backend.use_backend(be):
        y, h = add_rms_norm_triton_op(x, r, w, 1e-5)
        grads = torch.autograd.grad((y, h), (x, r, w), (gy, gh))
    x64, r64, w64 = (t.detach().double().requires_grad_() for t in (x, r, w))
    h64 = x64 + r64
    y64 = f64_rms_norm(h64, w64, 1e-5)
    want = torch.autograd.grad((y64, h64), (x64, r64, w64), (gy.double(), gh.double()))
    assert rel_err(y, y64) <= 1e-5 and rel_err(h, h64) <= 1e-6
    for ours, ref in zip(grads, want):
        assert rel_err(ours, ref) <= 1e-5


def test_triton_op_validates_like_the_custom_op():
    from titan_kernels.ops.rms_norm_triton_op import rms_norm_triton_op

    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton_op(torch.randn(4, 8), torch.randn(7))
    with pytest.raises(TypeError, match="x"):
        rms_norm_triton_op(torch.ones(4, 8, dtype=torch.int32), None)
    with pytest.raises(ValueError, match="eps"):
        rms_norm_triton_op(torch.randn(4, 8), None, 0.0)


# --------------------------------------------------------------------------- tracing with fake CUDA tensors


def _trace_report() -> dict:
    """Trace the variant and the custom op with fake CUDA tensors; a summary of each graph."""
    import triton
    from torch._functorch.aot_autograd import aot_function
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    from triton.backends.compiler import GPUTarget

    import titan_kernels as tk
    from titan_kernels.ops import rms_norm as rn
    from titan_kernels.triton import rms_norm as tri

    tk.enable_triton_op()  # registers the variant (titan_kernels does not import Inductor by itself)

    class Sm90Target:
        """What torch's kernel analysis asks of the active driver: the target to lower for."""

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def is_active(self):
            return True

    triton.runtime.driver.set_active(Sm90Target())
    from titan_kernels.backend import status

    real_status = status.family_status
    status.family_status = lambda name, dev, interp: (
        backend.BackendStatus(name, True) if (name == "triton" and dev == "cuda") else real_status(name, dev, interp))
    backend.clear_choices()
    tri._num_programs = lambda device, n_tiles: max(1, min(n_tiles, 2 * 132))  # no device to ask its SM count

    def summary(gm) -> dict:
        nodes = []
        for n in gm.graph.nodes:
            if n.op != "call_function":
                continue
            if "triton_kernel_wrapper" in str(n.target):
                kernel = kernel_side_table.get_kernel(n.kwargs["kernel_idx"])
                fn = getattr(kernel, "fn", kernel)
                nodes.append({"triton": fn.__name__, "clone": sorted(n.kwargs["tensors_to_clone"])})
            else:
                nodes.append({"op": str(n.target)})
        return {"nodes": nodes}

    mode = FakeTensorMode()
    with mode:
        x = torch.empty(6, 4, 512, device="cuda", dtype=torch.bfloat16)
        r = torch.empty(6, 4, 512, device="cuda", dtype=torch.bfloat16)
        w = torch.empty(512, device="cuda", dtype=torch.bfloat16)
        rstd = torch.empty(6, 4, device="cuda", dtype=torch.float32)

    cases = {
        "rms_norm": lambda x, r, w, s: tk.rms_norm(x, w, 1e-6),
        "add_rms_norm": lambda x, r, w, s: tk.add_rms_norm(x, r, w, 1e-6),
        "backward": lambda x, r, w, s: torch.ops.titan.rms_norm_backward_triton(x, r, w, s, None, True),
        "backward_dres": lambda x, r, w, s: torch.ops.titan.rms_norm_backward_triton(x, r, w, s, x, False),
    }
    out = {}
    with tk.use_backend("triton"):
        for routed in (True, False):
            rn.set_triton_op_route(routed)
            for name, f in cases.items():
                if not routed and name.startswith("backward"):
                    continue
                graphs = {}

                def capture(gm, inputs, graphs=graphs):
                    graphs["fw"] = gm
                    return gm

                compiled = aot_function(f, fw_compiler=capture)
                try:
                    with mode:
                        compiled(x, r, w, rstd)
                except RuntimeError as e:  # running the traced graph needs a CUDA build; the graph is what we test
                    if "cuda" not in str(e).lower():
                        raise
                out[f"{name}{'' if routed else ' (custom op)'}"] = summary(graphs["fw"])
    return out


def main() -> None:
    os.environ["TRITON_INTERPRET"] = "0"
    print(json.dumps(_trace_report()))


@pytest.fixture(scope="module")
def trace() -> dict:
    import importlib.util

    import triton

    if not (pathlib.Path(triton.__file__).parent / "backends" / "nvidia").is_dir():
        pytest.skip("this Triton build has no NVIDIA backend to lower the kernels for the analysis")
    if importlib.util.find_spec("torch._higher_order_ops.triton_kernel_wrap") is None:
        pytest.skip(f"torch {torch.__version__} has no triton_kernel_wrap")
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT), TITAN_KERNELS_TRITON_OP="0")
    r = subprocess.run([sys.executable, "-m", "tests.kernels.test_rms_norm_triton_op"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _kernels(graph: dict) -> list[dict]:
    return [n for n in graph["nodes"] if "triton" in n]


def _ops(graph: dict) -> list[str]:
    return [n["op"] for n in graph["nodes"] if "op" in n]


def test_trace_sees_the_forward_kernels(trace):
    for name, outputs in (("rms_norm", ["RSTD", "Y"]), ("add_rms_norm", ["H", "RSTD", "Y"])):
        kernels = _kernels(trace[name])
        assert [k["triton"] for k in kernels] == ["_rms_norm_fwd_kernel"], (name, trace[name])
        # Only the fresh outputs are written: X, R and W are read in place, never copied.
        assert kernels[0]["clone"] == outputs, (name, kernels[0])
        assert not any("titan." in op for op in _ops(trace[name])), (name, _ops(trace[name]))


def test_trace_sees_the_backward_kernel_and_the_dweight_sum(trace):
    for name, outputs in (("backward", ["DWP", "DX"]), ("backward_dres", ["DX"])):
        kernels = _kernels(trace[name])
        assert [k["triton"] for k in kernels] == ["_rms_norm_bwd_kernel"], (name, trace[name])
        assert kernels[0]["clone"] == outputs, (name, kernels[0])
    # The (programs, N) fp32 partial dweight is summed by an aten op Inductor can fuse with the cast.
    assert "aten.sum.dim_IntList" in _ops(trace["backward"])


def test_without_the_switch_the_graph_keeps_the_custom_op(trace):
    for name in ("rms_norm", "add_rms_norm"):
        graph = trace[f"{name} (custom op)"]
        assert not _kernels(graph), graph
        assert f"titan.{name}.default" in _ops(graph), graph


if __name__ == "__main__":
    main()
