"""The ``torch.library.triton_op`` variants, registered on request only.

A triton_op variant (today: rms_norm's, ``rms_norm_triton_op.py``) is the form of an op that
Inductor traces into. Its module imports ``torch._inductor`` and ``torch._dynamo`` (``triton_op``,
``wrap_triton``), which would triple the time of ``import titan_kernels``; so ``titan_kernels`` does
not import it. ``enable_triton_op()`` registers the variants and routes the traced CUDA calls of the
public functions to them; ``TITAN_KERNELS_TRITON_OP=1`` in the environment when ``titan_kernels``
is imported does the same. Importing ``titan_kernels.ops.rms_norm_triton_op`` registers the variant
without the route (its ``rms_norm_triton_op`` calls it directly).
"""
from __future__ import annotations

import os

from titan_kernels.backend import backend_status
from titan_kernels.ops import rms_norm as _rms_norm


def enable_triton_op() -> None:
    """Register the triton_op variants (``titan::rms_norm_triton``, ``titan::add_rms_norm_triton`` and
    their backward) and route ``rms_norm`` / ``add_rms_norm`` there when they are traced on plain CUDA
    tensors (not on the eager fast path, not DTensor). Idempotent.

    Raises RuntimeError naming why when the variant cannot be registered (no triton package, or a
    torch without ``torch.library.triton_op``).
    """
    st = backend_status("triton", "cuda")
    if not st.available and "not installed" in st.reason:
        raise RuntimeError(f"enable_triton_op: {st.reason}")
    try:
        from titan_kernels.ops import rms_norm_triton_op  # noqa: F401  (registers the ops; imports Inductor)
    except ImportError as e:
        raise RuntimeError(f"enable_triton_op: the triton_op variant does not import: {e}") from e
    _rms_norm.set_triton_op_route(True)


def enable_from_environment() -> None:
    """``enable_triton_op()`` when ``TITAN_KERNELS_TRITON_OP=1`` (read when ``titan_kernels`` is imported)."""
    if os.environ.get(_rms_norm.TRITON_OP_ENV, "0") == "1":
        enable_triton_op()
