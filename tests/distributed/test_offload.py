"""The memory levers on gloo CPU ranks: FSDP 2 with CPU offload, with activation offload, and both (a
per-layer mix), against FSDP 2 without, per step within 1e-6 relative (loss and gradient norm).

The optimizer is titan's ``fused_adamw_`` in every run (CPU offload picks it; the runs without offload
ask for it), so the runs differ by the lever alone. Where CPU offload puts things (parameters on the
host, TitanOptimizer, the FSDP2 policy) is checked in one process below, cheaply.

Slow (``pytest -m slow tests/distributed/test_offload.py``): a kill -9 of one rank mid-step under
torchrun with CPU offload and checkpoints, restarted and resumed, equal to the run without a kill;
float8 Linear layers with CPU offload; TP 2, PP 2 and Muon with the levers. What covers them by default: the resume path is the same DCP
checkpoint of FSDP2 DTensors as tests/distributed/test_fault_torchrun.py, with host-resident shards.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.launcher import free_port
from tests.distributed.layouts import COMMON, STEPS, records, run_layouts

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
REPO = Path(__file__).resolve().parents[2]
RTOL = 1e-6
TITAN_OPT = ["--optimizer.implementation", "titan"]
TITAN = ["--training.local_batch_size", "2", *TITAN_OPT]
CPU_OFFLOAD = ["--training.local_batch_size", "2", "--training.enable_cpu_offload"]
LAYOUTS = {
    "fsdp2": TITAN,
    "cpu_offload": CPU_OFFLOAD,
    "activation_offload": [*TITAN, "--activation_checkpoint.mode", "offload"],
    "both_per_layer": [*CPU_OFFLOAD, "--activation_checkpoint.mode", "selective",
                       "--activation_checkpoint.per_layer", "0-2:offload,5:offload"],
}


def assert_equal_runs(got, ref, steps=range(1, STEPS + 1)):
    assert not isinstance(got, str), got
    assert sorted(got) == list(steps), sorted(got)
    for s in steps:
        for key in ("loss", "grad_norm"):
            assert abs(got[s][key] - ref[s][key]) <= RTOL * abs(ref[s][key]), (s, key, got[s][key], ref[s][key])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_layouts(2, LAYOUTS, tmp_path_factory.mktemp("offload"))


@pytest.mark.parametrize("name", ["cpu_offload", "activation_offload", "both_per_layer"])
def test_offload_equals_fsdp2_without(runs, name):
    assert not isinstance(runs["fsdp2"], str), runs["fsdp2"]
    assert_equal_runs(runs[name], runs["fsdp2"])
    assert runs["fsdp2"][STEPS]["loss"] < runs["fsdp2"][1]["loss"] - 1.0  # it is learning


def test_cpu_offload_puts_the_state_on_the_host(tmp_path):
    from torch.distributed.fsdp import CPUOffloadPolicy

    from trainer.config import parse_args
    from trainer.optim import TitanOptimizer
    from trainer.train import Trainer

    config = parse_args([*COMMON, "--training.local_batch_size", "4", "--training.enable_cpu_offload",
                         "--training.steps", "3", "--job.dump_folder", str(tmp_path)])
    trainer = Trainer(config, world_size=1, rank=0, local_rank=0)
    try:
        assert trainer.setup()
        assert isinstance(trainer.optimizer, TitanOptimizer)
        policies = {type(m._get_fsdp_state()._fsdp_param_group.offload_policy) for m in trainer.model.modules()
                    if hasattr(m, "_get_fsdp_state") and m._get_fsdp_state()._fsdp_param_group is not None}
        assert policies == {CPUOffloadPolicy}
        before = [p.to_local().clone() for p in trainer.model.parameters()]
        trainer.train_step()  # the update runs in the background, unit by unit (OverlappedStep)
        assert trainer.optimizer._overlap is not None and len(trainer.optimizer._overlap.units) == 7  # root + 6 blocks
        trainer.optimizer.synchronize()
        assert all(not torch.equal(b, p.to_local()) for b, p in zip(before, trainer.model.parameters()))
        for p in trainer.model.parameters():
            assert p.to_local().device.type == "cpu"
            assert trainer.optimizer.state[p]["exp_avg"].to_local().device.type == "cpu"
        # A failure of the background update surfaces in the training thread, at the next forward.
        def fail(*args, **kw):
            raise RuntimeError("update failed")

        trainer.optimizer._adamw = fail
        trainer.train_step()  # launches the update that fails
        with pytest.raises(RuntimeError, match="update failed"):
            trainer.train_step()
    finally:
        trainer.close()


def _torchrun(folder: Path, *argv: str, restarts: int = 0, fault: str = ""):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--rdzv_backend", "c10d",
           "--rdzv_endpoint", f"127.0.0.1:{free_port()}", "--max-restarts", str(restarts), "-m", "trainer",
           *COMMON, *CPU_OFFLOAD, "--job.dump_folder", str(folder), *argv]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TRAINER_FAULT": fault,
           "TRITON_INTERPRET": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out


@pytest.mark.slow  # about 40 s on 2 cores: two torchrun runs of 2 ranks
def test_kill_9_mid_step_with_cpu_offload_resumes_exactly(tmp_path):
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "2"]
    _torchrun(tmp_path / "straight", *ckpt)
    out = _torchrun(tmp_path / "killed", *ckpt, restarts=1, fault="kill:rank=1:step=4:restart=0")
    assert "CPU offload:" in out.stdout
    straight, resumed = records(tmp_path / "straight"), records(tmp_path / "killed")
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for s in resumed:  # the restarted group resumed from step 2's checkpoint of host-resident shards
        assert resumed[s]["loss"] == straight[s]["loss"], s


@pytest.mark.slow  # about 30 s: float8 on CPU runs the reference casts
def test_float8_with_cpu_offload_equals_without(tmp_path):
    f8 = ["--float8.enable", "--float8.auto_filter_small_kgemms", "false"]
    got = run_layouts(2, {"f8": [*TITAN, *f8], "f8_offload": [*CPU_OFFLOAD, *f8]}, tmp_path)
    assert_equal_runs(got["f8_offload"], got["f8"])


@pytest.mark.slow  # about 60 s: TP 2, PP 2 and Muon with the levers (FSDP 2 covers the mechanisms by default)
def test_tensor_and_pipeline_parallel_and_muon_with_offload_equal_without(tmp_path):
    tp = ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"]
    pp = ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4"]
    got = run_layouts(2, {"tp2": [*tp, *TITAN_OPT], "tp2_off": [*tp, "--training.enable_cpu_offload"],
                          "pp2": [*pp, *TITAN_OPT],
                          "pp2_off": [*pp, "--training.enable_cpu_offload", "--activation_checkpoint.mode", "offload"],
                          "muon": ["--optimizer.name", "muon", *TITAN],
                          "muon_off": ["--optimizer.name", "muon", *CPU_OFFLOAD]},  # Newton-Schulz on the host
                      tmp_path)
    assert_equal_runs(got["muon_off"], got["muon"])
    assert_equal_runs(got["tp2_off"], got["tp2"])
    assert_equal_runs(got["pp2_off"], got["pp2"])


def test_activation_offload_under_tensor_parallel_without_fsdp_equals_without(tmp_path):
    """TP 2 alone (its parameters DTensors, not FSDP's) with activation offload died at the first forward:
    "RuntimeError: Attempted to access the data pointer on an invalid python storage" (the offloader read
    the DTensor parameters' storage, not their local shards')."""
    tp = ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"]
    got = run_layouts(2, {"tp2": tp, "tp2_act_off": [*tp, "--activation_checkpoint.mode", "offload"]}, tmp_path)
    assert_equal_runs(got["tp2_act_off"], got["tp2"])
