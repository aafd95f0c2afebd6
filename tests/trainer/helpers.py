"""Helpers shared by the trainer tests."""
from functools import partial

from trainer.models.llama3.args import LLAMA31_ROPE_SCALING, Llama3Args
from trainer.models.registry import model_args as family_model_args

# The Llama 3 flavor's args for a tokenizer and sequence length: llama_model_args("8B", 128256, 8192).
llama_model_args = partial(family_model_args, "llama3")


def tiny_llama(dim: int, vocab_size: int, multiple_of: int, max_seq_len: int, **kw) -> Llama3Args:
    """A 2-layer debug Llama for in-process tests: GQA (4 heads, 2 kv heads) and Llama 3.1's rope
    scaling, at the test's own sizes (``kw``: any other Llama3Args field)."""
    return Llama3Args(dim=dim, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=vocab_size, multiple_of=multiple_of,
                      rope_scaling=LLAMA31_ROPE_SCALING, max_seq_len=max_seq_len, **kw)
