"""Helpers shared by the kernel tests: the backends that run here and the relative error."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import TEST_DEVICE

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def backends_here(op: str | None = None, names: tuple[str, ...] = ("reference", "triton", TEST_DEVICE)) -> list:
    """Each backend of ``names`` as a pytest param, skipped with its reason when it cannot run on the
    test device (or, given ``op``, does not implement it)."""
    from titan_kernels import backend

    out = []
    for name in names:
        st = backend.backend_status(name, TEST_DEVICE)
        why = None
        if not st.available:
            why = f"{name} backend unavailable: {st.reason}"
        elif op is not None and name not in backend.implemented_backends(op):
            why = f"{name} backend has no {op} kernel"
        marks = [pytest.mark.skip(reason=why)] if why else []
        out.append(pytest.param(name, marks=marks, id=name))
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (0 for empty tensors)."""
    a, b = a.double(), b.double()
    if b.numel() == 0:
        return 0.0
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
