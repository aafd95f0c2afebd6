"""Our Triton kernels, one module per op. Importing this package does not import triton."""
from __future__ import annotations

import os


def triton_interpret() -> bool:
    """True when Triton kernels run in the interpreter (``TRITON_INTERPRET=1``), i.e. on CPU tensors.

    Read from the live environment (the backend registry asks only when it builds a choice; see
    ``titan_kernels.backend.reload_environment`` after changing it in a running process)."""
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")
