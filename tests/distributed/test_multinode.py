"""Multi-node launch on one machine: two torchrun agents ("nodes") on 127.0.0.1 rendezvous, and FSDP 2
over their ranks gives the single-process losses.

1. ``torchrun --nnodes 2 --node_rank {0,1} --master_addr 127.0.0.1`` twice (static rendezvous);
2. ``scripts/slurm/train.sbatch`` itself, with stand-ins for Slurm's ``srun`` (starts its command once
   per node, as srun does with one task per node) and ``scontrol`` (the node list), so its c10d
   rendezvous runs as on a cluster.

Each run is the debugmodel in fp32 on the CPU (gloo), global batch 4 x 32 tokens, 5 steps; the
losses must equal the single-process run's within 1e-4 (``tests.distributed.layouts``).
"""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.launcher import free_port
from tests.distributed.layouts import COMMON, assert_same, records

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
REPO = Path(__file__).resolve().parents[2]
TRAIN = [*COMMON, "--training.local_batch_size", "2"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    env.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **extra)
    return env


def _finish(procs: list[subprocess.Popen], timeout: float = 400) -> list[str]:
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append(out)
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    return outs


def test_two_torchrun_nodes_equal_one_process(tmp_path, single):
    port = str(free_port())
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
               "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", port,
               "-m", "trainer", *TRAIN, "--job.dump_folder", str(tmp_path / "run")]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outs = _finish(procs)
    assert "world 2" in outs[0] and "dp_shard=2" in outs[0], outs[0][-2000:]
    assert_same(records(tmp_path / "run"), single)


def _shim(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.mark.slow  # about a minute on 2 loaded cores; the torchrun test above covers the rendezvous by default
def test_slurm_script_rendezvous_equals_one_process(tmp_path, single):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # srun: one copy of the command per node, all at once (our two "nodes" share this machine).
    _shim(bin_dir, "srun", 'while [[ "$1" == --* ]]; do shift; done\n'
                           'for n in $(seq 1 "$SLURM_NNODES"); do SLURM_NODEID=$((n-1)) "$@" & done\n'
                           'status=0; for job in $(jobs -p); do wait "$job" || status=1; done; exit $status\n')
    _shim(bin_dir, "scontrol", 'echo 127.0.0.1\necho 127.0.0.1\n')
    env = _env(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_NNODES="2", SLURM_JOB_ID="4242",
               SLURM_JOB_NODELIST="node[1-2]", GPUS_PER_NODE="1", RDZV_PORT=str(free_port()), PYTHON=sys.executable)
    proc = subprocess.Popen(["bash", str(REPO / "scripts/slurm/train.sbatch"), *TRAIN,
                             "--job.dump_folder", str(tmp_path / "run")], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = _finish([proc])[0]
    assert "2 node(s) x 1 process(es), rendezvous at 127.0.0.1:" in out
    assert "world 2" in out, out[-2000:]
    assert_same(records(tmp_path / "run"), single)
