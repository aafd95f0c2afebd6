"""Validation under parallel layouts gives the single-process validation loss, and leaves training alone.

Each layout trains the debugmodel (``tests/distributed/layouts.py``: float32, fixed seed, global
batch 4 x 32 tokens, 5 steps) with validation every 2 steps on 2 batches of the held-out split
(local validation batch = 4 / data-parallel degree, so every layout evaluates the same 8 windows).
The validation loss at steps 2, 4 and 5 must equal the single-process run's within 1e-4, as must
the training losses: an evaluation between steps (PP: the schedule's forward-only ``eval``; FSDP2:
gathered weights without a backward) does not disturb the steps after it.

  fsdp2        data parallel: token sums and counts added over the dp ranks
  tp2          vocab-parallel loss (loss parallel) in the forward-only pass
  pp2          1F1B schedule; evaluation through schedule.eval, then training resumes
  pp2_interleaved   two stages per rank (Interleaved1F1B), validation batch cut into 2 schedule runs
  cp2          context parallel: each rank evaluates its zigzag part of every sequence
"""
import pytest

from tests.distributed.layouts import GLOBAL_BATCH, assert_same, reference, records, run_layouts

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

VALIDATION = ["--validation.enable", "--validation.freq", "2", "--validation.steps", "2"]
VAL_STEPS = [2, 4, 5]


def _lbs(dp: int, val_lbs: int | None = None) -> list[str]:
    return ["--training.local_batch_size", str(GLOBAL_BATCH // dp),
            "--validation.local_batch_size", str(val_lbs or GLOBAL_BATCH // dp)]


LAYOUTS = {
    "fsdp2": _lbs(2),
    "tp2": ["--parallelism.tensor_parallel_degree", "2", *_lbs(1)],
    "pp2": ["--parallelism.pipeline_parallel_degree", "2", *_lbs(1)],
    # training local batch 2 (2 accumulation steps): the 4-sequence validation batch is 2 schedule runs
    "pp2_interleaved": ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
                        "Interleaved1F1B", "--training.local_batch_size", "2", "--validation.local_batch_size", "4"],
    "cp2": ["--parallelism.context_parallel_degree", "2", *_lbs(1)],
}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return reference(tmp_path_factory, *VALIDATION)


@pytest.fixture(scope="module")
def single_validation(single, tmp_path_factory):
    return reference(tmp_path_factory, *VALIDATION, kind="val_loss")


# By default data parallel (token sums over ranks) and 1F1B (the schedule's forward-only eval); the
# others (~10 s more on 2 cores) are slow: TP's loss parallel and CP's zigzag split are checked in
# training by default (test_parallel_layouts.py), their validation only here.
DEFAULT = ("fsdp2", "pp2")


def _run(tmp_path_factory, names) -> dict:
    folder = tmp_path_factory.mktemp("validation_layouts")
    runs = run_layouts(2, {name: [*VALIDATION, *LAYOUTS[name]] for name in names}, folder)
    return {name: (run, records(folder / name, "val_loss") if not isinstance(run, str) else run)
            for name, run in runs.items()}


@pytest.fixture(scope="module")
def default_layouts(tmp_path_factory):
    return _run(tmp_path_factory, DEFAULT)


@pytest.fixture(scope="module")
def slow_layouts(tmp_path_factory):
    return _run(tmp_path_factory, [name for name in LAYOUTS if name not in DEFAULT])


def test_single_process_validates_at_freq_and_at_the_end(single_validation):
    assert sorted(single_validation) == VAL_STEPS
    for rec in single_validation.values():
        assert rec["val_tokens"] == 2 * GLOBAL_BATCH * 32 and rec["val_batches"] == 2
        assert rec["val_perplexity"] == pytest.approx(2.718281828459045 ** rec["val_loss"], rel=1e-9)
    assert single_validation[5]["val_loss"] < single_validation[2]["val_loss"]  # it learns


@pytest.mark.parametrize("layout", [name if name in DEFAULT else pytest.param(name, marks=pytest.mark.slow)
                                    for name in LAYOUTS])
def test_layout_validation_equals_one_process(layout, request, single, single_validation):
    train, val = request.getfixturevalue("default_layouts" if layout in DEFAULT else "slow_layouts")[layout]
    assert_same(train, single)  # training after an evaluation is undisturbed
    assert sorted(val) == VAL_STEPS
    for step in VAL_STEPS:
        got, ref = val[step], single_validation[step]
        assert abs(got["val_loss"] - ref["val_loss"]) <= 1e-4, (layout, step, got["val_loss"], ref["val_loss"])
        assert got["val_tokens"] == ref["val_tokens"], (layout, step)
