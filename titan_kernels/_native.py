"""Loader for the optional native extension (``titan_kernels._C``, built from csrc/).

The extension registers C++/CUDA kernels as ``torch.ops.titan.*_native`` ops. When it is absent or
fails to load, everything still works in pure Python and ``status`` says why.
"""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def _load() -> tuple[object | None, str]:
    try:
        from titan_kernels import _C  # noqa: F401  (registers the ops on import)
    except ImportError as e:
        return None, f"the native extension titan_kernels._C is not built ({e}); see README 'Native kernels'"
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
        return False, f"the native extension was built without {kind} kernels"
    return True, ""
