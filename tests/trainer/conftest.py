"""Fixtures shared by the trainer tests."""
import pytest
import torch


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (restored after): the CPU is shared, and one thread keeps the
    small in-process training runs fast and steady under contention. Used by whole modules through
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
