"""Generation with KV caches (trainer/generate/) against transformers and against our own full forward.

For every family, a small random transformers model saved with ``save_pretrained`` and read by our
loader: greedy generation of 32 tokens for a batch of prompts of different lengths (packed prefill,
then decode through ``flash_attn`` / ``flash_attn_varlen`` over the caches) equals transformers'
``generate(do_sample=False)`` token for token, with log-probabilities within 1e-4; and the logits of
every generated position equal our model's full forward over the whole sequence within 1e-5
(float32): past GPT-OSS's sliding window (ring buffers, sinks), with DeepSeek-V3's latent cache in
both decode paths (absorbed and up-projected), and across chunk boundaries (a chunked Llama).
"""
import pytest
import torch

from trainer.generate.cache import CacheState, ChunkedCache, FullCache, SlidingWindowCache
from trainer.generate.kinds import install_caches
from trainer.generate.load import Source, materialize
from trainer.generate.loop import generate
from trainer.generate.mla_cache import MLACache
from trainer.generate.sampler import SamplingParams, filter_logits, sample
from trainer.models.llama3.args import Llama3Args
from tests.trainer.helpers import cpu_model, rel, tiny_llama

transformers = pytest.importorskip("transformers", reason="the parity tests need transformers (the [test] extra)")
pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"), pytest.mark.usefixtures("one_thread")]

NEW = 32
LENGTHS = (3, 11, 6)


def _hf_llama():
    from tests.trainer.hf_parity import hf_llama

    return hf_llama(tiny_llama(dim=64, vocab_size=301, multiple_of=32, max_seq_len=64))


def _hf_qwen3(moe: bool):
    from tests.trainer.test_hf_qwen3 import _hf_qwen3 as make

    return lambda: make(moe, seed=1)


def _hf_deepseek():
    from tests.trainer.hf_parity import hf_model
    from tests.trainer.test_deepseek_v3 import _randomize, _tiny

    return hf_model(_tiny(), (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM), 3, _randomize).eval()


def _hf_gpt_oss():
    from tests.trainer.hf_parity import hf_model
    from tests.trainer.test_gpt_oss import _randomize, _tiny

    return hf_model(_tiny(window=5), (transformers.GptOssConfig, transformers.GptOssForCausalLM), 3, _randomize).eval()


FAMILIES = {"llama3": _hf_llama, "qwen3": _hf_qwen3(False), "qwen3_moe": _hf_qwen3(True),
            "deepseek_v3": _hf_deepseek, "gpt_oss": _hf_gpt_oss}


def _ours(hf, tmp_path, max_seq_len: int = 256):
    hf.save_pretrained(tmp_path / "hf")
    from trainer.hf import HFCheckpoint

    args = HFCheckpoint(tmp_path / "hf").args.replace(max_seq_len=max_seq_len)
    return materialize(args, torch.device("cpu"), torch.float32, Source("hf", tmp_path / "hf", "test"))


def _prompts(vocab: int, lengths=LENGTHS, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def _full_forward_logits(model, prompt: list[int], ids: list[int]) -> torch.Tensor:
    """Our model's logits over the whole sequence at the positions that predicted ``ids``."""
    seq = torch.tensor([prompt + ids])
    with torch.no_grad():
        logits = model(seq)[0].float()
    return logits[len(prompt) - 1:len(prompt) - 1 + len(ids)]


def _assert_cached_equals_full(model, prompts, results) -> None:
    for p, r in zip(prompts, results):
        assert rel(torch.stack(r.logits), _full_forward_logits(model, p, r.ids)) < 1e-5


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generation_equals_transformers_and_the_full_forward(family, tmp_path):
    hf = FAMILIES[family]()
    hf.generation_config.eos_token_id = None  # 32 tokens whatever a random model says
    hf.generation_config.pad_token_id = 0
    ours = _ours(hf, tmp_path)
    prompts = _prompts(hf.config.vocab_size)
    results = generate(ours, prompts, NEW, record_logits=True)
    for p, r in zip(prompts, results):
        with torch.no_grad():
            x = torch.tensor([p])
            out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW,
                              output_logits=True, return_dict_in_generate=True)
        hf_ids = out.sequences[0, len(p):].tolist()
        assert r.ids == hf_ids and r.finish == "length"
        hf_lp = torch.log_softmax(torch.cat(out.logits).float(), dim=-1).gather(1, torch.tensor(hf_ids)[:, None])[:, 0]
        assert (torch.tensor(r.logprobs) - hf_lp).abs().max() < 1e-4
    _assert_cached_equals_full(ours, prompts, results)
    if family == "deepseek_v3":  # the other decode path of the latent cache gives the same logits
        MLACache.absorb = False
        try:
            again = generate(ours, prompts, NEW, record_logits=True)
        finally:
            MLACache.absorb = True
        assert [r.ids for r in again] == [r.ids for r in results]
        _assert_cached_equals_full(ours, prompts, again)


def test_each_layer_kind_gets_its_cache_and_keeps_only_what_it_reads():
    args = Llama3Args(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=50, max_seq_len=64, attention_chunk=4,
                      sliding_window=3, layer_types=("chunked_attention", "sliding_attention", "full_attention"))
    model = cpu_model(args)
    state = CacheState([5, 2], capacity=40, device=torch.device("cpu"))
    kinds = [type(c) for c in install_caches(model, state)]
    assert kinds == [ChunkedCache, SlidingWindowCache, FullCache]
    generate(model, [[1, 2, 3, 4, 5], [6, 7]], 3)  # installs its own caches; sizes below
    caches = install_caches(model, CacheState([5, 2], 40, torch.device("cpu")))
    assert [c.size() for c in caches] == [4, 3, 40]


@pytest.mark.parametrize("lengths", [(1, 9, 4), (6, 6)], ids=["different", "equal"])
def test_cached_decoding_across_chunk_and_window_boundaries_equals_the_full_forward(lengths):
    args = Llama3Args(dim=48, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=97, max_seq_len=128, attention_chunk=5,
                      sliding_window=4, layer_types=("chunked_attention", "sliding_attention", "full_attention"))
    model = cpu_model(args, seed=2)
    prompts = _prompts(97, lengths, seed=3)
    results = generate(model, prompts, 17, record_logits=True)
    _assert_cached_equals_full(model, prompts, results)


def test_a_tiny_temperature_samples_the_argmax_not_nan():
    """--temperature 1e-40 divided the logits into +-inf, the softmax into NaN and torch.multinomial
    raised a traceback; shifted by the row's maximum first, it is (nearly) greedy."""
    logits = torch.tensor([[0.5, 3.0, -2.0, 1.0], [7.0, -1.0, 2.0, 6.5]])
    for t in (1e-40, 1e-30):
        params = SamplingParams(t, 0, 1.0)
        assert sample(logits, params, torch.Generator().manual_seed(0)).tolist() == [1, 0]
        assert sample(logits, SamplingParams(t, 0, 0.5), torch.Generator().manual_seed(0)).tolist() == [1, 0]
    # a usual temperature: the same distribution as before the shift
    shifted = torch.softmax(filter_logits(logits, SamplingParams(0.7)), -1)
    assert torch.allclose(shifted, torch.softmax(logits / 0.7, -1), atol=1e-7)


def test_sampling_filters_and_reproduces_with_a_seed():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]])
    kept = filter_logits(logits, SamplingParams(1.0, top_k=2)).isfinite()
    assert kept.tolist() == [[False, False, False, True, True]]
    p = torch.softmax(logits, -1)[0]  # 0.636, 0.234, 0.086, ...: top_p 0.8 keeps the first two
    assert p[4] < 0.8 < p[4] + p[3]
    assert filter_logits(logits, SamplingParams(1.0, top_p=0.8)).isfinite().tolist() == [[False, False, False, True, True]]
    draws = [sample(logits.repeat(64, 1), SamplingParams(0.7, 0, 1.0), torch.Generator().manual_seed(5)) for _ in range(2)]
    assert torch.equal(draws[0], draws[1]) and len(set(draws[0].tolist())) > 1
    assert sample(logits, SamplingParams()).tolist() == [4]
    for bad, what in ((dict(temperature=-1.0), "temperature"), (dict(top_k=-2), "top_k"), (dict(top_p=0.0), "top_p")):
        with pytest.raises(ValueError, match=what):
            SamplingParams(**bad)
