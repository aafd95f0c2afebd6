"""The ops' DTensor sharding rules, registered when ``torch.distributed.tensor`` is imported.

``register_sharding`` lives in ``torch.distributed.tensor``, whose import (sympy, the sharding
propagator) costs about half a second, half of ``import torch``; a program that never makes a
DTensor should not pay it for ``import titan_kernels``. A DTensor exists only once that module is
imported, so the rules wait for it: registered at once when it is imported already, else right after
its import finishes (a finder on ``sys.meta_path`` that wraps that one module's loader and then
steps aside). Either way every rule is in place before the first DTensor reaches an op.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Callable

_MODULE = "torch.distributed.tensor"
_pending: list[tuple[object, Callable]] = []


def register(overload, rule: Callable) -> None:
    """``register_sharding(overload)(rule)``, now or once ``torch.distributed.tensor`` is imported."""
    _pending.append((overload, rule))
    if _MODULE in sys.modules and getattr(sys.modules[_MODULE], "DTensor", None) is not None:
        _flush()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


def _flush() -> None:
    from torch.distributed.tensor.experimental import register_sharding

    while _pending:
        overload, rule = _pending.pop(0)
        register_sharding(overload)(rule)


class _Loader(importlib.abc.Loader):
    """``torch.distributed.tensor``'s own loader, then the pending rules."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        _flush()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds ``torch.distributed.tensor`` through the other finders, with ``_Loader`` around its loader."""

    def find_spec(self, name, path=None, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)  # once: the other finders answer, and later imports skip this one
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec
