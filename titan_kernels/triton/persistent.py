"""How many programs a persistent Triton kernel launches: a few per SM on CUDA, bounded by its work.

Persistent kernels (RMSNorm's backward, the grouped GEMMs, the float8 GEMM) launch a fixed grid whose
programs stride over a list of tiles, so the grid follows the device (its streaming multiprocessor
count), not the problem size. Off CUDA (the interpreter) 4 programs exercise the striding.
"""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    """The number of streaming multiprocessors of CUDA device ``index``."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_programs(device: torch.device, bound: int, per_sm: int = 1) -> int:
    """Programs for ``bound`` tiles on ``device``: min(bound, per_sm * SMs) on CUDA, min(bound, 4)
    elsewhere; at least 1."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return max(1, min(bound, per_sm * sm_count(index)))
    return max(1, min(bound, 4))
