"""RMSNorm as ``torch.library.triton_op``: the variant of ``torch.ops.titan.rms_norm`` that Inductor
traces into.

Ops: ``titan::rms_norm_triton``, ``titan::add_rms_norm_triton`` and their backward
``titan::rms_norm_backward_triton``, with the schemas, shapes, dtypes and math of ``titan::rms_norm``,
``titan::add_rms_norm`` and ``titan::rms_norm_backward`` (``titan_kernels.ops.rms_norm``).

Why: a ``custom_op`` is opaque to Inductor: the compiled graph calls back into the Python op, which
picks the backend and launches the kernel. A ``triton_op`` launches its kernels through
``torch.library.wrap_triton``; AOT autograd decomposes it into ``triton_kernel_wrapper_functional``
nodes, so Inductor sees which buffers each kernel reads and writes, plans their memory, and launches
the kernel from its generated wrapper without Python dispatch (the same launcher,
``titan_kernels.triton.rms_norm``, and the same kernels as the ``triton`` backend).

Backend: the body resolves it as the custom op does (``titan_kernels.backend``), but when it is
traced, so under torch.compile the choice is fixed at compile time. With the ``triton`` backend the
kernels are wrapped; any other backend's implementation (reference math, the native ops) is called
as is and traced like any torch code.

When it is used: ``rms_norm`` / ``add_rms_norm`` route here instead of the custom op when they are
not on the eager fast path (compiling, exporting, under a mode), the tensors are plain CUDA tensors
(DTensor keeps the custom op, which has the sharding rules) and the route is on: ``enable_triton_op()``
(``titan_kernels.ops.triton_op``), or ``TITAN_KERNELS_TRITON_OP=1`` set when ``titan_kernels`` is
imported. This module imports Inductor, so ``titan_kernels`` imports it only then. Default off: the custom op stays until the GPU run
(bench/run_gpu.sh, headline stage) shows that the triton_op pays. ``rms_norm_triton_op`` and
``add_rms_norm_triton_op`` call this variant directly.

Autograd: the same save and gradient functions as the custom op (``titan_kernels.ops.rms_norm``),
with ``titan::rms_norm_backward_triton`` as the backward op.

What the CPU can check (tests/kernels/test_rms_norm_triton_op.py): eager results on CPU tensors under
the Triton interpreter against float64, and the AOT forward and backward graphs traced with fake CUDA
tensors (Triton kernel nodes, no opaque op, inputs not cloned). ``opcheck`` and ``torch.compile`` on
CPU tensors fail, because the interpreter would run the kernel on fake tensors (FIELD-NOTES).
"""
from __future__ import annotations

import inspect

import torch
from torch.library import triton_op, wrap_triton

from titan_kernels import backend as _backend
from titan_kernels.ops import rms_norm as _rn


def _launch_wrapper(device: torch.device, backend: str | None = None):
    """(fwd, bwd, wrap): the implementation chosen for ``device`` (``backend``: the forward's request,
    None: the current one) and whether its launches are wrapped."""
    choice = _backend.choose(_rn.OP, device, backend=backend)
    return choice.kernels.forward, choice.kernels.backward, (wrap_triton if choice.family == "triton" else None)


def _fwd(x, residual, weight, eps):
    fwd, _, wrap = _launch_wrapper(x.device)
    return fwd(x, residual, weight, eps) if wrap is None else fwd(x, residual, weight, eps, wrap=wrap)


@triton_op("titan::rms_norm_triton", mutates_args=())
def rms_norm_triton_def(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``titan::rms_norm``: returns y (..., N) in x.dtype and rstd (...,) float32."""
    y, _, rstd = _fwd(x, None, weight, eps)
    return y, rstd


@triton_op("titan::add_rms_norm_triton", mutates_args=())
def add_rms_norm_triton_def(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As ``titan::add_rms_norm``: returns (y, h = x + residual, rstd)."""
    y, h, rstd = _fwd(x, residual, weight, eps)
    return y, h, rstd


def _backward_body(dy, x, weight, rstd, dresidual, compute_dweight, backend=None):
    """As ``titan::rms_norm_backward`` (its schema): dx (..., N), and dweight (N,) or an empty (0,) tensor."""
    _, bwd, wrap = _launch_wrapper(x.device, backend)
    if wrap is None:
        dx, dw = bwd(dy, x, weight, rstd, dresidual, compute_dweight)
    else:
        dx, dw = bwd(dy, x, weight, rstd, dresidual, compute_dweight, wrap=wrap)
    return dx, _rn.dweight_or_empty(dw, x, weight)


# The schema of titan::rms_norm_backward, declared once there (triton_op infers it from the signature).
_backward_body.__signature__ = inspect.signature(_rn.backward, eval_str=True)
rms_norm_backward_triton_def = triton_op("titan::rms_norm_backward_triton", _backward_body, mutates_args=())


def _setup(save):
    def setup_context(ctx, inputs, output):
        ctx.backend = _backend.capture_request(_rn.OP)
        save(ctx, inputs, output)

    return setup_context


def _backward_triton(*args):
    return torch.ops.titan.rms_norm_backward_triton(*args)


def _grads(ctx, dy, _drstd):
    return (*_rn.gradients(ctx, dy, None, ctx.needs_input_grad[1], _backward_triton), None)


def _add_grads(ctx, dy, dh, _drstd):
    dx, dw = _rn.gradients(ctx, dy, dh, ctx.needs_input_grad[2], _backward_triton)
    return dx, dx, dw, None


rms_norm_triton_def.register_autograd(_grads, setup_context=_setup(_rn.save_rms_norm))
add_rms_norm_triton_def.register_autograd(_add_grads, setup_context=_setup(_rn.save_add_rms_norm))


def rms_norm_triton_op(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """``titan_kernels.rms_norm`` through the triton_op variant, always (also in eager mode).

    Same arguments, result and errors as ``titan_kernels.rms_norm``; DTensor inputs are not supported
    (no sharding rule).
    """
    eps = _rn._validate(x, weight, eps)
    return torch.ops.titan.rms_norm_triton(x, weight, eps)[0]


def add_rms_norm_triton_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """``titan_kernels.add_rms_norm`` through the triton_op variant, always. Returns (normed, h)."""
    _rn.check_tensor(residual, "residual")
    eps = _rn._validate(x, weight, eps, residual)
    y, h, _ = torch.ops.titan.add_rms_norm_triton(x, residual, weight, eps)
    return y, h
