"""Helpers shared by the trainer tests."""
from trainer.models.llama import LLAMA31_ROPE_SCALING, ModelArgs


def tiny_llama(dim: int, vocab_size: int, multiple_of: int, max_seq_len: int, **kw) -> ModelArgs:
    """A 2-layer debug Llama for in-process tests: GQA (4 heads, 2 kv heads) and Llama 3.1's rope
    scaling, at the test's own sizes (``kw``: any other ModelArgs field)."""
    return ModelArgs(dim=dim, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=vocab_size, multiple_of=multiple_of,
                     rope_scaling=LLAMA31_ROPE_SCALING, max_seq_len=max_seq_len, **kw)
