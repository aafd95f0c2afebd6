"""Llama 4's debug model (chunked RoPE layers with QK norm, a NoPE layer with temperature tuning, top-1
sigmoid MoE scaling the expert input with a shared expert on layers 1 and 3, dense layers 0 and 2)
under every parallel layout equals one process.

On CPU gloo, float32, same seed and data (tests/distributed/layouts.py): per-step loss within 1e-4 and
gradient norm within 1e-4 relative of the single-process run, 2 ranks each:
  default  CP 2 at seq 64: the attention chunk (16) shorter than a rank's share (32) and equal to the
           zigzag chunk, so the ring computes only the diagonal pairs of the chunked layers and skips
           the rest (one layout per family by default);
  slow     FSDP 2, TP 2, EP 2 at seq 32 (two attention chunks of 16 per sequence), PP 2 (1F1B), and CP
           2 at seq 32 with an attention chunk (24, a Hugging Face folder of the debug shapes read by
           ``--flavor custom``) longer than a rank's share (16). By default FSDP, TP, EP and the
           pipeline split of the shared decoder (which Llama 4's blocks are) are covered by
           tests/distributed/test_parallel_layouts.py, test_expert_parallel.py and the other families'
           layout tests, and the ring's chunk pairs, a chunk a multiple of the zigzag chunk included,
           by tests/distributed/test_context_parallel_attention.py and the CP 2 run above.
"""
import pytest

from tests.distributed.layouts import assert_same, family_layouts, family_layouts_equal_one_process, reference, run_layouts

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

L4 = ["--model.name", "llama4", "--flavor", "debugmodel"]
SEQ64 = ["--training.seq_len", "64"]


def test_cp2_equals_one_process(tmp_path, tmp_path_factory):
    cp2 = family_layouts(*L4)["cp2"]
    runs = run_layouts(2, {"cp2_seq64": [*cp2, *SEQ64]}, tmp_path)
    assert_same(runs["cp2_seq64"], reference(tmp_path_factory, *L4, *SEQ64))


@pytest.mark.slow  # ~30 s on 2 cores; the module docstring says what covers it by default
def test_fsdp2_tp2_ep2_equal_one_process(tmp_path, tmp_path_factory):
    family_layouts_equal_one_process(L4, tmp_path, tmp_path_factory, without="cp2")


@pytest.mark.slow  # ~25 s on 2 cores; the module docstring says what covers it by default
def test_pp2_equals_one_process(tmp_path, tmp_path_factory):
    single = reference(tmp_path_factory, *L4)
    runs = run_layouts(2, {"pp2_1f1b": [*L4, "--parallelism.pipeline_parallel_degree", "2",
                                        "--parallelism.data_parallel_shard_degree", "1",
                                        "--training.local_batch_size", "4",
                                        "--parallelism.pipeline_parallel_schedule", "1F1B"]}, tmp_path)
    assert_same(runs["pp2_1f1b"], single)


@pytest.mark.slow  # ~20 s on 2 cores; the module docstring says what covers it by default
def test_cp2_with_a_chunk_longer_than_a_ranks_share_equals_one_process(tmp_path, tmp_path_factory):
    from trainer.checkpoint.checkpointer import Checkpointer
    from trainer.checkpoint.hf_convert import dcp_to_hf
    from trainer.models.llama4.args import LLAMA4_FLAVORS
    from tests.trainer.helpers import cpu_model

    args = LLAMA4_FLAVORS["debugmodel"].replace(vocab_size=258, attention_chunk=24)
    assert args.layer_types.count("chunked_attention") == 3
    model = cpu_model(args, seed=3)
    Checkpointer(tmp_path / "seed", model, model_args=args).save_seed()
    dcp_to_hf(tmp_path / "seed", tmp_path / "hf")
    custom = ["--model.name", "llama4", "--flavor", "custom", "--checkpoint.initial_load_in_hf",
              "--checkpoint.initial_load_path", str(tmp_path / "hf")]
    single = reference(tmp_path_factory, *custom)
    runs = run_layouts(2, {"cp2_chunk24": [*custom, "--parallelism.context_parallel_degree", "2",
                                           "--training.local_batch_size", "4"]}, tmp_path)
    assert_same(runs["cp2_chunk24"], single)
