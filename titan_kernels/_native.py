"""Loader for the optional native extension (``titan_kernels._C``, built from csrc/).

The extension registers C++/CUDA kernels as ``torch.ops.titan.*_native`` ops. When it is absent or
fails to load, everything still works in pure Python and ``status`` says why.
"""
from __future__ import annotations

import functools
import pathlib

# Written by the build (csrc/setup_native.py) when the optional native build failed.
BUILD_ERROR_FILE = pathlib.Path(__file__).with_name("_C_build_error.txt")


def _build_error() -> str:
    try:
        return BUILD_ERROR_FILE.read_text().splitlines()[0]
    except (OSError, IndexError):
        return ""


@functools.lru_cache(maxsize=None)
def _load() -> tuple[object | None, str]:
    try:
        from titan_kernels import _C  # noqa: F401  (registers the ops on import)
    except ImportError as e:
        why = _build_error() or f"import failed: {e}"
        return None, f"the native extension titan_kernels._C is not available: {why}; see README 'Native kernels'"
    except OSError as e:  # a built .so that cannot be loaded (ABI mismatch, missing libcudart, ...)
        return None, f"the native extension titan_kernels._C failed to load: {e}"
    return _C, ""


def status(kind: str) -> tuple[bool, str]:
    """(available, reason) for the ``cpu`` or ``cuda`` part of the extension."""
    mod, why = _load()
    if mod is None:
        return False, why
    has = getattr(mod, f"has_{kind}", lambda: False)()
    if not has:
        why = _build_error() if kind == "cuda" else ""
        return False, f"the native extension was built without {kind} kernels" + (f" ({why})" if why else "")
    return True, ""


def autograd_apply():
    """The extension's ``autograd_apply`` (csrc/autograd_node.h), or None where it is not built."""
    mod, _ = _load()
    return getattr(mod, "autograd_apply", None)
