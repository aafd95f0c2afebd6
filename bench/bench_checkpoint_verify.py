"""What the checkpoint manifest costs: save and load of a Llama 3 1B-shaped checkpoint (the model's
fp32 weights, 1.24e9 parameters, about 5 GB) with and without the manifest, in the same process.

    python -m pytest -m slow bench/bench_checkpoint_verify.py -s

Save: ``dcp.save`` alone vs. ``FolderWriter.write`` (DCP + hashing every file + manifest + rename).
Load: ``dcp.load`` alone vs. ``verify_files`` (size + XXH3 of every file) + ``dcp.load``. Each is
timed twice and the faster is kept (the second of each pair reads from the page cache, as a resume
right after a save does). Slow (about a minute, 10 GB of disk in a temporary folder).
"""
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from trainer.checkpoint.manifest import read_manifest, verify_files
from trainer.checkpoint.publish import FolderWriter
from trainer.models.llama3.args import LLAMA3_FLAVORS
from trainer.registry import build_model

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def _best(fn, n=2):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def test_manifest_cost_on_a_1b_checkpoint():
    args = LLAMA3_FLAVORS["1B"]
    meta = build_model(args, device="meta")
    state = {"model": {k: torch.empty(v.shape, dtype=torch.float32).normal_() for k, v in meta.state_dict().items()}}
    nbytes = sum(t.numel() * t.element_size() for t in state["model"].values())
    root = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir="/tmp"))
    try:
        plain = root / "plain"

        def save_plain():
            shutil.rmtree(plain, ignore_errors=True)
            dcp.save(state, checkpoint_id=str(plain))

        writer = FolderWriter(root / "ck")

        def save_manifest():
            writer.write(state, "step-1")

        t_save = _best(save_plain)
        t_save_m = _best(save_manifest)
        folder = root / "ck" / "step-1"
        record = read_manifest(folder)

        def load():
            dcp.load(state, checkpoint_id=str(folder))

        def verify():
            assert verify_files(folder, record) is None

        t_load = _best(load)
        t_verify = _best(verify)
        print(f"\n1B-shaped checkpoint: {nbytes:,} bytes of tensors, {record['total_bytes']:,} bytes on disk")
        print(f"save: dcp.save {t_save:.2f}s; with manifest {t_save_m:.2f}s (+{100 * (t_save_m / t_save - 1):.1f}%)")
        print(f"load: dcp.load {t_load:.2f}s; verification {t_verify:.2f}s = {100 * t_verify / t_load:.1f}% of the load")
        assert t_verify < 0.10 * t_load, (t_verify, t_load)
    finally:
        shutil.rmtree(root, ignore_errors=True)
