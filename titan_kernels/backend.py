"""Which implementation of an op runs.

Precedence: an explicit ``backend=`` argument > the innermost ``use_backend(...)`` context >
the ``TITAN_KERNELS_BACKEND`` environment variable > the automatic choice.

Backends:
  reference  plain PyTorch, float32 math; runs on every device (ground truth and fallback).
  triton     our Triton kernels; on CUDA, or on CPU tensors when ``TRITON_INTERPRET=1`` is set.
  cpu        C++ kernels from csrc/ for CPU tensors (when the extension is built).
  cuda       CUDA kernels from csrc/ for CUDA tensors (when the extension is built).

Each op registers which backends implement it (``register_impl``); the automatic choice takes
the fastest implemented and available one for the tensor's device. Asking for a backend that
cannot run there raises ``RuntimeError``.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

BACKENDS = ("reference", "triton", "cpu", "cuda")
ENV_VAR = "TITAN_KERNELS_BACKEND"

# Fastest first, per device type.
_AUTO_ORDER = {
    "cuda": ("cuda", "triton", "reference"),
    "cpu": ("cpu", "reference"),
}

_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("titan_backend", default=None)
_AUTOMATIC = "auto"  # the override that means "choose automatically", whatever the environment says
_impls: dict[str, dict[str, Callable]] = {}


@dataclass(frozen=True)
class BackendStatus:
    """Whether one backend can run on a device, and why not when it cannot."""

    name: str
    available: bool
    reason: str = ""


def _check_name(name: str, arg: str = "backend") -> str:
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"{arg}: expected one of {BACKENDS}, got {name!r}")
    return name


def _device_type(device: torch.device | str | None) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


@functools.lru_cache(maxsize=None)
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpret() -> bool:
    """True when Triton kernels run in the interpreter (``TRITON_INTERPRET=1``), i.e. on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _native_status(kind: str) -> tuple[bool, str]:
    # Imported lazily: the extension is optional and may be absent.
    from titan_kernels import _native

    return _native.status(kind)


def backend_status(name: str, device: torch.device | str | None = None) -> BackendStatus:
    """Availability of backend ``name`` on ``device`` (default: cuda if present, else cpu)."""
    _check_name(name)
    return _status(name, _device_type(device), triton_interpret())


@functools.lru_cache(maxsize=None)
def _status(name: str, dev: str, interpret: bool) -> BackendStatus:
    if name == "reference":
        return BackendStatus(name, True)
    if name == "triton":
        if not _triton_importable():
            return BackendStatus(name, False, "the triton package is not installed")
        if dev == "cuda":
            if not torch.cuda.is_available():
                return BackendStatus(name, False, "no CUDA device is visible")
            return BackendStatus(name, True)
        if dev == "cpu":
            if interpret:
                return BackendStatus(name, True, "runs in the Triton interpreter (TRITON_INTERPRET=1): correct but slow")
            return BackendStatus(name, False, "Triton runs on CPU tensors only under TRITON_INTERPRET=1")
        return BackendStatus(name, False, f"Triton does not support device type {dev!r}")
    if name in ("cpu", "cuda"):
        if dev != name:
            return BackendStatus(name, False, f"the {name} backend runs on {name} tensors, not {dev}")
        if name == "cuda" and not torch.cuda.is_available():
            return BackendStatus(name, False, "no CUDA device is visible")
        ok, why = _native_status(name)
        return BackendStatus(name, ok, why)
    raise AssertionError(name)


def available_backends(device: torch.device | str | None = None) -> dict[str, BackendStatus]:
    """Every backend with whether it runs on ``device`` and, when not, the reason.

    Returns a dict ``name -> BackendStatus(name, available, reason)`` in the order of ``BACKENDS``.
    """
    return {name: backend_status(name, device) for name in BACKENDS}


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[str]:
    """Context manager: run titan ops with backend ``name`` inside the block.

    Raises ``ValueError`` for an unknown name. Availability is checked when an op runs, since it
    depends on the tensors' device.
    """
    token = _override.set(_check_name(name))
    try:
        yield name
    finally:
        _override.reset(token)


@contextlib.contextmanager
def automatic() -> Iterator[None]:
    """Context manager: titan ops choose their backend automatically inside the block, whatever an
    enclosing ``use_backend`` or ``TITAN_KERNELS_BACKEND`` asks for (a backward replaying a forward
    that ran with no request)."""
    token = _override.set(_AUTOMATIC)
    try:
        yield
    finally:
        _override.reset(token)


def requested_backend() -> str | None:
    """The backend asked for by ``use_backend`` or ``TITAN_KERNELS_BACKEND``, or None for automatic."""
    name = _override.get()
    if name == _AUTOMATIC:
        return None
    if name is not None:
        return name
    env = os.environ.get(ENV_VAR, "").strip()
    if env and env != "auto":
        return _check_name(env, ENV_VAR)
    return None


def register_impl(op: str, backend: str, fn: Callable) -> None:
    """Record that ``fn`` implements ``op`` for ``backend`` (called by each op module)."""
    _check_name(backend)
    _impls.setdefault(op, {})[backend] = fn
    _resolved.clear()


def implemented_backends(op: str) -> tuple[str, ...]:
    return tuple(b for b in BACKENDS if b in _impls.get(op, {}))


def resolve(op: str, device: torch.device | str, backend: str | None = None) -> str:
    """The backend that runs ``op`` on ``device``.

    Raises ``RuntimeError`` when the requested backend does not implement ``op`` or cannot run on
    ``device`` (with the reason).
    """
    impls = _impls.get(op, {})
    name = backend if backend is not None else requested_backend()
    dev = _device_type(device)
    if name is not None:
        _check_name(name)
        if name not in impls:
            raise RuntimeError(
                f"backend {name!r} does not implement titan op {op!r}; implemented: {implemented_backends(op)}"
            )
        st = _status(name, dev, triton_interpret())
        if not st.available:
            raise RuntimeError(f"backend {name!r} cannot run titan op {op!r} on {dev}: {st.reason}")
        return name
    for cand in _AUTO_ORDER.get(dev, ("reference",)):
        if cand in impls and _status(cand, dev, triton_interpret()).available:
            return cand
    if "reference" in impls:
        return "reference"
    raise RuntimeError(f"no backend implements titan op {op!r} on {dev}")


_resolved: dict[tuple, Callable] = {}


def get_impl(op: str, device: torch.device | str, backend: str | None = None) -> Callable:
    """The implementation of ``op`` chosen by ``resolve``; memoized, since it runs on every op call."""
    dev = device.type if isinstance(device, torch.device) else _device_type(device)
    key = (op, dev, backend or _override.get() or os.environ.get(ENV_VAR), triton_interpret())
    fn = _resolved.get(key)
    if fn is None:
        fn = _resolved[key] = _impls[op][resolve(op, dev, backend)]
    return fn
