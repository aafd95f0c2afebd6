"""Muon (with AdamW for the embedding, output, norms and routers) under each parallel layout equals
one process: per-step loss within 1e-4 and gradient norm within 1e-4 relative, 5 steps of the
debugmodel (float32, fixed seed, tests/distributed/layouts.py).

  fsdp2       matrices sharded on dim 0 over 2 ranks: gathered whole on one rank each (all-to-all)
  tp2         column/row-wise shards over tp: wq/wk/wv/w1/w3 split on rows, wo/w2 on columns
  pp2         each stage's matrices local (no exchange), two optimizers in lockstep
  ep2         Qwen3 MoE: experts split over ep (whole experts per rank: per-expert Newton-Schulz
              locally), the dense matrices FSDP2-sharded over dp_shard 2 and exchanged
  fsdp2_tp2   2-D shards (FSDP2 over TP's): exchange group = both dims flattened (4 ranks, slow)
  ep2_tp2     experts split over ep and on their hidden size over tp: per-expert matrices gathered
              over tp (4 ranks, slow)
  hsdp2x2     replicas x shards: each replica exchanges over its own shard group (4 ranks, slow)
The default run has the 2-rank layouts (about a minute on 2 cores); ``-m slow`` adds the 4-rank ones.
"""
import pytest

from tests.distributed.layouts import GLOBAL_BATCH, assert_same, reference, run_layouts

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

MUON = ["--optimizer.name", "muon"]
MOE = ["--model.name", "qwen3", "--flavor", "debugmodel_moe"]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
EP2 = ["--parallelism.expert_parallel_degree", "2"]


def _lbs(dp: int) -> list[str]:
    return ["--training.local_batch_size", str(GLOBAL_BATCH // dp)]


# name: (world size, model, extra arguments); the 4-rank ones are slow.
LAYOUTS = {
    "fsdp2": (2, "llama", _lbs(2)),
    "tp2": (2, "llama", [*TP2, *_lbs(1)]),
    "pp2": (2, "llama", ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
                         *_lbs(1)]),
    "ep2": (2, "moe", [*MOE, *EP2, *_lbs(2)]),
    "fsdp2_tp2": (4, "llama", [*TP2, *_lbs(2)]),
    "ep2_tp2": (4, "moe", [*MOE, *EP2, *TP2, *_lbs(2)]),
    "hsdp2x2": (4, "llama", ["--parallelism.data_parallel_replicate_degree", "2",
                             "--parallelism.data_parallel_shard_degree", "2", *_lbs(4)]),
}
SLOW = {"fsdp2_tp2", "ep2_tp2", "hsdp2x2"}


@pytest.fixture(scope="module")
def singles(tmp_path_factory):
    return {"llama": reference(tmp_path_factory, *MUON), "moe": reference(tmp_path_factory, *MUON, *MOE)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every layout's records, run lazily per world size (the slow ones only when asked for)."""
    cache: dict[int, dict] = {}

    def get(name: str):
        world = LAYOUTS[name][0]
        if world not in cache:
            wanted = {n: [*MUON, *args] for n, (w, _, args) in LAYOUTS.items() if w == world}
            cache[world] = run_layouts(world, wanted, tmp_path_factory.mktemp(f"muon{world}"))
        return cache[world][name]

    return get


@pytest.mark.parametrize("layout", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW else []) for n in LAYOUTS])
def test_muon_layout_equals_one_process(layout, runs, singles):
    assert_same(runs(layout), singles[LAYOUTS[layout][1]])
