"""Shared test fixtures.

Triton kernels run on CPU tensors under the interpreter; the variable must be set before triton is
imported anywhere, so it is set here for the whole test session.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pathlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

SHARED_DATA = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture
def shared_data() -> pathlib.Path:
    """The repository-external test data folder (tinyshakespeare, a real tokenizer)."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared test data not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
