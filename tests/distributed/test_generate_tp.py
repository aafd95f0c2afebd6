"""Tensor parallel generation: ``torchrun --nproc_per_node 2 -m trainer.generate`` (TP 2 on CPU gloo
ranks: heads and FFN columns split, each rank holding its heads' KV caches) gives the same tokens as
one process, for a batch of prompts of different lengths, greedy and sampled (the ranks draw alike
from the same seed); log-probabilities within 1e-5 (the all-reduce sums in another order)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.launcher import free_port
from trainer.generate.cli import main as generate_main

transformers = pytest.importorskip("transformers", reason="the model is a transformers Llama saved with save_pretrained")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["--prompt", "To be, or not", "--prompt", "Hi", "--prompt", "KING RICHARD III:\n"]


def _folder(tmp_path, family: str = "llama3") -> Path:
    from tests.trainer.hf_parity import hf_llama, hf_model
    from tests.trainer.helpers import tiny_llama

    if family == "llama3":
        # GQA 4 heads / 2 kv heads and an FFN of 192 columns: TP 2 splits both; a vocabulary over the 258 bytes
        hf = hf_llama(tiny_llama(dim=64, vocab_size=300, multiple_of=32, max_seq_len=64), seed=4)
    else:  # GPT-OSS: sinks split with the heads, a sliding window of 5 passed, the experts whole on each rank
        from tests.trainer.test_gpt_oss import _randomize, _tiny

        hf = hf_model(_tiny(window=5, vocab_size=300), (transformers.GptOssConfig, transformers.GptOssForCausalLM), 3,
                      _randomize)
    hf.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def _lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


SAMPLED = ["--temperature", "0.8", "--top_k", "40", "--seed", "7"]


# Each case launches torchrun (about 30 s on 2 shared cores): greedy Llama runs by default; the sampled
# case (same draws on both ranks from one seed) and GPT-OSS (sinks split with the heads) are slow-marked,
# as the greedy one covers the split itself.
@pytest.mark.parametrize("family, extra", [("llama3", []), pytest.param("llama3", SAMPLED, marks=pytest.mark.slow),
                                           pytest.param("gpt_oss", [], marks=pytest.mark.slow)],
                         ids=["greedy", "sampled", "gpt_oss"])
def test_tp2_generation_equals_one_process(family, extra, tmp_path, capsys):
    folder = _folder(tmp_path, family)
    common = ["--flavor", "custom", "--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_in_hf",
              *PROMPTS, "--max_new_tokens", "20", "--json", *extra]
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert generate_main(common) == 0
    finally:
        torch.set_num_threads(n)
    one = _lines(capsys.readouterr().out)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--rdzv_backend", "c10d",
           "--rdzv_endpoint", f"127.0.0.1:{free_port()}", "-m", "trainer.generate", *common,
           "--parallelism.tensor_parallel_degree", "2"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    tp = _lines(out.stdout)  # rank 0 alone prints
    assert [x["ids"] for x in tp] == [x["ids"] for x in one] and len(tp) == 3
    for a, b in zip(tp, one):
        assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])) < 1e-5
