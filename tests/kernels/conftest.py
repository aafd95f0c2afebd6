"""Fixtures of the kernel tests."""
import pytest

from titan_kernels import backend
from titan_kernels.ops.fp8 import scaled_mm


@pytest.fixture
def scaled_mm_when_available(monkeypatch):
    """torch._scaled_mm as the automatic fp8_gemm wherever it runs. On a CPU where it is slower than
    the dequantized GEMM the automatic choice skips it (``scaled_mm._cpu_scaled_mm_pays``); the fp8
    tests that check it take it there too (``pytestmark = pytest.mark.usefixtures(...)``)."""
    monkeypatch.setattr(scaled_mm, "_cpu_scaled_mm_pays", lambda: True)
    backend.clear_choices()  # choices are cached per case: decide again with the patched timing
    yield
    backend.clear_choices()


@pytest.fixture
def backend_env(monkeypatch):
    """``set(value)``: TITAN_KERNELS_BACKEND set to ``value`` (None: unset) and read again, as a
    process that starts with it would; the environment and the request are restored after."""
    def set_env(value):
        if value is None:
            monkeypatch.delenv(backend.ENV_VAR, raising=False)
        else:
            monkeypatch.setenv(backend.ENV_VAR, value)
        backend.reload_environment()

    yield set_env
    monkeypatch.undo()
    backend.reload_environment()
