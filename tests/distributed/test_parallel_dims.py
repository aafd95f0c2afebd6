"""The layout itself: ParallelDims arithmetic and errors, the named 5-D mesh and its flattened dims
(16 ranks of a fake process group in this one process), pipeline stage plans, the context-parallel
split, and the one-line errors of every bad layout (each naming its config key). No training here;
a few seconds in all.
"""
import pytest
import torch
import torch.distributed as dist

from trainer import train
from trainer.config import ConfigError, parse_args
from tests.trainer.helpers import llama_model_args as model_args
from trainer.parallel.context_parallel import zigzag_indices
from trainer.parallel.parallel_dims import ParallelDims, submesh
from trainer.parallel.pipeline import plan_stages
from trainer.parallel.tensor_parallel import check_tp_divisibility


# ------------------------------------------------------------------------------------------ ParallelDims


def test_dp_shard_takes_the_rest_of_the_world():
    d = ParallelDims(1, -1, 16, tp=2, pp=2, cp=2)
    assert (d.dp_shard, d.dp_size, d.fsdp_size) == (2, 2, 4)
    assert d.degrees == {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 2}
    assert d.describe() == "pp=2 x dp_replicate=1 x dp_shard=2 x cp=2 x tp=2 (world 16)"
    d = ParallelDims(2, -1, 8, tp=2)
    assert (d.dp_shard, d.dp_size, d.hsdp_enabled, d.tp_enabled, d.pp_enabled, d.cp_enabled) == (2, 4, True, True,
                                                                                                   False, False)
    # Tensor or pipeline parallel alone: nothing for FSDP2 to shard over.
    assert not ParallelDims(1, -1, 2, tp=2).fsdp_enabled and not ParallelDims(1, -1, 2, pp=2).fsdp_enabled
    # Context parallel ranks hold the same parameters: FSDP2 averages over them too.
    assert ParallelDims(1, -1, 2, cp=2).fsdp_enabled


@pytest.mark.parametrize("args, kwargs, message", [
    ((1, -1, 8), {"tp": 3}, "parallelism.tensor_parallel_degree: 3 does not divide the world size 8"),
    ((1, -1, 8), {"pp": 3}, "parallelism.pipeline_parallel_degree: 3 does not divide the world size 8"),
    ((1, -1, 8), {"cp": 3}, "parallelism.context_parallel_degree: 3 does not divide the world size 8"),
    ((1, -1, 8), {"tp": 2, "cp": 3},
     "context_parallel_degree x tensor_parallel_degree = 3 x 2 = 6 does not divide the world size 8"),
    ((1, 2, 8), {"tp": 2}, "data_parallel_replicate_degree x data_parallel_shard_degree x tensor_parallel_degree "
                           "= 1 x 2 x 2 = 4, expected the world size 8"),
    ((2, 2, 8), {"tp": 2, "pp": 2}, "= 2 x 2 x 2 x 2 = 16, expected the world size 8"),
    ((1, -1, 4), {"tp": 0}, "parallelism.tensor_parallel_degree: expected an integer >= 1, got 0"),
    ((1, -1, 4), {"pp": -1}, "parallelism.pipeline_parallel_degree: expected an integer >= 1, got -1"),
    ((1, 0, 4), {}, "parallelism.data_parallel_shard_degree: expected -1 or an integer >= 1, got 0"),
])
def test_layout_errors_show_the_arithmetic(args, kwargs, message):
    with pytest.raises(ValueError) as info:
        ParallelDims(*args, **kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_layout_error_from_the_trainer_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="tensor_parallel_degree: 2 does not divide the world size 1"):
        train.main(parse_args(["--parallelism.tensor_parallel_degree", "2", "--job.dump_folder", str(tmp_path)]))


# ------------------------------------------------------------------------------------------ mesh


@pytest.fixture
def fake_world():
    """A 16-rank fake process group (this process is rank 5): meshes build without other processes."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=16)
    yield
    dist.destroy_process_group()


def test_named_mesh_and_flattened_dims(fake_world):
    dims = ParallelDims(1, -1, 16, tp=2, pp=2, cp=2)
    mesh = dims.build_mesh("cpu")
    assert mesh.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    assert tuple(mesh.shape) == (2, 1, 2, 2, 2)
    # Rank 5 = pp 0, dp_shard 1, cp 0, tp 1 (tp innermost: neighbours share a tensor-parallel group).
    assert [mesh.get_local_rank(n) for n in ("pp", "dp_shard", "cp", "tp")] == [0, 1, 0, 1]
    assert submesh(mesh, "tp").mesh.tolist() == [4, 5]
    assert submesh(mesh, "cp").mesh.tolist() == [5, 7]
    assert submesh(mesh, "pp").mesh.tolist() == [5, 13]
    assert submesh(mesh, "dp_shard_cp").mesh.tolist() == [1, 3, 5, 7]  # what FSDP2 shards over
    assert submesh(mesh, "dp_cp").mesh.tolist() == [1, 3, 5, 7]  # whose losses add up
    assert submesh(mesh, "dp").mesh.tolist() == [1, 5]  # who reads different data
    assert dims.dp_mesh(mesh).mesh_dim_names == ("dp_shard_cp",)
    assert dims.dp_rank(mesh) == 1


def test_hsdp_mesh_is_two_dimensional(fake_world):
    dims = ParallelDims(2, -1, 16, tp=2, cp=2)
    mesh = dims.build_mesh("cpu")
    dp = dims.dp_mesh(mesh)
    assert dp.mesh_dim_names == ("dp_replicate", "dp_shard_cp") and tuple(dp.shape) == (2, 4)
    assert dims.dp_rank(mesh) == 0 * 2 + 1  # replicate 0, shard 1 (rank 5 = dpr 0, dps 1, cp 0, tp 1)


# ------------------------------------------------------------------------------------------ pipeline stages


def test_even_split_and_stage_placement():
    p = plan_stages(6, 2, 0, "1F1B")
    assert (p.num_stages, p.layers, p.local_stages) == (2, ((0, 1, 2), (3, 4, 5)), (0,))
    p = plan_stages(6, 2, 1, "Interleaved1F1B")  # looped: rank 1 runs stages 1 and 3
    assert (p.num_stages, p.layers, p.local_stages) == (4, ((0, 1), (2, 3), (4,), (5,)), (1, 3))
    p = plan_stages(8, 2, 0, "ZBVZeroBubble")  # V: rank 0 runs the first and the last stage
    assert p.local_stages == (0, 3) and plan_stages(8, 2, 1, "ZBVZeroBubble").local_stages == (1, 2)


def test_split_points():
    p = plan_stages(6, 2, 1, "GPipe", ["layers.2"])
    assert p.layers == ((0, 1), (2, 3, 4, 5)) and p.local_stages == (1,)
    p = plan_stages(6, 2, 0, "InterleavedZeroBubble", ["layers.1", "layers.2", "layers.4"])
    assert p.layers == ((0,), (1,), (2, 3), (4, 5)) and p.local_stages == (0, 2)


@pytest.mark.parametrize("args, message", [
    ((4, 4, 0, "1F1B", None), None),
    ((3, 4, 0, "1F1B", None), "parallelism.pipeline_parallel_degree: 3 layers are too few for 4 stages"),
    ((6, 4, 0, "Interleaved1F1B", None), "parallelism.pipeline_parallel_degree: 6 layers are too few for 8 stages"),
    ((6, 2, 0, "1F1B", ["layers.2", "layers.4"]), "parallelism.pipeline_parallel_split_points: 2 split points"),
    ((6, 2, 0, "1F1B", ["layer.2"]), "expected names like 'layers.3', got 'layer.2'"),
    ((6, 2, 0, "1F1B", ["layers.6"]), "expected increasing layers in layers.1..layers.5"),
    ((6, 2, 0, "Interleaved1F1B", ["layers.3", "layers.2", "layers.4"]), "expected increasing layers"),
    ((6, 2, 0, "ZBVZeroBubble", ["layers.3"]), "ZBVZeroBubble runs two per rank: expected 3 split points"),
    ((6, 2, 0, "Looped", None), "parallelism.pipeline_parallel_schedule: expected one of"),
])
def test_stage_plan_errors_name_the_key(args, message):
    if message is None:
        assert plan_stages(*args).layers == ((0,), (1,), (2,), (3,))
        return
    with pytest.raises(ValueError) as info:
        plan_stages(*args)
    assert message in str(info.value) and "\n" not in str(info.value)


# ------------------------------------------------------------------------------------------ TP and CP checks


def test_heads_not_divisible_by_tp_name_the_key():
    args = model_args("8B", 128256, 256)  # 32 heads, 8 kv heads
    check_tp_divisibility(args, 8)
    with pytest.raises(ValueError, match="tensor_parallel_degree: 16 does not divide the model's n_kv_heads = 8"):
        check_tp_divisibility(args, 16)
    with pytest.raises(ValueError, match="tensor_parallel_degree: 3 does not divide the model's n_heads = 32"):
        check_tp_divisibility(args, 3)


def test_zigzag_split_is_load_balanced():
    seq, cp = 24, 3
    parts = [zigzag_indices(seq, cp, r) for r in range(cp)]
    assert parts[0].tolist() == [0, 1, 2, 3, 20, 21, 22, 23]
    assert sorted(torch.cat(parts).tolist()) == list(range(seq))  # a partition of the sequence
    # Causal work of a rank = sum over its tokens of (position + 1): equal on every rank.
    work = [int((p + 1).sum()) for p in parts]
    assert len(set(work)) == 1
    with pytest.raises(ValueError, match="context_parallel_degree: sequence length 20 is not divisible by"):
        zigzag_indices(20, 3, 0)


@pytest.mark.parametrize("argv, message", [
    (["--parallelism.context_parallel_degree", "3", "--training.seq_len", "32"],
     "--parallelism.context_parallel_degree: training.seq_len 32 is not divisible by 2 x context_parallel_degree = 6"),
    (["--parallelism.tensor_parallel_degree", "3", "--training.seq_len", "32"],
     "--parallelism.tensor_parallel_degree: the sequence part of a rank"),
    (["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "3",
      "--parallelism.pipeline_parallel_microbatch_size", "2"],
     "--parallelism.pipeline_parallel_microbatch_size: training.local_batch_size 3 is not divisible into "
     "micro-batches of 2"),
    (["--parallelism.pipeline_parallel_split_points", "layers.2"],
     "--parallelism.pipeline_parallel_split_points: ['layers.2'] given but pipeline_parallel_degree is 1"),
    (["--parallelism.pipeline_parallel_degree", "2", "--training.document_masking"],
     "--parallelism.pipeline_parallel_degree: training.document_masking is not supported"),
    (["--parallelism.context_parallel_degree", "2", "--training.document_masking"],
     "--parallelism.context_parallel_degree: training.document_masking is not supported"),
    (["--parallelism.pipeline_parallel_schedule", "1f1b"], "did you mean '1F1B'?"),
    (["--parallelism.tensor_parallel_degree", "0"], "--parallelism.tensor_parallel_degree: expected an integer >= 1"),
])
def test_config_errors_are_one_line_naming_the_key(argv, message):
    with pytest.raises(ConfigError) as info:
        parse_args(argv)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_compile_with_a_zero_bubble_schedule_is_refused():
    from trainer.registry import build_model
    from trainer.parallel.parallelize import parallelize_decoder

    config = parse_args(["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
                         "ZBVZeroBubble", "--compile.enable"])
    model = build_model(model_args("debugmodel", 258, 32), "meta")
    with pytest.raises(ValueError, match="pipeline_parallel_schedule: ZBVZeroBubble splits the backward"):
        parallelize_decoder(model, config, ParallelDims(1, -1, 2, pp=2), None, torch.device("cpu"), use_fsdp=False)


def test_compile_with_tensor_parallel_is_refused_off_cuda():
    from trainer.registry import build_model
    from trainer.parallel.parallelize import parallelize_decoder

    config = parse_args(["--parallelism.tensor_parallel_degree", "2", "--compile.enable"])
    model = build_model(model_args("debugmodel", 258, 32), "meta")
    with pytest.raises(ValueError, match="compile.enable: not supported with parallelism.tensor_parallel_degree > 1"):
        parallelize_decoder(model, config, ParallelDims(1, -1, 2, tp=2), None, torch.device("cpu"), use_fsdp=False)
