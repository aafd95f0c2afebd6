"""3-D and 4-D layouts equal one process: FSDP2 x TP2 x PP2 and FSDP2 x TP2 x CP2 on 8 gloo ranks
(about 35 s together on 2 cores), and FSDP2 x TP2 x PP2 x CP2 on 16 ranks; all with ``-m slow``.

Same job and comparison as ``test_parallel_layouts.py`` (debugmodel, fp32, 5 steps, global batch
4 x 32 tokens; losses within 1e-4 of the single-process run, gradient norms within 1e-4 relative).
The 16-rank layout holds 16 processes (about 7 GiB). Run them with
``pytest -m slow tests/distributed/test_parallel_3d.py``.
"""
import pytest

from tests.distributed.layouts import assert_same, layouts_fixture, run_layouts

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TP2 = ["--parallelism.tensor_parallel_degree", "2"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
CP2 = ["--parallelism.context_parallel_degree", "2"]
DP2 = ["--training.local_batch_size", "2"]  # global batch 4 over dp_shard = 2

EIGHT_RANKS = {
    "fsdp2_tp2_pp2": [*TP2, *PP2, *DP2],
    "fsdp2_tp2_cp2": [*TP2, *CP2, *DP2],
}


eight_ranks = layouts_fixture(8, EIGHT_RANKS)


# 8 processes on 2 cores (about 35 s): slow. By default each pair of these dimensions is composed on
# 4 ranks (test_parallel_layouts.py: fsdp2_tp2, pp2_fsdp2, cp2_tp2).
@pytest.mark.slow
@pytest.mark.parametrize("layout", list(EIGHT_RANKS))
def test_eight_rank_layout_equals_one_process(layout, eight_ranks, single):
    assert_same(eight_ranks[layout], single)


@pytest.mark.slow
def test_four_d_layout_on_sixteen_ranks_equals_one_process(tmp_path, single):
    layouts = {"fsdp2_tp2_pp2_cp2": [*TP2, *PP2, *CP2, *DP2, "--parallelism.pipeline_parallel_schedule",
                                     "Interleaved1F1B"]}
    assert_same(run_layouts(16, layouts, tmp_path)["fsdp2_tp2_pp2_cp2"], single)
