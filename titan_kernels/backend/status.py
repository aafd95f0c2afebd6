"""Whether a backend family can run on a device at all, and why not: the facts every op's choice
starts from (the triton package, a visible CUDA device, the Triton interpreter, the native build)."""
from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass

import torch

from titan_kernels.triton import triton_interpret

BACKENDS = ("reference", "triton", "cpu", "cuda")
NATIVE = ("cpu", "cuda")  # the families whose implementations run on their own device type only


@dataclass(frozen=True)
class BackendStatus:
    """Whether one backend can run on a device, and why not when it cannot."""

    name: str
    available: bool
    reason: str = ""


def check_family(name: object, arg: str = "backend") -> str:
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"{arg}: expected one of {BACKENDS}, got {name!r}")
    return name


def device_type(device: torch.device | str | None) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


@functools.lru_cache(maxsize=None)
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def backend_status(name: str, device: torch.device | str | None = None) -> BackendStatus:
    """Availability of backend ``name`` on ``device`` (default: cuda if present, else cpu)."""
    check_family(name)
    return family_status(name, device_type(device), triton_interpret())


@functools.lru_cache(maxsize=None)
def family_status(name: str, dev: str, interpret: bool) -> BackendStatus:
    """``backend_status`` of family ``name`` on device type ``dev`` (cached per interpreter setting)."""
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
    if name in NATIVE:
        if dev != name:
            return BackendStatus(name, False, f"the {name} backend runs on {name} tensors, not {dev}")
        if name == "cuda" and not torch.cuda.is_available():
            return BackendStatus(name, False, "no CUDA device is visible")
        from titan_kernels import _native  # lazily: the extension is optional and may be absent

        ok, why = _native.status(name)
        return BackendStatus(name, ok, why)
    raise AssertionError(name)


def available_backends(device: torch.device | str | None = None) -> dict[str, BackendStatus]:
    """Every backend with whether it runs on ``device`` and, when not, the reason.

    Returns a dict ``name -> BackendStatus(name, available, reason)`` in the order of ``BACKENDS``.
    """
    return {name: backend_status(name, device) for name in BACKENDS}
