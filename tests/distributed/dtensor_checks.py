"""What the DTensor tests of the ops share: a sharded result, gathered, against the unsharded one."""
from __future__ import annotations

import torch


def assert_gathered_close(*pairs, rtol: float, atol: float) -> None:
    """Each ``(dtensor, want)``: the DTensor gathered (``full_tensor``) equals ``want`` within the tolerances."""
    for got, want in pairs:
        torch.testing.assert_close(got.full_tensor(), want, rtol=rtol, atol=atol)
