"""Every parallel layout gives the single-process losses: tensor, pipeline and context parallel with FSDP2.

Each layout trains the debugmodel (float32, fixed seed, the embedded corpus, global batch 4 x 32
tokens) for 5 steps on gloo CPU ranks; its per-step losses must equal the single-process run's
within 1e-4 and its gradient norms within 1e-4 relative (``tests/distributed/layouts.py``). The
2-rank and the 4-rank layouts each run in one set of processes (about a minute each on 2 cores).

What each layout exercises:
  tp2                      TP + SP: colwise/rowwise, sequence-parallel norms, sharded embedding and
                           output, loss parallel; Partial norm-weight gradients summed without FSDP2
  cp2                      zigzag sequence split, ring attention on flash_attn + LSE, rotary positions
  pp2_<schedule>           each schedule (GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble,
                           ZBVZeroBubble), loss from the last stage, clipping norm over the stages
  pp2_accum                pipeline with 2 accumulation steps of 2 micro-batches (no double scaling)
  pp2_split                explicit split points (layers.2: 2 + 4 layers)
  fsdp4, hsdp2x2           data parallel alone (FSDP2, HSDP)
  fsdp2_tp2                2-D parameters (FSDP2 over TP shards)
  pp2_fsdp2                FSDP2 inside each stage, reduce-scatter once per schedule step
  pp2_zbv_fsdp2            the zero-bubble V schedule (split input/weight backward) under FSDP2
  cp2_tp2                  ring attention over head-sharded q/k/v, sequence parallel inside cp
  hsdp2_tp2, hsdp2_cp2     HSDP (replicate x shard_cp) with TP's 2-D parameters / with CP in the shard dim
  fsdp2_tp2_ac             selective per-op activation checkpointing (matmul outputs kept) under TP
  cp2_fsdp2_compile        compiled blocks with ring attention running eagerly between compiled regions
  pp2_fsdp2_ac_compile     full activation checkpointing + per-block compile (aot_eager backend:
                           Dynamo fullgraph + AOT autograd, no code generation) in interleaved stages
  tp2_no_loss_parallel     logits all-gathered, plain cross-entropy

The default run holds one layout of each kind; GPipe and InterleavedZeroBubble, fsdp4, hsdp2x2,
fsdp2_tp2_ac, pp2_zbv_fsdp2, hsdp2_tp2, hsdp2_cp2, cp2_fsdp2_compile and the Inductor-compiled variant
(CPU code generation) run with ``pytest -m slow tests/distributed/test_parallel_layouts.py`` (what
covers each by default: the comment at FOUR_RANKS_SLOW).
"""
import pytest

from tests.distributed.layouts import GLOBAL_BATCH, assert_same, layouts_fixture, run_layouts

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _lbs(dp: int) -> list[str]:
    return ["--training.local_batch_size", str(GLOBAL_BATCH // dp)]


def _pp(schedule: str) -> list[str]:
    return ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", schedule]


TP2 = ["--parallelism.tensor_parallel_degree", "2"]
CP2 = ["--parallelism.context_parallel_degree", "2"]
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")

# The default run keeps one layout of each kind; the rest (more schedules, HSDP with TP/CP, compile
# with CP) run with -m slow, to hold the default test run under 15 minutes on 2 cores.
DEFAULT_SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")
TWO_RANKS = {
    "tp2": [*TP2, *_lbs(1)],
    "cp2": [*CP2, *_lbs(1)],
    **{f"pp2_{s}": [*_pp(s), *_lbs(1)] for s in DEFAULT_SCHEDULES},
    "pp2_accum": [*_pp("Interleaved1F1B"), "--training.local_batch_size", "2"],
    "pp2_split": [*_pp("1F1B"), "--parallelism.pipeline_parallel_split_points", "layers.2", *_lbs(1)],
    "tp2_no_loss_parallel": [*TP2, "--parallelism.disable_loss_parallel", *_lbs(1)],
}
FOUR_RANKS = {
    "fsdp2_tp2": [*TP2, *_lbs(2)],
    "pp2_fsdp2_ac_compile": [*_pp("Interleaved1F1B"), *_lbs(2), "--activation_checkpoint.mode", "full",
                             "--compile.enable", "--compile.backend", "aot_eager"],
}
TWO_RANKS_SLOW = {f"pp2_{s}": [*_pp(s), *_lbs(1)] for s in SCHEDULES if s not in DEFAULT_SCHEDULES}
# Slow, each covered by default elsewhere: fsdp4 by test_parallel_resume.py's fsdp4 run (4 ranks,
# same comparison) and test_fsdp.py's 2-rank FSDP2; hsdp2x2 by test_fsdp.py's HSDP with accumulation;
# fsdp2_tp2_ac by fsdp2_tp2 above and test_activation_checkpoint.py's selective "op" policy; pp2_fsdp2
# by pp2_fsdp2_ac_compile above (the same split, 1F1B's neighbour Interleaved1F1B); cp2_tp2 by the
# two-rank cp2 and tp2 and fsdp2_tp2 above (TP composed with another dimension).
FOUR_RANKS_SLOW = {
    "pp2_fsdp2": [*_pp("1F1B"), *_lbs(2)],
    "cp2_tp2": [*CP2, *TP2, *_lbs(1)],
    "fsdp4": _lbs(4),
    "hsdp2x2": ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
                *_lbs(4)],
    "fsdp2_tp2_ac": [*TP2, *_lbs(2), "--activation_checkpoint.mode", "selective",
                     "--activation_checkpoint.selective_ac_option", "op"],
    "pp2_zbv_fsdp2": [*_pp("ZBVZeroBubble"), *_lbs(2)],
    "hsdp2_tp2": ["--parallelism.data_parallel_replicate_degree", "2", *TP2, *_lbs(2)],
    "hsdp2_cp2": ["--parallelism.data_parallel_replicate_degree", "2", *CP2, *_lbs(2)],
    "cp2_fsdp2_compile": [*CP2, *_lbs(2), "--compile.enable", "--compile.backend", "aot_eager"],
}


two_ranks = layouts_fixture(2, TWO_RANKS)
four_ranks = layouts_fixture(4, FOUR_RANKS)


@pytest.mark.parametrize("layout", list(TWO_RANKS))
def test_two_rank_layout_equals_one_process(layout, two_ranks, single):
    assert_same(two_ranks[layout], single)


@pytest.mark.parametrize("layout", list(FOUR_RANKS))
def test_four_rank_layout_equals_one_process(layout, four_ranks, single):
    assert_same(four_ranks[layout], single)


@pytest.fixture(scope="module")
def more_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("more_layouts")
    return {**run_layouts(2, TWO_RANKS_SLOW, out / "two"), **run_layouts(4, FOUR_RANKS_SLOW, out / "four")}


@pytest.mark.slow
@pytest.mark.parametrize("layout", [*TWO_RANKS_SLOW, *FOUR_RANKS_SLOW])
def test_more_layouts_equal_one_process(layout, more_ranks, single):
    assert_same(more_ranks[layout], single)


@pytest.mark.slow
def test_inductor_compiled_blocks_under_pp_fsdp_equal_one_process(tmp_path, single):
    layouts = {"inductor": [*_pp("1F1B"), *_lbs(2), "--activation_checkpoint.mode", "selective",
                            "--activation_checkpoint.selective_ac_option", "op", "--compile.enable"]}
    assert_same(run_layouts(4, layouts, tmp_path, timeout=1800)["inductor"], single)
