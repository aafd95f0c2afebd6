"""Fixtures of the multi-process tests."""
import pytest

from tests.distributed.layouts import reference


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The single-process run of the default job that the layouts are compared with
    (``tests.distributed.layouts.reference``: run once per session). A module comparing another job
    defines its own ``single``."""
    return reference(tmp_path_factory)
