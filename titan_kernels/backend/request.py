"""What the caller asks for: the backend request of the ``use_backend`` context and the
``TITAN_KERNELS_BACKEND`` environment variable, and the one idiom by which an op's forward hands its
request to its backward (``capture_request``).

Precedence: an explicit ``backend=`` argument > the innermost ``use_backend(...)`` context >
``TITAN_KERNELS_BACKEND`` > the automatic choice. ``AUTO`` is the one spelling of "choose
automatically, whatever the context says" (a backward replaying a forward that had no request).

The environment variable is read when titan_kernels is imported, as torch reads its own settings;
``reload_environment()`` reads it again (and forgets cached choices) after a running process changes
it. An invalid value raises ValueError naming the variable at the first op call, not at import.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Any, Iterator

import torch

from titan_kernels.backend import registry
from titan_kernels.backend.status import device_type

ENV_VAR = "TITAN_KERNELS_BACKEND"
AUTO = "auto"  # the request that means "choose automatically", whatever the context says

_choices = registry._choices  # (the choices' cache: its hits are read inline in ``choose``)
_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("titan_backend", default=None)
_env: list = [None, False]  # [the variable's value (None: unset or automatic), checked]


def reload_environment() -> None:
    """Read ``TITAN_KERNELS_BACKEND`` (and, through the registry, ``TRITON_INTERPRET``) again and
    forget every cached choice: after a running process changes them."""
    value = (os.environ.get(ENV_VAR) or "").strip()
    _env[:] = [None if value in ("", AUTO) else value, False]
    registry.clear_choices()


def _env_request() -> str | None:
    if not _env[1] and _env[0] is not None:
        registry.check_name(_env[0], ENV_VAR)  # once; an invalid value raises at every call
    _env[1] = True
    return _env[0]


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[str]:
    """Context manager: run titan ops with backend ``name`` inside the block: a family of ``BACKENDS``
    or one op's own implementation (e.g. "sdpa_flash"). It applies to the ops that implement that
    name; the others choose automatically (``--kernels.backend cpu`` keeps the ops without native
    CPU kernels running).

    Raises ``ValueError`` for an unknown name. Availability is checked when an op runs, since it
    depends on the tensors' device (an op that has the implementation but cannot run it raises).
    """
    token = _override.set(registry.check_name(name))
    try:
        yield name
    finally:
        _override.reset(token)


@contextlib.contextmanager
def automatic() -> Iterator[None]:
    """Context manager: titan ops choose their backend automatically inside the block, whatever an
    enclosing ``use_backend`` or ``TITAN_KERNELS_BACKEND`` asks for."""
    token = _override.set(AUTO)
    try:
        yield
    finally:
        _override.reset(token)


def _context_request() -> str | None:
    name = _override.get()
    if name is None:
        return _env_request() if _env[0] is not None else None
    return None if name == AUTO else name


def requested_backend(op: str | None = None) -> str | None:
    """The backend asked for by ``use_backend`` or ``TITAN_KERNELS_BACKEND``, or None for automatic.

    With ``op``: None also when the request names nothing ``op`` implements (another op's own
    implementation, or a family it lacks): a context request applies to the ops that have it.
    """
    name = _override.get()  # (_context_request, inline: every op call)
    if name is None:
        if _env[0] is None:
            return None
        name = _env_request()
    elif name == AUTO:
        return None
    if op is not None and name not in registry.implementation_names(op):
        return None
    return name


def capture_request(op: str | None) -> str | None:
    """What a forward of ``op`` hands to its backward: the request in force for ``op`` now, or ``AUTO``
    when there is none (a backward run under another ``use_backend`` still makes the forward's
    choice); None while compiling, where the compiled ops read the request when they run. ``op``
    None: the request as it is, for a composite op whose kernels are other titan ops (it runs them
    under ``request_scope``)."""
    if torch.compiler.is_compiling():
        return None
    return requested_backend(op) or AUTO


def request_scope(request: str | None) -> contextlib.AbstractContextManager:
    """The context in which the titan ops a composite op calls see ``request``, as
    ``capture_request(None)`` returned it: a name (``use_backend``), ``AUTO`` (``automatic``) or
    None (the request in force stays)."""
    if request is None:
        return contextlib.nullcontext()
    if request == AUTO:
        return automatic()
    return use_backend(request)


def _as_device(device: torch.device | str | None) -> torch.device:
    if type(device) is torch.device:
        return device
    return torch.device(device_type(device) if device is None else device)


def choose(op: str, device: torch.device | str | None, key: Any = None, *, case: Any = None,
           backend: str | None = None) -> registry.Choice:
    """The implementation of ``op`` that runs on ``device`` for the case ``key`` (a ``Choice``: its
    name, ``kernels``, why, and what was passed over).

    Precedence: ``backend`` (a name of ``implementation_names(op)``, or ``AUTO``: the automatic
    choice whatever the context; None: no argument) > ``use_backend`` > ``TITAN_KERNELS_BACKEND`` >
    the automatic order (the first implementation that can run the case and is not passed over by
    its ``auto``). A family name asks for that family's implementations in the op's order. ``key`` is
    what the capability answers depend on (hashable; cached per key, never re-probed per call);
    ``case`` (default ``key``; a zero-argument callable is called once, on a miss) is what
    ``why_not`` is asked about.

    Raises RuntimeError when the requested implementation cannot run the case (with why), when the
    ``backend`` argument names nothing that implements ``op``, or when no automatic candidate can
    run; ValueError for a name that is no backend at all.
    """
    dev = device if type(device) is torch.device else _as_device(device)  # (inline: every op call)
    if backend is not None:
        if backend == AUTO:
            backend = None
        # registry.choose's cache hit, inline (every op call); the same key
        hit = _choices.get((op, dev, backend, None, key))
        if hit is not None:
            return hit
        return registry.choose(op, dev, key, case, backend, None, f"requested by backend={backend!r}" if backend else "")
    request = _override.get()
    if request is None:
        request = _env_request() if _env[0] is not None else None
    elif request == AUTO:
        request = None
    hit = _choices.get((op, dev, None, request, key))
    if hit is not None:
        return hit
    return registry.choose(op, dev, key, case, None, request,
                           f"requested by use_backend({request!r}) or {ENV_VAR}" if request else "")


def kernels(op: str, device: torch.device | str | None, backend: str | None = None, key: Any = None) -> registry.Kernels:
    """The ``Kernels`` (forward, backward) of the implementation ``choose`` picks."""
    return choose(op, device, key, backend=backend).kernels


def resolve(op: str, device: torch.device | str | None, backend: str | None = None, key: Any = None) -> str:
    """The name of the implementation ``choose`` picks (for most ops a family of ``BACKENDS``)."""
    return choose(op, device, key, backend=backend).backend


reload_environment()
