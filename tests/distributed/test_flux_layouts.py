"""Flux's debug model (pixel-space patches, tiny frozen T5 and CLIP) under data-parallel layouts
equals one process.

On CPU gloo, float32, same seed and data (tests/distributed/layouts.py): per-step loss within 1e-4
and gradient norm within 1e-4 relative of the single-process run. Each sample's noise, timestep and
caption dropout are drawn from its global sample number, so the layouts see the same noisy inputs.
FSDP 2 runs by default; TP 2 and CP 2 (the non-causal ring over the joint text + image sequence)
and HSDP 2x2 (4 ranks) are slow: by default FSDP 2 covers the layout machinery, the one-process
tests the model, and tests/distributed/test_context_parallel_attention.py the ring itself.
"""
import pytest

from tests.distributed.layouts import LOSS_TOL, NORM_RTOL, STEPS, reference, run_layouts

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")



def assert_same(got, ref) -> None:
    """Per-step loss within LOSS_TOL, gradient norm within NORM_RTOL, the same LR; and the run learns
    (the flow loss starts near 1.6 and falls by a third in these steps: the decoders' helper expects a
    drop of 1.0 in token cross-entropy)."""
    assert not isinstance(got, str), got
    assert sorted(got) == list(range(1, STEPS + 1)), sorted(got)
    for s in range(1, STEPS + 1):
        assert abs(got[s]["loss"] - ref[s]["loss"]) <= LOSS_TOL, (s, "loss", got[s]["loss"], ref[s]["loss"])
        assert abs(got[s]["grad_norm"] - ref[s]["grad_norm"]) <= NORM_RTOL * ref[s]["grad_norm"], s
        assert got[s]["lr"] == ref[s]["lr"], s
    assert ref[STEPS]["loss"] < 0.8 * ref[1]["loss"]


FLUX = ["--model.name", "flux", "--flavor", "debugmodel", "--validation.enable", "false",
        "--flux.caption_dropout", "0.25", "--flux.img_size", "16"]  # 16x16 pixels: 64 image tokens


_SHARD_2X2 = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"]
# (ranks, {layout: its flags}); the HSDP and TP / CP layouts are slow (see the module's docstring).
LAYOUTS = [
    pytest.param(2, {"fsdp2": [*FLUX, "--training.local_batch_size", "2"]}, id="fsdp2"),
    pytest.param(4, {"hsdp2x2": [*FLUX, *_SHARD_2X2, "--training.local_batch_size", "1"]}, id="hsdp2x2",
                 marks=pytest.mark.slow),
    pytest.param(2, {"tp2": [*FLUX, "--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"],
                     "cp2": [*FLUX, "--parallelism.context_parallel_degree", "2", "--training.local_batch_size", "4"]},
                 id="tp2_cp2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("ranks,layouts", LAYOUTS)
def test_layout_equals_one_process(ranks, layouts, tmp_path, tmp_path_factory):
    single = reference(tmp_path_factory, *FLUX)
    for name, got in run_layouts(ranks, layouts, tmp_path).items():
        assert_same(got, single), name
