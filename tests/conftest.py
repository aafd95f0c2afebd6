"""Shared test fixtures.

Kernel tests run on ``TITAN_TEST_DEVICE`` (default ``cpu``; ``cuda`` on a GPU machine, see
bench/run_gpu.sh). On the CPU, Triton kernels run under the interpreter; the variable must be set
before triton is imported anywhere, so it is set here for the whole test session.
"""
import os

TEST_DEVICE = os.environ.get("TITAN_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pathlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# Shipped with the repository (tests/data/README.md says what and from where), so no test skips
# on a fresh clone for want of data.
SHARED_DATA = pathlib.Path(__file__).resolve().parent / "data"


@pytest.fixture
def shared_data() -> pathlib.Path:
    """The test data folder: ``tinyshakespeare.txt`` (340 KB of text) and ``tokenizer/tokenizer.json``."""
    return SHARED_DATA


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
