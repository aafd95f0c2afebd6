"""The op scaffold: an op declares its implementations, its forward and backward bodies with their
fakes, what its forward saves and how it differentiates, and its sharding rules, once; ``Op`` builds
the rest of the op contract from them (DESIGN.md, "Add an op"):

- the custom ops ``titan::{name}`` and ``titan::{name}_backward`` (``torch.library.custom_op``, the
  schema from the bodies' annotations) with their fake implementations;
- autograd through ``register_autograd`` on the op path and, for plain eager calls, an
  ``autograd.Function`` that runs the same bodies and the same ``setup``/``grads`` without the
  dispatcher (``eager_route``; about a third of a ``custom_op`` call's cost); for an op's planned
  calls (``eager_apply``, decided once per case by its public function), the native autograd node
  of ``csrc/autograd_node.cpp`` carrying the same ``setup``/``grads`` (about 4 us less a call);
- the hand-off of the backend request from the forward to the backward, in one idiom: every body's
  last parameter is ``backend: str | None = None``; a forward gets ``capture_request(name)``, and
  ``ctx.backend`` (that request, or the one in force when a direct op call ran) goes to the backward;
- a RuntimeError naming the op for a derivative it does not implement (never a silent zero);
- the DTensor sharding rules (``register_sharding``), when torch.distributed is available, once
  ``torch.distributed.tensor`` is imported (``_sharding.py``: ``import titan_kernels`` does not import it).

An op's own module keeps what is particular to it: its validation, its kernels' adapters, its bodies,
``setup`` and ``grads``, and its public function, which validates and calls ``op(*args)``.

``grads(ctx, *grad_outputs)`` returns one gradient per argument of the body but ``backend``; it runs
the backward through ``op.backward(*args, ctx.backend)``, which takes the fast path or the op as the
forward did (eager or traced, plain tensors or DTensor), so one definition serves both paths.
"""
from __future__ import annotations

import contextlib
import inspect
import operator
import sys
import typing
from typing import Any, Callable

import torch

from titan_kernels import _native
from titan_kernels import backend as _backend
from titan_kernels.backend import Kernels, LazyKernel, capture_request
from titan_kernels.ops import _sharding
from titan_kernels.ops._common import FAST, FAST_GRAD, eager_route_untraced

_TENSOR_TYPES = (torch.Tensor, typing.Optional[torch.Tensor], torch.Tensor | None)


def _tensor_positions(fn: Callable) -> tuple[int, ...]:
    """The positions of ``fn``'s tensor (or optional tensor) parameters: what the fast path checks."""
    hints = typing.get_type_hints(fn)
    params = list(inspect.signature(fn).parameters)
    return tuple(i for i, p in enumerate(params) if hints.get(p) in _TENSOR_TYPES)


def _check_backend_last(fn: Callable, qualname: str) -> None:
    params = list(inspect.signature(fn).parameters.values())
    if not params or params[-1].name != "backend" or params[-1].default is not None:
        raise TypeError(f"{qualname}: the body's last parameter must be `backend: str | None = None`")


def _schema_with_backend(signature: Callable, mutates_args: tuple[str, ...]) -> str:
    """The schema of ``signature`` (a kernel contract, e.g. the reference's function) with the
    trailing ``str? backend=None`` every body takes."""
    schema = torch.library.infer_schema(signature, mutates_args=mutates_args)
    params, ret = schema.split(" -> ", 1)
    return f"{params[:-1]}{', ' if params != '()' else ''}str? backend=None) -> {ret}"


def _placements_for_given(rule: Callable) -> Callable:
    """``rule`` declares placements for every argument of the schema; a call that leaves trailing
    defaults out (``backend``) gets the rules of the arguments it gave."""

    def given(*args):
        return [(outs, ins[:len(args)]) for outs, ins in rule(*args)]

    return given


# ``torch.autograd.Function.apply`` is a Python prologue (bind the arguments when the class defines a
# setup_context, route to functorch when a transform is active, unwrap dead functorch wrappers) before
# the C apply (``_FunctionBase.apply``): about 2 us of a 20 us small call. The eager fast path runs only
# when ``eager_route`` found no functorch transform active, and its Function defines no setup_context,
# so it calls the C apply directly and unwraps dead wrappers itself (``_live``), as the prologue would.
_C_APPLY = getattr(getattr(torch._C, "_FunctionBase", None), "__dict__", {}).get("apply")
_unwrap_if_dead = getattr(getattr(torch._C, "_functorch", None), "unwrap_if_dead", None)


def _direct_apply(cls: type) -> Callable:
    """``cls.apply`` without ``Function.apply``'s Python prologue (see ``_C_APPLY``); ``cls.apply``
    where this torch has no C apply to bind."""
    if _C_APPLY is None or _unwrap_if_dead is None:
        return cls.apply
    try:
        return _C_APPLY.__get__(None, cls)
    except TypeError:
        return cls.apply


def _identity(t):
    return t


# A tensor with a dead functorch wrapper unwrapped (``Function.apply``'s own step), else the tensor.
unwrap_dead: Callable = _unwrap_if_dead if _unwrap_if_dead is not None else _identity


def _live(tensors: tuple) -> tuple:
    """The tensors with dead functorch wrappers unwrapped (``unwrap_dead``; None entries stay None)."""
    return tuple([t if t is None else unwrap_dead(t) for t in tensors])


# Where no gradient is recorded (an autograd.Function's forward, a planned call's no-grad body), views
# need no autograd metadata: the body runs below the ADInplaceOrView dispatch key, as a custom op's
# body runs below Autograd (about a microsecond of a small attention call: its kernel's views).
below_views: Callable = getattr(torch._C, "_AutoDispatchBelowADInplaceOrView", None) or contextlib.nullcontext


class NativeContext:
    """The ctx an op's ``setup`` gets on the native planned path: what it uses of an
    autograd.Function's ctx (``save_for_backward``; attributes for the backward)."""

    def save_for_backward(self, *tensors) -> None:
        self.to_save = tensors  # (taken, and cleared, by the native node)


class _BackwardContext:
    """One native backward call's ctx for ``grads``: the tensors saved, unpacked for this call (a
    retained graph may be differentiated by several threads at once), and the forward's attributes."""

    __slots__ = ("saved_tensors", "_forward")

    def __init__(self, forward: NativeContext, saved_tensors: tuple):
        self.saved_tensors, self._forward = saved_tensors, forward

    def __getattr__(self, name: str):
        return getattr(self._forward, name)


def _compiled_autograd_on() -> bool:
    # (compiled autograd cannot trace the native node's Python backward; its module is loaded by then)
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return ca is not None and bool(getattr(ca, "compiled_autograd_enabled", False))


def planned_carrier(direction: "_Direction") -> Callable:
    """The planned call of ``direction``: the native node with its ``native_spec`` where the extension
    has one (``titan_kernels._C.autograd_apply``), else (and while compiled autograd is on, which
    cannot trace the node) its autograd.Function."""
    native = _native.autograd_apply()
    if native is None:
        return direction.planned_apply
    spec, function = direction.native_spec, direction.planned_apply

    def apply(plan, args, *tensors):
        if _compiled_autograd_on():
            return function(plan, args, *tensors)
        return native(spec, plan, args, *tensors)

    return apply


def no_context(ctx, inputs, output) -> None:
    """The setup_context of an op whose backward refuses: nothing to save."""


def _refusal(qualname: str, what: str) -> Callable:
    msg = f"{qualname}: {what} is not implemented"

    def backward(ctx, *grads):
        raise RuntimeError(msg)

    return backward


class _Direction:
    """One custom op of an ``Op`` (its forward or its backward) and everything that calls it."""

    def __init__(self, op: "Op", suffix: str, body: Callable, fake: Callable, setup: Callable | None,
                 grads: Callable | None, mutates_args: tuple[str, ...], materialize_grads: bool,
                 differentiable: bool = True, fast_body: Callable | None = None, signature: Callable | None = None,
                 planned_body: Callable | None = None):
        self.qualname = f"titan::{op.name}{suffix}"
        _check_backend_last(body, self.qualname)
        self.body = fast_body or body  # what the fast path runs
        positions = _tensor_positions(signature or body)
        # The tensors of a call as a tuple (itemgetter: C speed, on every call).
        self.tensors = operator.itemgetter(*positions) if len(positions) > 1 else (
            (lambda args, _i=positions[0]: (args[_i],)) if positions else (lambda args: ()))
        schema = None if signature is None else _schema_with_backend(signature, mutates_args)
        self.custom_op = torch.library.custom_op(self.qualname, body, mutates_args=mutates_args, schema=schema)
        self.custom_op.register_fake(fake)
        self.overload = getattr(torch.ops.titan, op.name + suffix).default
        self.fn_cls = self.planned_apply = self.native_spec = None
        if not differentiable:  # an optimizer's step: no autograd at all (its public function refuses grads)
            return
        name = op.request_of
        if grads is None:
            what = "double backward" if suffix else "a backward (it is not differentiable)"
            backward, setup_context = _refusal(self.qualname, what), no_context
        else:
            def setup_context(ctx, inputs, output):
                request = inputs[-1]
                ctx.backend = request if request is not None else capture_request(name)
                if setup is not None:
                    setup(ctx, inputs, output)

            def backward(ctx, *grad_outputs):
                return (*grads(ctx, *grad_outputs), None)

        self.custom_op.register_autograd(backward, setup_context=setup_context)

        fast, pick, n = self.body, self.tensors, len(positions)

        # The eager fast path: the same body, setup and grads, as an autograd.Function of this op,
        # applied to the call's tensors and then the whole argument tuple (``backend`` last): autograd
        # sees the tensors, the body its arguments, and Function.apply's per-argument cost is paid for
        # the tensors only. Its backward returns the body's gradients of those tensors (None for the
        # argument tuple).
        def fn_forward(ctx, *tensors_then_args):
            args = tensors_then_args[n]
            if not materialize_grads:
                ctx.materialize_grads = False  # (what ctx.set_materialize_grads(False) sets, without its call)
            out = fast(*args)
            if setup_context is not no_context:  # (setup_context inline: every call)
                request = args[-1]
                ctx.backend = request if request is not None else capture_request(name)
                if setup is not None:
                    setup(ctx, args, out)
            return out

        def fn_backward(ctx, *grad_outputs):
            return (*pick(backward(ctx, *grad_outputs)), None)

        self.fn_cls = self._function("eager", fn_forward, fn_backward)
        self.apply = _direct_apply(self.fn_cls)  # only where eager_route said FAST_GRAD: see _C_APPLY
        if planned_body is None or setup_context is no_context:
            return

        # A planned call (``Op.eager_apply``): ``(plan, args, *tensors)`` with ``tensors`` a leading run
        # of the body's tensors (those that may carry a gradient; the rest are None in ``args``).
        # ``planned_body(plan, args)`` returns (the body's outputs, what the call returns: those outputs
        # or the first alone): an output the caller drops is not an output of the node, so autograd
        # does not track it (a tenth of a small call), and its gradient reaches ``grads`` as None. The
        # body runs where no gradient is recorded, below autograd's view tracking (``below_views``).
        # Two carriers of the same setup and grads: the native node (``titan_kernels._C.autograd_apply``,
        # about 4 us cheaper a call) where the extension is built, else an autograd.Function.
        n_outputs = len(self.overload._schema.returns)
        hidden = {k: (None,) * (n_outputs - k) for k in range(1, n_outputs + 1)}

        def planned_grads(ctx, grad_outputs):
            return pick(backward(ctx, *grad_outputs, *hidden[len(grad_outputs)]))

        def planned_forward(ctx, plan, args, *tensors):
            if not materialize_grads:
                ctx.materialize_grads = False
            with below_views():
                out, seen = planned_body(plan, args)
            setup_context(ctx, args, out)
            return seen

        def planned_backward(ctx, *grad_outputs):
            # (the gradients of the tensors not given are None: autograd drops trailing Nones)
            return (None, None, *planned_grads(ctx, grad_outputs))

        def native_forward(plan, args):  # (run by the native node: grad off, below view tracking)
            ctx = NativeContext()
            out, seen = planned_body(plan, args)
            setup_context(ctx, args, out)
            return seen, ctx

        def native_backward(ctx, saved_tensors, *grad_outputs):
            return planned_grads(_BackwardContext(ctx, saved_tensors), grad_outputs)

        if not materialize_grads or n_outputs == 1:
            self.planned_apply = _direct_apply(self._function("planned", planned_forward, planned_backward))
            self.native_spec = (native_forward, native_backward, self.qualname)

    def _function(self, kind: str, forward: Callable, backward: Callable) -> type:
        return type(f"{self.qualname.split('::')[1]}_{kind}", (torch.autograd.Function,), {
            "forward": staticmethod(forward), "backward": staticmethod(backward),
            "__doc__": f"The {kind} eager path of {self.qualname}.",
        })

    def call(self, args: tuple) -> Any:
        """The body on ``args`` (its arguments, ``backend`` last): directly in plain eager mode (through
        the autograd.Function when a gradient is recorded), else through the custom op."""
        if not torch.compiler.is_compiling():  # (traced code takes the op; itemgetter does not trace)
            tensors = self.tensors(args)
            route = eager_route_untraced(tensors)
            if route == FAST or (route == FAST_GRAD and self.fn_cls is None):
                return self.body(*args)
            if route == FAST_GRAD:
                return self.apply(*_live(tensors), args)
        return self.overload(*args)


class Op:
    """A titan op in the making: ``Op(name)``, then its implementations (``register``,
    ``register_triton``, ``register_native``; every implementation of every op registers through
    these) and, where the families' default order is not the op's, ``set_order(ORDER)``; then
    ``define`` with its bodies; ``op(*args)`` runs it.

    ``kernels(device, backend, key)`` inside a body gives the chosen implementation's ``Kernels``.
    """

    def __init__(self, name: str, impls: str | None = None, composite: bool = False):
        self.name = name
        self.impls = impls or name  # the registry entry: its own, or another op's (add_rms_norm: rms_norm's)
        # A composite op's kernels are other titan ops (fp8_linear: fp8_quantize, fp8_gemm): it captures
        # the request as it is and its bodies run under ``request_scope(backend)``.
        self.request_of = None if composite else self.impls
        self._forward: _Direction | None = None
        self._backward: _Direction | None = None

    # ------------------------------------------------------------------------- implementations

    def register(self, family: str, kernels: Any, **options: Any) -> None:
        """``titan_kernels.backend.register_impl`` for this op (``options``: name, why_not, auto)."""
        _backend.register_impl(self.impls, family, kernels, **options)

    def register_triton(self, module: str, *names: str, kind: type = Kernels, **options: Any) -> None:
        """Register the Triton kernels ``module.<names>`` (as ``kind(*those)``: by default
        ``Kernels(forward, backward)``), each imported at its first call (``LazyKernel``: importing
        triton is not part of ``import titan_kernels``). Without the triton package the family is
        unavailable and says why (``backend_status``): asking for it raises with that reason."""
        self.register("triton", kind(*(LazyKernel(module, n) for n in names)), **options)

    def register_native(self, kernels: Any, families: tuple[str, ...] = ("cpu", "cuda"), **options: Any) -> None:
        """Register the csrc kernels in each native family (available where the extension is built)."""
        for family in families:
            self.register(family, kernels, **options)

    def set_order(self, order: dict[str, tuple[str, ...]], **options: Any) -> None:
        """The op's automatic order per device type, fastest first (its module's ``ORDER``):
        ``titan_kernels.backend.set_order`` for this op (``options``: rank, hint). Without it the
        families' ``DEFAULT_ORDER`` holds."""
        _backend.set_order(self.impls, order, **options)

    def kernels(self, device: torch.device, backend: str | None = None, key: Any = None) -> Kernels:
        """The ``Kernels`` of the implementation chosen for ``device`` and ``key`` under ``backend`` (a
        body's ``backend`` argument: a request, ``AUTO`` or None for the one in force)."""
        return _backend.choose(self.impls, device, key, backend=backend).kernels

    # ------------------------------------------------------------------------- the ops

    def define(self, forward: Callable, fake: Callable, *, setup: Callable | None = None,
               grads: Callable | None = None, backward: Callable | None = None,
               backward_fake: Callable | None = None, backward_setup: Callable | None = None,
               backward_grads: Callable | None = None, sharding: Callable | None = None,
               backward_sharding: Callable | None = None, mutates_args: tuple[str, ...] = (),
               materialize_grads: bool = True, differentiable: bool = True,
               fast_forward: Callable | None = None, signature: Callable | None = None,
               planned_forward: Callable | None = None) -> "Op":
        """Build ``titan::{name}`` from ``forward`` (its body; the schema from its annotations, last
        parameter ``backend: str | None = None``) and ``fake``; with ``grads``, its autograd
        (``setup(ctx, inputs, output)`` saves, ``grads(ctx, *grad_outputs)`` returns one gradient per
        argument but ``backend``); with ``backward`` (+ ``backward_fake``), ``titan::{name}_backward``,
        differentiable when ``backward_grads`` is given (double backward), else refusing it.
        ``sharding``/``backward_sharding``: DTensor rules (``register_sharding``'s contract).
        ``materialize_grads`` False: ``grads`` receives None for an output with no gradient.
        ``differentiable`` False: no autograd at all (an optimizer step; ``mutates_args`` names what
        it writes in place). ``fast_forward``: the forward body of the eager fast path where it may
        skip what only the op path needs (the fake's output strides). ``planned_forward(plan, args)``:
        the fast forward body of a planned call (``eager_apply``), given what its caller decided once
        per case and the body's arguments as one tuple; it returns (what the body would, what the call
        returns: that, or its first output alone where the caller drops the rest, which then get no
        gradient; more than one output needs ``materialize_grads`` False). ``signature``: the kernel
        contract the forward's schema is taken from (e.g. the reference function, annotated), the
        body then taking its arguments plus ``backend``."""
        if backward is not None:
            self._backward = _Direction(self, "_backward", backward, backward_fake, backward_setup, backward_grads,
                                        (), True)
        self._forward = _Direction(self, "", forward, fake, setup, grads, mutates_args, materialize_grads,
                                   differentiable, fast_forward, signature, planned_forward)
        # The forward's planned call, for an op's own public function that decided the case once:
        # ``eager_apply(plan, args, *tensors)`` with ``tensors`` a leading run of the body's tensor
        # arguments that holds every one that may need a gradient, each through ``unwrap_dead``;
        # ``args`` its arguments, ``backend`` last (``capture_request``); ``plan`` what the caller
        # decided, given with the arguments to ``planned_forward``. Only where ``eager_route`` is
        # FAST_GRAD (no functorch transform active). The same setup and grads as every other path
        # (one autograd definition); the direct C apply (see _C_APPLY).
        self.eager_apply = None
        if self._forward.planned_apply is not None:
            def first_planned_call(*call):  # (the extension is loaded at the first call, not at import)
                self.eager_apply = planned_carrier(self._forward)
                return self.eager_apply(*call)

            self.eager_apply = first_planned_call
        if torch.distributed.is_available():  # (registered once torch.distributed.tensor is imported)
            for direction, rule in ((self._forward, sharding), (self._backward, backward_sharding)):
                if rule is not None:
                    _sharding.register(direction.overload, _placements_for_given(rule))
        return self

    @property
    def op(self):
        """The forward's ``torch.ops.titan`` overload."""
        return self._forward.overload

    @property
    def backward_op(self):
        """The backward's ``torch.ops.titan`` overload."""
        return self._backward.overload

    def __call__(self, *args: Any) -> Any:
        """The forward on ``args`` (its arguments but ``backend``), with the request in force captured
        for the backward when one will run (``capture_request``)."""
        d = self._forward
        if not torch.compiler.is_compiling():  # (traced code takes the op; itemgetter does not trace)
            tensors = d.tensors(args)
            route = eager_route_untraced(tensors)
            if route == FAST or (route == FAST_GRAD and d.fn_cls is None):
                return d.body(*args, None)
            if route == FAST_GRAD:
                return d.apply(*_live(tensors), (*args, capture_request(self.request_of)))
        return d.overload(*args, capture_request(self.request_of))


    def call(self, *args: Any) -> Any:
        """The forward on ``args`` with its ``backend`` given last (a request, ``AUTO`` or an
        implementation the caller chose)."""
        return self._forward.call(args)

    def backward(self, *args: Any) -> Any:
        """The backward on ``args`` (``backend`` last: ``ctx.backend``), by the path the forward took."""
        return self._backward.call(args)
