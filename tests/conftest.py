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

# pytest-xdist's workers share the machine's cores: each gets its share of intra-op threads (on 2 cores
# with 2 workers, one each), so a kernel test's parallel regions do not oversubscribe the cores.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
if _WORKERS > 1:
    _CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, _CORES // _WORKERS))

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


# The order files run in. pytest-xdist's ``--dist loadfile`` hands whole files to its workers in
# collection order, so a long file collected last leaves one worker running it alone. The folders
# of long files (process groups, subprocess runs, benchmarks) go first and the many short kernel
# tests last, where they fill both workers to the end; within a file the order is unchanged.
_FIRST = ("tests/distributed/", "bench/", "tests/test_", "tests/e2e/", "tests/trainer/")


def _rank(item) -> int:
    path = item.nodeid.split("::", 1)[0]
    return next((i for i, prefix in enumerate(_FIRST) if path.startswith(prefix)), len(_FIRST))


def pytest_collection_modifyitems(session, config, items):
    items[:] = [item for _, item in sorted(enumerate(items), key=lambda p: (_rank(p[1]), p[0]))]
