"""Loaded only by ``bash bench/run_gpu.sh --dry-run`` (on PYTHONPATH there): the packages the GPU test
machine does not have (FIELD-NOTES: no tensorboard, tiktoken, sentencepiece, pyarrow, datasets,
torchao, Liger, flash-attn) cannot be imported in the dry run either, so a stage that would need one
on the GPU fails here first. The list is ``BENCH_DRY_ABSENT`` (comma-separated top-level names).
"""
import importlib.abc
import os
import sys

_ABSENT = {n.strip() for n in os.environ.get("BENCH_DRY_ABSENT", "").split(",") if n.strip()}


class _AbsentOnTheGpuMachine(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in _ABSENT:
            raise ModuleNotFoundError(
                f"No module named {name!r} (not installed on the GPU machine; bench/run_gpu.sh --dry-run)", name=name)
        return None


if _ABSENT:
    sys.meta_path.insert(0, _AbsentOnTheGpuMachine())
