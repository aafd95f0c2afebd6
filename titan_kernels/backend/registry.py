"""The registry of every titan op's implementations, and the choice among them (cached per case).

Each op registers its implementations (``register_impl``): a name (by default its family), the
family of ``BACKENDS``, its ``Kernels`` (forward, backward), why it cannot run a case (``why_not``;
by default the family's ``backend_status``) and whether the automatic choice may take it. The
automatic order is the op's own (``set_order``) or the families' order per device type. A request
(from ``titan_kernels.backend.request``) names a family (all its implementations of the op, in
order) or one implementation. Choices are cached per (op, device, request, case key): capability
probes run once per key, not on every call. An implementation that raised at run time is passed
over for its key (``mark_failed``). An implementation that cannot run what was asked of it raises
``RuntimeError`` with the reason; an unknown name ``ValueError``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple

import torch

from titan_kernels.backend import status as _status
from titan_kernels.backend.status import BACKENDS, NATIVE, check_family
from titan_kernels.triton import triton_interpret

# The families fastest first, per device type: the automatic order of an op that declares none
# (an op's own is its module's ORDER, given through ``Op.set_order``).
DEFAULT_ORDER = {
    "cuda": ("cuda", "triton", "reference"),
    "cpu": ("cpu", "reference"),
}


class Kernels(NamedTuple):
    """The callables of one implementation: its forward and, for ops with a backward, its backward
    (their signatures are the op's kernel contract, declared once in its ``ops/`` module). An op with
    other entry points declares its own NamedTuple of them (e.g. fp8_quantize's ``QuantizeKernels``)."""

    forward: Callable
    backward: Callable | None = None


class LazyKernel:
    """The entry point ``name`` of the kernel module ``module``, imported at its first call: importing
    a Triton kernel module imports triton (0.2 s to a second), which ``import titan_kernels`` must
    not pay. The choice asks ``why_not()`` before it takes the implementation (a module that does not
    import is a reason, as an unavailable family is); a direct call of a module that does not import
    raises RuntimeError naming it."""

    __slots__ = ("module", "name", "fn")

    def __init__(self, module: str, name: str):
        self.module, self.name, self.fn = module, name, None

    def why_not(self) -> str | None:
        """None once the entry point is imported, else why it cannot be (the module's ImportError)."""
        if self.fn is None:
            try:
                self.fn = getattr(importlib.import_module(self.module), self.name)
            except ImportError as e:
                return f"the kernel module {self.module} does not import: {e}"
        return None

    def __call__(self, *args, **kwargs):
        if self.fn is None:
            why = self.why_not()
            if why is not None:
                raise RuntimeError(why)
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"LazyKernel({self.module}.{self.name})"


@dataclass(frozen=True)
class Impl:
    """One implementation of an op: its ``name`` (what ``backend=`` / ``use_backend`` ask for), the
    backend family of ``BACKENDS`` it belongs to, its ``Kernels``, and what it can run.

    ``why_not(device, case) -> str | None`` says why it cannot run a case (None: it can); by default
    the family's ``backend_status``. ``auto`` is True, False (only when asked for by name) or
    ``auto(device, case) -> str | None``: why the automatic choice passes it over although it can run
    (e.g. measured slower here)."""

    name: str
    family: str
    kernels: Kernels  # or the op's own NamedTuple of entry points
    why_not: Callable | None = None
    auto: bool | Callable = True


@dataclass(frozen=True)
class Choice:
    """The implementation that runs a call, why, and why each one before it was passed over."""

    op: str
    backend: str                     # the implementation's name, e.g. "cpu", "triton", "sdpa_flash"
    family: str                      # its family in BACKENDS
    kernels: Kernels
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
# Bumped whenever cached choices are forgotten (``clear_choices``, ``mark_failed``): a choice an op keeps
# beside one case of its own (attention's planned calls) is valid while the epoch it was made in holds.
EPOCH = [0]


def _kernels(fns: Any) -> Any:
    if isinstance(fns, tuple) and hasattr(fns, "_fields"):  # Kernels, or an op's own NamedTuple of entry points
        return fns
    if callable(fns):
        return Kernels(fns)
    if isinstance(fns, tuple) and 1 <= len(fns) <= 2 and all(callable(f) for f in fns):
        return Kernels(*fns)
    raise TypeError(f"kernels: expected a Kernels(forward, backward), a (forward, backward) tuple or a "
                    f"callable, got {type(fns).__name__}")


def register_impl(op: str, backend: str, kernels: Any, *, name: str | None = None,
                  why_not: Callable | None = None, auto: bool | Callable = True) -> None:
    """Record that ``kernels`` (a ``Kernels`` or the op's own NamedTuple, a (forward, backward) tuple
    or one forward) implement
    ``op`` in family ``backend`` (called by each op module at import).

    ``name`` (default: the family) names an op-specific implementation, e.g. attention's
    ``"sdpa_flash"`` in family ``"cpu"``; one name may be registered in several families (one per
    device type). Registering a (name, family) again replaces it. See ``Impl`` for ``why_not``/``auto``.
    """
    check_family(backend)
    impl = Impl(name or backend, backend, _kernels(kernels), why_not, auto)
    lst = _impls.setdefault(op, [])
    lst[:] = [i for i in lst if (i.name, i.family) != (impl.name, impl.family)] + [impl]
    clear_choices()


def set_order(op: str, orders: dict[str, tuple[str, ...]], *, rank: Callable | None = None, hint: str = "") -> None:
    """The automatic order of ``op``'s implementations per device type, fastest first (default: the
    families of ``DEFAULT_ORDER``, each family's implementations in registration order). ``rank(device,
    case, names) -> names`` may reorder the runnable candidates (e.g. by a one-time measurement);
    ``hint`` is appended to the error raised when no automatic candidate can run."""
    _orders[op] = dict(orders)
    if rank is not None:
        _rank[op] = rank
    if hint:
        _hints[op] = hint
    clear_choices()


def unregister(op: str) -> None:
    """Forget ``op``: its implementations, order, rank and hint (an op registered for a test)."""
    for table in (_impls, _orders, _rank, _hints):
        table.pop(op, None)
    clear_choices()


def clear_choices() -> None:
    """Forget every cached choice and run-time failure (after a registry, library or device change)."""
    _choices.clear()
    _failed.clear()
    _names.clear()
    EPOCH[0] += 1


def registered_ops() -> tuple[str, ...]:
    """The names of every op with at least one implementation."""
    return tuple(_impls)


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


def implementations(op: str) -> tuple[Impl, ...]:
    """Every registered implementation of ``op``, in registration order."""
    return tuple(_impls.get(op, ()))


def implementation(op: str, name: str, device: torch.device | str | None = None) -> Impl:
    """The implementation ``name`` of ``op`` (a name of ``implementation_names``; with ``device``, the
    one of that device type where a name is registered in several families, e.g. "cpu" and "cuda").
    Raises KeyError naming what ``op`` has."""
    dev = None if device is None else torch.device(device).type
    found = [i for i in _impls.get(op, ()) if name in (i.name, i.family)]
    if dev is not None:
        found = [i for i in found if i.family not in NATIVE or i.family == dev] or found
    if not found:
        raise KeyError(f"titan op {op!r} has no implementation {name!r}; it has {implementation_names(op)}")
    return found[0]


def check_name(name: object, arg: str = "backend") -> str:
    """``name`` when it is a family of ``BACKENDS`` or some op's own implementation (e.g.
    "sdpa_flash"); else ValueError naming ``arg``."""
    if isinstance(name, str) and (name in BACKENDS or any(i.name == name for v in _impls.values() for i in v)):
        return name
    extra = sorted({i.name for v in _impls.values() for i in v} - set(BACKENDS))
    raise ValueError(f"{arg}: expected one of {BACKENDS}" + (f" or an op's own backend {tuple(extra)}" if extra else "")
                     + f", got {name!r}")


@contextlib.contextmanager
def replace_impl(op: str, name: str, kernels: Any, family: str | None = None) -> Iterator[Kernels]:
    """Context manager: implementation ``name`` of ``op`` runs ``kernels`` (as ``register_impl``
    takes them) inside the block (instrumenting a backend in tests: counting calls, injecting a
    failure). Yields the ``Kernels`` it replaced. Every op chooses through this registry, so this
    reaches every op."""
    lst = _impls[op]
    idx = [j for j, i in enumerate(lst) if i.name == name and (family is None or i.family == family)]
    if not idx:
        raise KeyError(f"titan op {op!r} has no implementation {name!r}")
    old = [lst[j] for j in idx]
    for j in idx:
        lst[j] = dataclasses.replace(lst[j], kernels=_kernels(kernels))
    clear_choices()
    try:
        yield old[0].kernels
    finally:
        for j, impl in zip(idx, old):
            lst[j] = impl
        clear_choices()


# ----------------------------------------------------------------------------- the choice


def choose(op: str, dev: torch.device, key: Any, case: Any, backend: str | None, request: str | None,
           why_requested: str) -> Choice:
    """The implementation of ``op`` for ``key`` on ``dev`` (cached): ``backend`` (an explicit name,
    None: none) else ``request`` (the context's validated request, None: automatic; a request naming
    nothing ``op`` implements means automatic for ``op``). ``case`` (default ``key``; a zero-argument
    callable is called once, on a miss) is what ``why_not`` is asked about. Callers go through
    ``titan_kernels.backend.request.choose``, which reads the request."""
    ck = (op, dev, backend, request, key)
    hit = _choices.get(ck)
    if hit is not None:
        return hit
    if case is None:
        case = key
    elif callable(case):
        case = case()
    name = backend
    if name is None and request is not None and request in implementation_names(op):
        name = request
    choice = _choices[ck] = (_choose_auto(op, dev, key, case) if name is None
                             else _choose_named(op, dev, case, name, why_requested))
    return choice


def _candidates(op: str, dev: str, family: str | None = None) -> list[Impl]:
    # A native family's implementations are candidates on their own device type only.
    impls = [i for i in _impls.get(op, ()) if i.family not in NATIVE or i.family == dev]
    if family is not None:
        order = _orders.get(op, {}).get(dev, ())
        fam = [i for i in impls if i.family == family]
        return sorted(fam, key=lambda i: order.index(i.name) if i.name in order else len(order))
    if dev in _orders.get(op, {}):
        by_name: dict[str, list[Impl]] = {}
        for i in impls:
            by_name.setdefault(i.name, []).append(i)
        return [i for n in _orders[op][dev] for i in by_name.get(n, ())]
    return [i for fam in DEFAULT_ORDER.get(dev, ("reference",)) for i in impls if i.family == fam]


def _why_not(impl: Impl, device: torch.device, case: Any) -> str | None:
    dev = device.type
    if impl.family in NATIVE and dev != impl.family:
        return f"runs on {impl.family.upper()} tensors, not {dev}"
    if impl.why_not is not None:
        why = impl.why_not(device, case)
    else:
        st = _status.family_status(impl.family, dev, triton_interpret())
        why = None if st.available else st.reason
    if why is None:  # it can run here: its kernel modules must import (asked once per key: choices are cached)
        why = next((w for fn in impl.kernels if isinstance(fn, LazyKernel) for w in (fn.why_not(),) if w), None)
    return why


def _why_not_auto(impl: Impl, device: torch.device, case: Any) -> str | None:
    if impl.auto is True:
        return None
    if impl.auto is False:
        return "runs only when asked for by name"
    return impl.auto(device, case)


def _choose_auto(op: str, dev: torch.device, key: Any, case: Any) -> Choice:
    skipped: list[tuple[str, str]] = []
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
        return Choice(op, impl.name, impl.family, impl.kernels, reason, tuple(skipped))
    detail = "; ".join(f"{n}: {w}" for n, w in skipped) or f"nothing is ordered for {dev.type} tensors"
    hint = _hints.get(op, "")
    raise RuntimeError(f"no backend can run titan op {op!r} on {dev.type} ({detail})" + (f"; {hint}" if hint else ""))


def _choose_named(op: str, dev: torch.device, case: Any, name: str, why_requested: str) -> Choice:
    check_name(name)
    if name in BACKENDS:
        if name not in implemented_backends(op):
            raise RuntimeError(f"backend {name!r} does not implement titan op {op!r}; implemented: "
                               f"{implementation_names(op)}")
        if name in NATIVE and dev.type != name:
            raise RuntimeError(f"backend {name!r} runs on {name} tensors, got {dev.type} tensors ({why_requested})")
        cands = _candidates(op, dev.type, family=name)
    else:
        cands = [i for i in _impls.get(op, ()) if i.name == name]
        if not cands:
            raise RuntimeError(f"backend {name!r} does not implement titan op {op!r}; implemented: "
                               f"{implementation_names(op)}")
        cands = [i for i in cands if i.family not in NATIVE or i.family == dev.type] or cands[:1]
    skipped: list[tuple[str, str]] = []
    for impl in cands:
        why = _why_not(impl, dev, case)
        if why is None:
            return Choice(op, impl.name, impl.family, impl.kernels, why_requested, tuple(skipped), True)
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
    EPOCH[0] += 1
    warnings.warn(f"titan {op}: backend {choice.backend!r} {why}; falling back to the next backend for such calls",
                  RuntimeWarning, stacklevel=3)
