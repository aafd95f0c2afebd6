"""Generation of the Llama 4 family (trainer/generate/ on trainer/models/llama4/).

A small random transformers ``Llama4ForCausalLM`` saved with ``save_pretrained`` where every Llama 4
feature acts within the 32 generated tokens: chunked RoPE layers whose chunk (16) is shorter than
prompt + generated length (their ``ChunkedCache`` keeps only the current chunk), QK norm after the
rotation, NoPE layers with attention temperature tuning from position 3 on (the query scale depends on
the absolute position, which decode takes from the cache's lengths), top-1 sigmoid MoE with a shared
expert on single tokens. ``python -m trainer.generate`` on that folder (the byte tokenizer: 258 ids)
gives transformers' ``generate(do_sample=False)`` tokens for a batch of prompts of different lengths,
log-probabilities within 1e-4; cached decoding equals our full forward within 1e-5 across chunk
boundaries (decode attention by the CPU's grouped matmuls and by ``flash_attn``), and turning temperature tuning off moves those logits (so the check sees it).
"""
import json

import pytest
import torch

from trainer.generate.cache import CacheState, ChunkedCache, FullCache, KVCache
from trainer.generate.cli import main as generate_main
from trainer.generate.kinds import install_caches
from trainer.generate.loop import generate
from tests.trainer.helpers import cpu_model, rel
from tests.trainer.test_generate import _assert_cached_equals_full, _full_forward_logits, _prompts
from tests.trainer.test_llama4 import _randomize, _tiny

transformers = pytest.importorskip("transformers", reason="the parity tests need transformers (the [test] extra)")
pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"), pytest.mark.usefixtures("one_thread")]

NEW = 32
CHUNK = 16
# prompts of 4, 12 and 7 bytes (+ BOS): every row crosses a chunk boundary of 16 while decoding
PROMPTS = ["abc", "To be or not", "KING:\n"]


def _args(**kw):
    return _tiny(**{"vocab_size": 258, "attention_chunk": CHUNK, "floor_scale": 4, "max_seq_len": 64, **kw})


def test_cli_greedy_generation_equals_transformers(tmp_path, capsys):
    from tests.trainer.hf_parity import hf_model

    hf = hf_model(_args(), (transformers.Llama4TextConfig, transformers.Llama4ForCausalLM), 3, _randomize).eval()
    hf.generation_config.eos_token_id = 257  # the byte tokenizer's EOS: both stop there, if reached
    hf.generation_config.pad_token_id = 0
    hf.save_pretrained(tmp_path / "hf")
    capsys.readouterr()
    argv = ["--model.name", "llama4", "--flavor", "custom", "--checkpoint.initial_load_path", str(tmp_path / "hf"),
            "--checkpoint.initial_load_in_hf", "--max_new_tokens", str(NEW), "--json"]
    for p in PROMPTS:
        argv += ["--prompt", p]
    assert generate_main(argv) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [x["prompt"] for x in lines] == PROMPTS
    assert len({len(x["prompt_ids"]) for x in lines}) == len(PROMPTS)  # a packed prefill of different lengths
    for x in lines:
        ids = torch.tensor([x["prompt_ids"]])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                              output_logits=True, return_dict_in_generate=True)
        hf_ids = out.sequences[0, ids.shape[1]:].tolist()
        assert x["ids"] == hf_ids
        assert len(hf_ids) == NEW  # no EOS from this model: all 32 tokens compared
        assert ids.shape[1] + len(hf_ids) > CHUNK
        hf_lp = torch.log_softmax(torch.cat(out.logits).float(), -1).gather(1, torch.tensor(hf_ids)[:, None])[:, 0]
        assert (torch.tensor(x["logprobs"]) - hf_lp).abs().max() < 1e-4


@pytest.mark.parametrize("lengths", [(2, 13, 7), (9, 9)], ids=["different", "equal"])
def test_cached_decoding_across_a_chunk_boundary_equals_the_full_forward(lengths):
    args = _args(attention_chunk=6, floor_scale=2, attn_scale=1.0)
    model = cpu_model(args, seed=4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "router" in name:
                p.normal_(0, 0.5)  # routing that differs per token
    state = CacheState(list(lengths), 40, torch.device("cpu"))
    kinds = [type(c) for c in install_caches(model, state)]
    assert kinds == [FullCache if i in args.nope_layers else ChunkedCache for i in range(args.n_layers)]
    assert FullCache in kinds and ChunkedCache in kinds
    prompts = _prompts(args.vocab_size, lengths, seed=5)
    results = generate(model, prompts, 17, record_logits=True)  # 17 tokens: past two chunk boundaries
    _assert_cached_equals_full(model, prompts, results)
    KVCache.grouped_decode = False  # the CPU's grouped decode attention off: flash_attn on the cache views
    try:
        again = generate(model, prompts, 17, record_logits=True)
    finally:
        KVCache.grouped_decode = True
    assert [r.ids for r in again] == [r.ids for r in results]
    _assert_cached_equals_full(model, prompts, again)
    # temperature tuning moves these logits: the same weights without it give others
    untuned = cpu_model(args.replace(attn_temperature_tuning=False))
    untuned.load_state_dict(model.state_dict())
    for p, r in zip(prompts, results):
        assert rel(torch.stack(r.logits), _full_forward_logits(untuned, p, r.ids)) > 1e-3
