"""Llama 3 hyperparameters: ``Llama3Args`` and the published flavors (torch-free).

Llama 3 (Grattafiori et al., "The Llama 3 Herd of Models", 2024): token embedding -> n_layers x
[RMSNorm -> GQA attention with rotary -> residual, RMSNorm -> SwiGLU feed-forward -> residual] ->
RMSNorm -> output projection; the shared decoder of ``trainer.models.common.decoder``. The FFN width follows
Meta's rule (``ffn_hidden_dim``); rotary uses Llama 3.1's frequency scaling.

Flavors carry the published hyperparameters: debugmodel (dim 256, 6 layers, 16 heads; vocab from
the tokenizer), 1B and 3B (Llama 3.2, tied embeddings, rope factor 32), 8B, 70B and 405B (Llama 3.1,
rope factor 8).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from trainer.models.common.args import ModelArgs

# Llama 3.1 (8B/70B/405B) and Llama 3.2 (1B/3B) rotary frequency scaling, from the models' published
# configs (rope_scaling in config.json).
LLAMA31_ROPE_SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
LLAMA32_ROPE_SCALING = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


@dataclass(frozen=True)
class Llama3Args(ModelArgs):
    """Hyperparameters of a Llama 3 model (``ModelArgs`` plus Meta's FFN sizing: ``multiple_of`` and
    ``ffn_dim_multiplier``); head_dim is dim / n_heads unless given."""

    vocab_size: int = 128256
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 8192
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None

    IGNORED_FIELDS: ClassVar[tuple[str, ...]] = ModelArgs.IGNORED_FIELDS + ("multiple_of", "ffn_dim_multiplier")

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.multiple_of, bool) or not isinstance(self.multiple_of, int) or self.multiple_of < 1:
            raise ValueError(f"Llama3Args.multiple_of: expected an integer >= 1, got {self.multiple_of!r}")

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU hidden size: ``multiple_of * ceil(int(mult * int(8*dim/3)) / multiple_of)`` (Meta's code)."""
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


LLAMA3_FLAVORS: dict[str, Llama3Args] = {
    # torchtitan's debug model; vocab from the tokenizer, rope scaling as the Llama 3.1 models.
    "debugmodel": Llama3Args(dim=256, n_layers=6, n_heads=16, vocab_size=-1, rope_scaling=LLAMA31_ROPE_SCALING),
    # Llama 3.2 (meta-llama/Llama-3.2-1B and -3B config.json)
    "1B": Llama3Args(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256,
                     rope_scaling=LLAMA32_ROPE_SCALING, tie_word_embeddings=True),
    "3B": Llama3Args(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim_multiplier=1.0, multiple_of=256,
                     rope_scaling=LLAMA32_ROPE_SCALING, tie_word_embeddings=True),
    # Llama 3.1 (Meta's reference params.json)
    "8B": Llama3Args(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024,
                     rope_scaling=LLAMA31_ROPE_SCALING),
    "70B": Llama3Args(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096,
                      rope_scaling=LLAMA31_ROPE_SCALING),
    "405B": Llama3Args(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2, multiple_of=4096,
                       rope_scaling=LLAMA31_ROPE_SCALING),
}
