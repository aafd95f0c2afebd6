"""Qwen3 MoE (debugmodel_moe) under expert parallel and the other layouts equals one process.

On CPU gloo, float32, same seed and data (tests/distributed/layouts.py): per-step loss within 1e-4
and gradient norm within 1e-4 relative of the single-process run, for
  EP 2                 (2 ranks: dp_shard 2 = ep 2, experts not FSDP-sharded)
  PP 2                 (2 ranks, 1F1B, two MoE layers per stage)
  EP 2 x FSDP 2        (4 ranks: dp_shard 4 = 2 x ep 2, experts FSDP-sharded over 2 ranks)
  EP 2 x TP 2          (4 ranks: experts split on the expert dim over ep and on the hidden size over tp)
  PP 2 x EP 2          (4 ranks: each pipeline stage's experts split over its own ep pair, 1F1B)
  EP 2 -> 1 process    (a checkpoint of step 3 under EP 2 resumes in one process: steps 4, 5)
(EP 2 x FSDP 2, EP 2 x TP 2 and PP 2 x EP 2: ``-m slow``.) The load-balancing bias moves every step (aux-loss-free), so these also check that the token
counts are summed over the right ranks. Plus the pieces: the expert-major reordering of received
rows, the ep mesh and its errors.
"""
from pathlib import Path

import pytest
import torch

from tests.distributed.layouts import assert_same, reference, run_layouts
from trainer.parallel.expert_parallel import _expert_major
from trainer.parallel.parallel_dims import ParallelDims

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

MOE = ["--model.name", "qwen3", "--flavor", "debugmodel_moe"]
EP2 = ["--parallelism.expert_parallel_degree", "2"]
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "3"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return reference(tmp_path_factory, *MOE)


def test_ep2_pp2_equal_one_process_and_ep2_resumes_in_one_process(tmp_path, single):
    runs = run_layouts(2, {
        "ep2": [*MOE, *EP2, *CKPT, "--training.local_batch_size", "2"],
        "pp2": [*MOE, "--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
                "--training.local_batch_size", "4"],
    }, tmp_path)
    assert_same(runs["ep2"], single)
    assert_same(runs["pp2"], single)
    resumed = run_layouts(1, {"one": [
        *MOE, *CKPT, "--checkpoint.folder", str(Path(tmp_path) / "ep2" / "checkpoint"), "--checkpoint.load_step", "3",
        "--checkpoint.interval", "100", "--training.local_batch_size", "4"]}, tmp_path)
    assert_same(resumed["one"], single, steps=range(4, 6))


@pytest.mark.slow  # 4 ranks on 2 cores: ~35 s; the file stays under a minute without it
def test_ep2_with_fsdp2_and_with_tp2_equal_one_process(tmp_path, single):
    runs = run_layouts(4, {
        "ep2_fsdp2": [*MOE, *EP2, "--training.local_batch_size", "1"],
        "ep2_tp2": [*MOE, *EP2, "--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "2"],
    }, tmp_path)
    assert_same(runs["ep2_fsdp2"], single)
    assert_same(runs["ep2_tp2"], single)


@pytest.mark.slow  # 4 ranks on 2 cores, ~15 s; by default EP 2 and PP 2 each equal one process (the test above)
def test_pp2_x_ep2_equals_one_process(tmp_path, single):
    """Each pipeline stage runs expert parallel on its own (dp_shard 2 = ep 2) group: the mesh is
    (pp 2, dp_shard_mod_ep 1, ep 2), the stage's all-to-alls stay inside its pp slice. ~15 s."""
    runs = run_layouts(4, {"pp2_ep2": [*MOE, *EP2, "--parallelism.pipeline_parallel_degree", "2",
                                       "--training.local_batch_size", "2"]}, tmp_path)
    assert_same(runs["pp2_ep2"], single)
    # Rank 0 logs the loads of its own stage's MoE layers only: layers 0 and 1 of the 4.
    assert {k for k in runs["pp2_ep2"][1] if k.startswith("moe_load/")} == {"moe_load/layers.0", "moe_load/layers.1"}


# ------------------------------------------------------------------------------------------ pieces


@pytest.mark.parametrize("recv", [[[2, 0, 3], [1, 4, 0]], [[0, 0], [0, 0]], [[5]], [[0, 1], [2, 0], [0, 3]]])
def test_expert_major_reorders_blocks(recv):
    recv = torch.tensor(recv)
    ep, n_local = recv.shape
    # Rows labelled (source, expert, j) in source-major order, as the all-to-all delivers them.
    rows = [(s, e, j) for s in range(ep) for e in range(n_local) for j in range(int(recv[s, e]))]
    perm = _expert_major(recv)
    assert [rows[i] for i in perm.tolist()] == sorted(rows, key=lambda r: (r[1], r[0], r[2]))


def test_ep_degree_must_divide_dp_shard_and_excludes_cp_and_hsdp():
    assert ParallelDims(1, -1, 4, ep=2).dp_shard_mod_ep == 2
    assert "ep=2" in ParallelDims(1, -1, 4, ep=2).describe()
    with pytest.raises(ValueError, match="expert_parallel_degree: 3 does not divide data_parallel_shard_degree = 4"):
        ParallelDims(1, -1, 4, ep=3)
    with pytest.raises(ValueError, match="expert_parallel_degree: not supported with context_parallel"):
        ParallelDims(1, -1, 4, cp=2, ep=2)
    with pytest.raises(ValueError, match="expert_parallel_degree: expected an integer >= 1"):
        ParallelDims(1, -1, 4, ep=0)


def test_expert_parallel_needs_experts_to_split():
    from trainer.models.qwen3.args import QWEN3_FLAVORS
    from trainer.parallel.expert_parallel import check_ep_divisibility

    moe = QWEN3_FLAVORS["debugmodel_moe"]  # 8 experts of hidden 256
    check_ep_divisibility(moe, 8, 2)
    with pytest.raises(ValueError, match="expert_parallel_degree: 3 does not divide the model's num_experts = 8"):
        check_ep_divisibility(moe, 3, 1)
    with pytest.raises(ValueError, match="tensor_parallel_degree: 3 does not divide the experts' hidden_dim = 256"):
        check_ep_divisibility(moe, 1, 3)
    with pytest.raises(ValueError, match="expert_parallel_degree: the model has no mixture-of-experts layers"):
        check_ep_divisibility(QWEN3_FLAVORS["debugmodel"], 2, 1)
