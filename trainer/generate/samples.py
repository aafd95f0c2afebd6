"""Completions of a few prompts from the model being trained (``--validation.sample_prompts``): greedy,
through the KV-cache loop, on every rank together (FSDP2 gathers the weights as in a forward)."""
from __future__ import annotations

from trainer.generate.loop import generate
from trainer.generate.run import completion_text, encode_prompts


def sample_completions(model, tokenizer, prompts: list[str], max_new_tokens: int) -> list[tuple[str, str]]:
    """(prompt, completion) for each prompt: BOS + prompt, up to ``max_new_tokens`` greedy tokens or
    EOS, within the model's ``max_seq_len`` (the prompts go together when they fit, else one by one;
    a prompt too long for it keeps its last tokens)."""
    limit = model.args.max_seq_len
    ids = [p[-(limit - 1):] for p in encode_prompts(tokenizer, prompts)]
    batches = [ids] if sum(map(len, ids)) <= limit and max(map(len, ids)) + max_new_tokens <= limit \
        else [[p] for p in ids]
    out = []
    for batch in batches:
        new = min(max_new_tokens, limit - max(map(len, batch)))
        for res in generate(model, batch, new, eos_ids=(tokenizer.eos_id,)):
            out.append(completion_text(tokenizer, res.ids, []))
    return list(zip(prompts, out))
