"""DeepSeek-V3's debug model (MLA, group-limited sigmoid routing with the correction bias, a shared
expert, a dense first layer, YaRN, one MTP module) under every parallel layout equals one process.

On CPU gloo, float32, same seed and data (tests/distributed/layouts.py): per-step loss within 1e-4 and
gradient norm within 1e-4 relative of the single-process run, for
  TP 2                                (2 ranks, MTP on: its modules under the family's TP hook; default)
  FSDP 2, EP 2, CP 2                  (2 ranks, MTP on; ``-m slow``)
  PP 2 with 1F1B and with DualPipeV   (2 ranks, MTP off: it is refused with pipeline parallel; default:
                                      the only test of DualPipeV)
  EP 2 x TP 2                         (4 ranks; ``-m slow``)
"""
import pytest

from tests.distributed.layouts import assert_same, family_layouts, family_layouts_equal_one_process, reference, run_layouts

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

DS = ["--model.name", "deepseek_v3", "--flavor", "debugmodel"]
NO_MTP = ["--model.mtp_layers", "0"]


def test_tp2_with_mtp_equals_one_process(tmp_path, tmp_path_factory):
    runs = run_layouts(2, {"tp2": family_layouts(*DS)["tp2"]}, tmp_path)
    assert_same(runs["tp2"], reference(tmp_path_factory, *DS))
    assert "mtp_loss" in runs["tp2"][1]


@pytest.mark.slow  # ~15 s on 2 cores; by default FSDP, EP and CP are covered by test_parallel_layouts.py,
# test_expert_parallel.py and test_context_parallel_attention.py, MLA + MTP under a layout by TP 2 above
def test_fsdp2_ep2_cp2_equal_one_process(tmp_path, tmp_path_factory):
    runs = family_layouts_equal_one_process(DS, tmp_path, tmp_path_factory, without="tp2")
    assert all("mtp_loss" in got[1] for got in runs.values())


def test_pp2_1f1b_and_dualpipev_equal_one_process(tmp_path, tmp_path_factory):
    single = reference(tmp_path_factory, *DS, *NO_MTP)
    pp2 = [*DS, *NO_MTP, "--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree",
           "1", "--training.local_batch_size", "4"]
    runs = run_layouts(2, {
        "pp2_1f1b": [*pp2, "--parallelism.pipeline_parallel_schedule", "1F1B"],
        "pp2_dualpipev": [*pp2, "--parallelism.pipeline_parallel_schedule", "DualPipeV"],
    }, tmp_path)
    for got in runs.values():
        assert_same(got, single)


def test_mtp_with_pipeline_parallel_is_refused_in_one_line(tmp_path, tmp_path_factory):
    runs = run_layouts(2, {"pp2_mtp": [*DS, "--parallelism.pipeline_parallel_degree", "2",
                                       "--parallelism.data_parallel_shard_degree", "1",
                                       "--training.local_batch_size", "4"]}, tmp_path)
    assert isinstance(runs["pp2_mtp"], str)
    assert "multi-token prediction is not supported with pipeline parallel" in runs["pp2_mtp"]


@pytest.mark.slow  # 4 ranks on 2 cores (~40 s); TP 2 alone runs by default above, EP 2 in test_expert_parallel.py
def test_ep2_x_tp2_equals_one_process(tmp_path, tmp_path_factory):
    single = reference(tmp_path_factory, *DS)
    runs = run_layouts(4, {"ep2_tp2": [*DS, "--parallelism.expert_parallel_degree", "2",
                                       "--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "2"]},
                       tmp_path)
    assert_same(runs["ep2_tp2"], single)
