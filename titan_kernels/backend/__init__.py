"""Which implementation of an op runs: the request (``request.py``: the ``use_backend`` context, the
``TITAN_KERNELS_BACKEND`` environment variable, ``capture_request``), the registry of every op's
implementations and the cached choice among them (``registry.py``), and what each backend family
can run on a device (``status.py``).

Backend families (``BACKENDS``):
  reference  plain PyTorch, float32 math; runs on every device (ground truth and fallback).
  triton     our Triton kernels; on CUDA, or on CPU tensors when ``TRITON_INTERPRET=1`` is set.
  cpu        native kernels for CPU tensors: ours from csrc/ (when the extension is built) or, for some
             ops, aten's (attention's ``sdpa_flash``, ``torch._grouped_mm``, ``torch._scaled_mm``).
  cuda       native kernels for CUDA tensors: ours from csrc/, aten's, or a library's (FlashAttention).
"""
from titan_kernels.backend.registry import (  # noqa: F401
    DEFAULT_ORDER, Choice, Impl, Kernels, LazyKernel, check_name, clear_choices, implementation, implementation_names,
    implementations, implemented_backends, mark_failed, register_impl, registered_ops, replace_impl, set_order,
    unregister,
)
from titan_kernels.backend.request import (  # noqa: F401
    AUTO, ENV_VAR, automatic, capture_request, choose, kernels, reload_environment, request_scope, requested_backend,
    resolve, use_backend,
)
from titan_kernels.backend.status import BACKENDS, BackendStatus, available_backends, backend_status  # noqa: F401
