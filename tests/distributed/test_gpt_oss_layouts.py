"""GPT-OSS's debug model (alternating sliding-window / full attention with sinks and biases, experts with
biases and the clamped SwiGLU, YaRN) under every parallel layout equals one process.

On CPU gloo, float32, same seed and data (tests/distributed/layouts.py): per-step loss within 1e-4 and
gradient norm within 1e-4 relative of the single-process run, for FSDP 2, TP 2 (sinks and expert
biases split on heads and hidden sizes), EP 2 and CP 2 (windows and sinks through the ring), 2 ranks
each (CP 2 by default: windows and sinks through the ring; the others ``-m slow``). The sequence (32) is longer than the debug model's window (16), so every layout sees both
kinds of layer at work, and under CP 2 the window spans the zigzag chunks (8 positions each).
"""
import pytest

from tests.distributed.layouts import assert_same, family_layouts, family_layouts_equal_one_process, reference, run_layouts

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

OSS = ["--model.name", "gpt_oss", "--flavor", "debugmodel"]


def test_cp2_equals_one_process(tmp_path, tmp_path_factory):
    runs = run_layouts(2, {"cp2": family_layouts(*OSS)["cp2"]}, tmp_path)
    assert_same(runs["cp2"], reference(tmp_path_factory, *OSS))


@pytest.mark.slow  # ~20 s on 2 cores; by default FSDP, TP and EP are covered by test_parallel_layouts.py,
# test_expert_parallel.py and test_dtensor_attention.py (sinks under TP), windows and sinks by CP 2 above
def test_fsdp2_tp2_ep2_equal_one_process(tmp_path, tmp_path_factory):
    family_layouts_equal_one_process(OSS, tmp_path, tmp_path_factory, without="cp2")
