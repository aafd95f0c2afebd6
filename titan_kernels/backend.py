"""Which implementation of an op runs: the one registry and chooser of every titan op.

Precedence: an explicit ``backend=`` argument > the innermost ``use_backend(...)`` context >
the ``TITAN_KERNELS_BACKEND`` environment variable > the automatic choice.

Backend families (``BACKENDS``):
  reference  plain PyTorch, float32 math; runs on every device (ground truth and fallback).
  triton     our Triton kernels; on CUDA, or on CPU tensors when ``TRITON_INTERPRET=1`` is set.
  cpu        native kernels for CPU tensors: ours from csrc/ (when the extension is built) or, for some
             ops, aten's (attention's ``sdpa_flash``, ``torch._grouped_mm``, ``torch._scaled_mm``).
  cuda       native kernels for CUDA tensors: ours from csrc/, aten's, or a library's (FlashAttention).

Each op registers its implementations (``register_impl``): a name (by default its family), the
family, the callable(s), why it cannot run a case (``why_not``; by default the family's
``backend_status``) and whether the automatic choice may take it. The automatic order is the op's
own (``set_order``) or the families' order per device type. A request names a family (all its
implementations of the op, in order) or one implementation. Choices are cached per (op, device,
request, case key): capability probes run once per key, not on every call. An implementation that
cannot run what was asked of it raises ``RuntimeError`` with the reason; an unknown name ``ValueError``.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib.util
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

BACKENDS = ("reference", "triton", "cpu", "cuda")
ENV_VAR = "TITAN_KERNELS_BACKEND"

# Fastest first, per device type.
_AUTO_ORDER = {
    "cuda": ("cuda", "triton", "reference"),
    "cpu": ("cpu", "reference"),
}

_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("titan_backend", default=None)
AUTO = _AUTOMATIC = "auto"  # the request that means "choose automatically", whatever the context says


@dataclass(frozen=True)
class BackendStatus:
    """Whether one backend can run on a device, and why not when it cannot."""

    name: str
    available: bool
    reason: str = ""


def _check_family(name: str, arg: str = "backend") -> str:
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"{arg}: expected one of {BACKENDS}, got {name!r}")
    return name


def _check_name(name: str, arg: str = "backend") -> str:
    """A family of ``BACKENDS`` or the name of some op's own implementation (e.g. "sdpa_flash")."""
    if isinstance(name, str) and (name in BACKENDS or any(i.name == name for v in _impls.values() for i in v)):
        return name
    extra = sorted({i.name for v in _impls.values() for i in v} - set(BACKENDS))
    raise ValueError(f"{arg}: expected one of {BACKENDS}" + (f" or an op's own backend {tuple(extra)}" if extra else "")
                     + f", got {name!r}")


def _device_type(device: torch.device | str | None) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


@functools.lru_cache(maxsize=None)
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def _env_reader(name: str, raw: bool = False) -> Callable[[], Any]:
    """A fast reader of one environment variable: every op call reads two, and ``os.environ.get``
    encodes the key each time (a third of a small op's dispatch cost). Reads the live environment.
    ``raw``: the stored value undecoded (bytes on POSIX), enough to tell values apart in a cache key."""
    data = getattr(os.environ, "_data", None)
    encode, decode = getattr(os.environ, "encodekey", None), getattr(os.environ, "decodevalue", None)
    if not isinstance(data, dict) or encode is None or decode is None:
        return lambda: os.environ.get(name)
    key = encode(name)
    if raw:
        return lambda: data.get(key)

    def read() -> str | None:
        value = data.get(key)
        return None if value is None else decode(value)

    return read


_env_backend = _env_reader(ENV_VAR)
_env_interpret = _env_reader("TRITON_INTERPRET")
_env_interpret_raw = _env_reader("TRITON_INTERPRET", raw=True)


def triton_interpret() -> bool:
    """True when Triton kernels run in the interpreter (``TRITON_INTERPRET=1``), i.e. on CPU tensors."""
    return _env_interpret() not in (None, "", "0")


def _native_status(kind: str) -> tuple[bool, str]:
    # Imported lazily: the extension is optional and may be absent.
    from titan_kernels import _native

    return _native.status(kind)


def backend_status(name: str, device: torch.device | str | None = None) -> BackendStatus:
    """Availability of backend ``name`` on ``device`` (default: cuda if present, else cpu)."""
    _check_family(name)
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
    """Context manager: run titan ops with backend ``name`` inside the block: a family of ``BACKENDS``
    or one op's own implementation (e.g. "sdpa_flash"). It applies to the ops that implement that
    name; the others choose automatically (``--kernels.backend cpu`` keeps the ops without native
    CPU kernels running).

    Raises ``ValueError`` for an unknown name. Availability is checked when an op runs, since it
    depends on the tensors' device (an op that has the implementation but cannot run it raises).
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


def requested_backend(op: str | None = None) -> str | None:
    """The backend asked for by ``use_backend`` or ``TITAN_KERNELS_BACKEND``, or None for automatic.

    With ``op``: None also when the request names nothing ``op`` implements (another op's own
    implementation, or a family it lacks): a context request applies to the ops that have it.
    """
    name = _override.get()
    if name == _AUTOMATIC:
        return None
    if name is None:
        env = (_env_backend() or "").strip()
        if not env or env == "auto":
            return None
        name = _check_name(env, ENV_VAR)
    if op is not None and name not in implementation_names(op):
        return None
    return name


def capture_request(op: str) -> str | None:
    """What a forward of ``op`` hands to its backward: the request in force for ``op`` now, or ``AUTO``
    when there is none (a backward run under another ``use_backend`` still makes the forward's
    choice); None while compiling, where the compiled ops read the request when they run."""
    if torch.compiler.is_compiling():
        return None
    return requested_backend(op) or _AUTOMATIC


# ----------------------------------------------------------------------------- the registry


@dataclass(frozen=True)
class Impl:
    """One implementation of an op: its ``name`` (what ``backend=`` / ``use_backend`` ask for), the
    backend family of ``BACKENDS`` it belongs to, the callable(s), and what it can run.

    ``why_not(device, case) -> str | None`` says why it cannot run a case (None: it can); by default
    the family's ``backend_status``. ``auto`` is True, False (only when asked for by name) or
    ``auto(device, case) -> str | None``: why the automatic choice passes it over although it can run
    (e.g. measured slower here)."""

    name: str
    family: str
    fn: Any
    why_not: Callable | None = None
    auto: bool | Callable = True


@dataclass(frozen=True)
class Choice:
    """The implementation that runs a call, why, and why each one before it was passed over."""

    op: str
    backend: str                     # the implementation's name, e.g. "cpu", "triton", "sdpa_flash"
    family: str                      # its family in BACKENDS
    fn: Any
    reason: str
    skipped: tuple[tuple[str, str], ...] = ()
    explicit: bool = False

    def __str__(self) -> str:
        lines = [f"{self.backend}: {self.reason}"]
        lines += [f"  skipped {name}: {why}" for name, why in self.skipped]
        return "\n".join(lines)


_impls: dict[str, list[Impl]] = {}
_orders: dict[str, dict[str, tuple[str, ...]]] = {}   # op -> device type -> implementation names
_rank: dict[str, Callable] = {}                        # op -> reorders the automatic candidates (measured)
_hints: dict[str, str] = {}                            # op -> appended to "no backend can run" errors
_failed: dict[tuple, str] = {}                         # (op, name, device, key) -> why it raised at run time
_choices: dict[tuple, Choice] = {}
_names: dict[str, tuple[str, ...]] = {}                # op -> implementation_names(op), cached


def register_impl(op: str, backend: str, fn: Any, *, name: str | None = None, why_not: Callable | None = None,
                  auto: bool | Callable = True) -> None:
    """Record that ``fn`` implements ``op`` in family ``backend`` (called by each op module at import).

    ``name`` (default: the family) names an op-specific implementation, e.g. attention's
    ``"sdpa_flash"`` in family ``"cpu"``; one name may be registered in several families (one per
    device type). Registering a (name, family) again replaces it. See ``Impl`` for ``why_not``/``auto``.
    """
    _check_family(backend)
    impl = Impl(name or backend, backend, fn, why_not, auto)
    lst = _impls.setdefault(op, [])
    lst[:] = [i for i in lst if (i.name, i.family) != (impl.name, impl.family)] + [impl]
    clear_choices()


def set_order(op: str, orders: dict[str, tuple[str, ...]], *, rank: Callable | None = None, hint: str = "") -> None:
    """The automatic order of ``op``'s implementations per device type, fastest first (default: the
    families of ``_AUTO_ORDER``, each family's implementations in registration order). ``rank(device,
    case, names) -> names`` may reorder the runnable candidates (e.g. by a one-time measurement);
    ``hint`` is appended to the error raised when no automatic candidate can run."""
    _orders[op] = dict(orders)
    if rank is not None:
        _rank[op] = rank
    if hint:
        _hints[op] = hint
    clear_choices()


def clear_choices() -> None:
    """Forget every cached choice and run-time failure (after a registry, library or device change)."""
    _choices.clear()
    _failed.clear()
    _names.clear()


def implemented_backends(op: str) -> tuple[str, ...]:
    """The families of ``BACKENDS`` with at least one implementation of ``op``."""
    fams = {i.family for i in _impls.get(op, ())}
    return tuple(b for b in BACKENDS if b in fams)


def implementation_names(op: str) -> tuple[str, ...]:
    """Every name ``backend=`` may give for ``op``: its implementations' names and their families."""
    names = _names.get(op)
    if names is None:
        names = _names[op] = tuple(dict.fromkeys([i.name for i in _impls.get(op, ())] + list(implemented_backends(op))))
    return names


@contextlib.contextmanager
def replace_impl(op: str, name: str, fn: Any, family: str | None = None) -> Iterator[Any]:
    """Context manager: implementation ``name`` of ``op`` runs ``fn`` inside the block (instrumenting a
    backend in tests: counting calls, injecting a failure). Yields the callable it replaced."""
    lst = _impls[op]
    idx = [j for j, i in enumerate(lst) if i.name == name and (family is None or i.family == family)]
    if not idx:
        raise KeyError(f"titan op {op!r} has no implementation {name!r}")
    old = [lst[j] for j in idx]
    for j in idx:
        lst[j] = dataclasses.replace(lst[j], fn=fn)
    clear_choices()
    try:
        yield old[0].fn
    finally:
        for j, impl in zip(idx, old):
            lst[j] = impl
        clear_choices()


def _candidates(op: str, dev: str, family: str | None = None) -> list[Impl]:
    # A native family's implementations are candidates on their own device type only.
    impls = [i for i in _impls.get(op, ()) if i.family not in ("cpu", "cuda") or i.family == dev]
    if family is not None:
        order = _orders.get(op, {}).get(dev, ())
        fam = [i for i in impls if i.family == family]
        return sorted(fam, key=lambda i: order.index(i.name) if i.name in order else len(order))
    if dev in _orders.get(op, {}):
        by_name: dict[str, list[Impl]] = {}
        for i in impls:
            by_name.setdefault(i.name, []).append(i)
        return [i for n in _orders[op][dev] for i in by_name.get(n, ())]
    return [i for fam in _AUTO_ORDER.get(dev, ("reference",)) for i in impls if i.family == fam]


def _why_not(impl: Impl, device: torch.device, case: Any) -> str | None:
    dev = device.type
    if impl.family in ("cpu", "cuda") and dev != impl.family:
        return f"runs on {impl.family.upper()} tensors, not {dev}"
    if impl.why_not is not None:
        return impl.why_not(device, case)
    st = _status(impl.family, dev, triton_interpret())
    return None if st.available else st.reason


def _why_not_auto(impl: Impl, device: torch.device, case: Any) -> str | None:
    if impl.auto is True:
        return None
    if impl.auto is False:
        return "runs only when asked for by name"
    return impl.auto(device, case)


def _describe_request(backend: str | None) -> tuple[str | None, str]:
    if backend == _AUTOMATIC:
        return None, ""
    if backend:
        return backend, f"requested by backend={backend!r}"
    name = requested_backend()
    if name is None:
        return None, ""
    return name, f"requested by use_backend({name!r}) or {ENV_VAR}"


def _as_device(device: torch.device | str | None) -> torch.device:
    if isinstance(device, torch.device):
        return device
    return torch.device(_device_type(device) if device is None else device)


def choose(op: str, device: torch.device | str | None, key: Any = None, *, case: Any = None,
           backend: str | None = None) -> Choice:
    """The implementation of ``op`` that runs on ``device`` for the case ``key``.

    A context or environment request naming one op's own implementation (not a family) applies to
    the ops that have it; the others choose automatically.

    Precedence: ``backend`` (a name of ``implementation_names(op)``, or ``AUTO``: the automatic
    choice whatever the context, e.g. a backward replaying a forward that had no request) > ``use_backend`` >
    ``TITAN_KERNELS_BACKEND`` > the automatic order (the first implementation that can run the case
    and is not passed over by its ``auto``). A family name asks for that family's implementations in
    the op's order. ``key`` is what the capability answers depend on (hashable; cached per key, never
    re-probed per call); ``case`` (default ``key``; a zero-argument callable is called once, on a
    miss) is what ``why_not`` is asked about.

    Raises RuntimeError when the requested implementation cannot run the case (with why), when the
    request names nothing that implements ``op``, or when no automatic candidate can run; ValueError
    for a name that is no backend at all.
    """
    dev = device if type(device) is torch.device else _as_device(device)
    # The argument and the context are kept apart: a context request can mean "automatic" for this op.
    ck = (op, dev, backend, None if backend else (_override.get() or _env_backend()), _env_interpret_raw(), key)
    hit = _choices.get(ck)
    if hit is not None:
        return hit
    if case is None:
        case = key
    elif callable(case):
        case = case()
    choice = _choices[ck] = _choose(op, dev, key, case, backend)
    return choice


def _choose(op: str, dev: torch.device, key: Any, case: Any, backend: str | None) -> Choice:
    name, why_requested = _describe_request(backend)
    if name is not None:
        _check_name(name)
        if not backend and name not in implementation_names(op):
            # A context or environment request naming nothing this op implements (another op's own
            # implementation, a family it lacks): this op chooses automatically. An op's backend=
            # argument naming it still raises.
            name = None
    skipped: list[tuple[str, str]] = []
    if name is None:
        runnable: list[Impl] = []
        for impl in _candidates(op, dev.type):
            why = _failed.get((op, impl.name, dev.type, key)) or _why_not(impl, dev, case) or _why_not_auto(impl, dev, case)
            if why is None:
                runnable.append(impl)
                if op not in _rank:
                    break
            elif not runnable:
                skipped.append((impl.name, why))
        if runnable:
            impl = runnable[0]
            if len(runnable) > 1:
                first = _rank[op](dev, case, tuple(i.name for i in runnable))[0]
                impl = next(i for i in runnable if i.name == first)
            reason = f"first backend of the {dev.type} order" + (" that takes this case" if skipped else "")
            return Choice(op, impl.name, impl.family, impl.fn, reason, tuple(skipped))
        detail = "; ".join(f"{n}: {w}" for n, w in skipped) or f"nothing is ordered for {dev.type} tensors"
        hint = _hints.get(op, "")
        raise RuntimeError(f"no backend can run titan op {op!r} on {dev.type} ({detail})" + (f"; {hint}" if hint else ""))
    if name in BACKENDS:
        if name not in implemented_backends(op):
            raise RuntimeError(f"backend {name!r} does not implement titan op {op!r}; implemented: "
                               f"{implementation_names(op)}")
        if name in ("cpu", "cuda") and dev.type != name:
            raise RuntimeError(f"backend {name!r} runs on {name} tensors, got {dev.type} tensors ({why_requested})")
        cands = _candidates(op, dev.type, family=name)
    else:
        cands = [i for i in _impls.get(op, ()) if i.name == name]
        if not cands:
            raise RuntimeError(f"backend {name!r} does not implement titan op {op!r}; implemented: "
                               f"{implementation_names(op)}")
        cands = [i for i in cands if i.family not in ("cpu", "cuda") or i.family == dev.type] or cands[:1]
    for impl in cands:
        why = _why_not(impl, dev, case)
        if why is None:
            return Choice(op, impl.name, impl.family, impl.fn, why_requested, tuple(skipped), True)
        skipped.append((impl.name, why))
    detail = "; ".join(w if n == name else f"{n}: {w}" for n, w in skipped)
    raise RuntimeError(f"backend {name!r} cannot run titan op {op!r} on {dev.type} ({why_requested}): {detail}")


def mark_failed(op: str, choice: Choice, device: torch.device, key: Any, error: BaseException) -> None:
    """Record that the automatically chosen ``choice`` raised for this kind of case: later automatic
    choices for the key pass it over (with this reason), with a warning now."""
    msg = str(error).splitlines()[0] if str(error) else ""
    why = f"raised at run time: {type(error).__name__}: {msg}"
    _failed[(op, choice.backend, device.type, key)] = why
    _choices.clear()
    warnings.warn(f"titan {op}: backend {choice.backend!r} {why}; falling back to the next backend for such calls",
                  RuntimeWarning, stacklevel=3)


def resolve(op: str, device: torch.device | str, backend: str | None = None, key: Any = None) -> str:
    """The name of the implementation ``choose`` picks (for most ops a family of ``BACKENDS``)."""
    return choose(op, device, key, backend=backend).backend


def get_impl(op: str, device: torch.device | str, backend: str | None = None, key: Any = None) -> Any:
    """The callable(s) of the implementation ``choose`` picks; cached, since it runs on every op call."""
    return choose(op, device, key, backend=backend).fn
