"""Helpers shared by every op module: input validation, the eager fast path test, the refusals of
double backward and the replication of index tensors next to a DTensor."""
from __future__ import annotations

import math

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def dtype_name(dtype: object) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: a dtype as the errors and cache keys name it."""
    return str(dtype).replace("torch.", "")


def check_tensor(t: object, arg: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{arg}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def check_float(t: torch.Tensor, arg: str, dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES) -> None:
    check_tensor(t, arg)
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{arg}: expected dtype in ({names}), got {str(t.dtype).replace('torch.', '')}")


def check_same_device(arg_tensors: dict[str, torch.Tensor | None]) -> None:
    items = [(k, v) for k, v in arg_tensors.items() if v is not None]
    if not items:
        return
    name0, t0 = items[0]
    for name, t in items[1:]:
        if t.device != t0.device:
            raise ValueError(f"{name}: expected device {t0.device} (the device of {name0}), got {t.device}")


def check_eps(eps: object, arg: str = "eps") -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"{arg}: expected a float, got {type(eps).__name__}")
    eps = float(eps)
    if not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"{arg}: expected a finite value > 0, got {eps}")
    return eps


_PLAIN = (torch.Tensor, torch.nn.Parameter)


OP_PATH, FAST, FAST_GRAD = 0, 1, 2  # eager_route's answers


def eager_route(tensors: tuple) -> int:
    """How an op call on ``tensors`` runs: ``OP_PATH`` (through the registered ``torch.ops.titan`` op,
    whose fake, autograd and sharding rules handle it), ``FAST`` (its implementation called directly)
    or ``FAST_GRAD`` (directly, through the op's ``autograd.Function``: autograd records the call).

    The direct call (about a third of a ``custom_op`` call's Python cost) is allowed only in plain
    eager mode: nothing is tracing (torch.compile, export, make_fx), no torch-function or dispatch
    mode is active (FakeTensorMode, CommDebugMode, FlopCounterMode...), no functorch transform is on,
    the first tensor is not on the meta device (shapes only: the op's fake answers), and every tensor
    is a plain ``torch.Tensor`` or ``nn.Parameter`` (no DTensor or other subclass; a Parameter
    wrapping a subclass keeps the subclass's type). One pass over the tensors: it runs on every call.
    """
    if torch.compiler.is_compiling():
        return OP_PATH
    return eager_route_untraced(tensors)


def eager_route_untraced(tensors: tuple) -> int:
    """``eager_route`` for a caller that has checked ``torch.compiler.is_compiling()`` already."""
    if (torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled()
            or torch._C._are_functorch_transforms_active()):
        return OP_PATH
    grad = False
    for t in tensors:
        if t is not None:
            if type(t) not in _PLAIN:
                return OP_PATH
            grad = grad or t.requires_grad
    if tensors and tensors[0] is not None and tensors[0].is_meta:
        return OP_PATH
    return FAST_GRAD if grad and torch.is_grad_enabled() else FAST


def eager_fast_path(*tensors: torch.Tensor | None) -> bool:
    """True when an op may skip the dispatcher and call its implementation directly (``eager_route``
    is not ``OP_PATH``)."""
    return eager_route(tensors) != OP_PATH


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """True when autograd records a call on these tensors (None entries ignored)."""
    if torch.is_grad_enabled():
        for t in tensors:  # a loop, not any(generator): this runs on every op call
            if t is not None and t.requires_grad:
                return True
    return False


def refuse_create_graph(name: str, *tensors: torch.Tensor | None, why: str = "") -> None:
    """In the backward of ``titan::{name}``, which has no double backward: raise a RuntimeError naming
    the op when a second derivative is asked for. Grad mode is on inside a backward only under
    create_graph=True; the gradient or a saved input needing grad there means a second derivative.
    ``why``: appended to the message."""
    if needs_grad(*tensors):
        raise RuntimeError(f"titan::{name}: double backward (create_graph=True through {name}) is not implemented{why}")


def refuse_double_backward(name: str, of: str | None = None):
    """The ``register_autograd`` backward of the backward op ``titan::{name}`` (of ``titan::{of}``):
    it raises a RuntimeError naming the op, never a silent zero."""
    msg = f"titan::{name}: double backward{f' of titan::{of}' if of else ''} is not implemented"

    def backward(ctx, *grads):
        raise RuntimeError(msg)

    return backward


def no_setup(ctx, inputs, output) -> None:
    """A ``register_autograd`` setup_context that saves nothing."""


def replicate_like(ref: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` as a replicated DTensor on ``ref``'s mesh when ``ref`` is a DTensor and ``t`` is not (index
    tensors such as the offsets are the same on every rank), else ``t``."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(ref, DTensor) and not isinstance(t, DTensor):
        return DTensor.from_local(t, ref.device_mesh, [Replicate()] * ref.device_mesh.ndim, run_check=False)
    return t


def time_call(fn, device: torch.device, reps: int = 10) -> float:
    """Median seconds of ``fn()`` on ``device`` after 3 warm-up calls (CUDA events; wall clock
    elsewhere): the one-time measurements behind the measured automatic orders."""
    import statistics
    import time

    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
