"""Llama 3 hyperparameters: ``ModelArgs``, the published flavors and their analytic counts.

Plain Python (no torch), so that the memory estimate and the layout planner (``trainer.estimate``,
``python -m trainer.plan``) load in a fraction of a second; ``trainer.models.llama`` re-exports
everything here and builds the modules.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# Llama 3.1 (8B/70B/405B) and Llama 3.2 (1B/3B) rotary frequency scaling, from the models' published
# configs (rope_scaling in config.json).
LLAMA31_ROPE_SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
LLAMA32_ROPE_SCALING = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


@dataclass(frozen=True)
class ModelArgs:
    """Hyperparameters of a Llama 3 model (names as in Meta's reference code and torchtitan).

    ``vocab_size = -1`` means "take it from the tokenizer" (debugmodel). ``init_std`` is the standard
    deviation of every weight matrix except the residual output projections (attention.wo and
    feed_forward.w2), which are scaled down with depth (``depth_init``: 0.02/sqrt(2*(layer_id+1)),
    as torchtitan; otherwise 0.02/sqrt(2*n_layers), GPT-2 sec. 2.3).
    """

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None
    vocab_size: int = 128256
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: dict | None = None
    max_seq_len: int = 8192
    tie_word_embeddings: bool = False
    init_std: float = 0.02
    depth_init: bool = True

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "multiple_of", "max_seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"ModelArgs.{name}: expected an integer >= 1, got {v!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"ModelArgs.dim: expected a multiple of n_heads={self.n_heads}, got {self.dim}")
        if self.head_dim % 2:
            raise ValueError(f"ModelArgs: head_dim = dim / n_heads must be even for rotary, got {self.head_dim}")
        if self.kv_heads < 1 or self.n_heads % self.kv_heads:
            raise ValueError(
                f"ModelArgs.n_kv_heads: expected a divisor of n_heads={self.n_heads}, got {self.n_kv_heads}"
            )
        if self.vocab_size != -1 and self.vocab_size < 1:
            raise ValueError(f"ModelArgs.vocab_size: expected -1 (from the tokenizer) or >= 1, got {self.vocab_size}")

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU hidden size: ``multiple_of * ceil(int(mult * int(8*dim/3)) / multiple_of)`` (Meta's code)."""
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def replace(self, **changes) -> "ModelArgs":
        return dataclasses.replace(self, **changes)

    # -- analytic counts (no model needed; used by trainer.estimate and the MFU) --

    def embedding_params(self) -> int:
        return self.vocab_size * self.dim

    def layer_params(self) -> int:
        """Parameters of one transformer block: wq, wk, wv, wo, w1, w2, w3 and two norm weights."""
        kv_dim = self.kv_heads * self.head_dim
        attn = self.dim * self.dim * 2 + self.dim * kv_dim * 2
        ffn = 3 * self.dim * self.ffn_hidden_dim
        return attn + ffn + 2 * self.dim

    def num_params(self) -> int:
        """Total trainable parameters (the tied output weight counted once)."""
        self._need_vocab()
        out = 0 if self.tie_word_embeddings else self.vocab_size * self.dim
        return self.embedding_params() + self.n_layers * self.layer_params() + self.dim + out

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: ``6*N + 6*n_layers*n_heads*2*head_dim*seq_len`` (torchtitan's MFU formula).

        N excludes the input embedding (a lookup, no FLOPs); with tied embeddings the same matrix is
        the output projection and is counted. The second term is causal-unaware attention (QK^T and
        PV), as in torchtitan and the PaLM paper (appendix B).
        """
        n = self.num_params() - (0 if self.tie_word_embeddings else self.embedding_params())
        return 6 * n + 6 * self.n_layers * self.n_heads * 2 * self.head_dim * seq_len

    def _need_vocab(self) -> None:
        if self.vocab_size < 1:
            raise ValueError("ModelArgs.vocab_size: not set; take it from the tokenizer (with_vocab) first")


LLAMA3_FLAVORS: dict[str, ModelArgs] = {
    # torchtitan's debug model; vocab from the tokenizer, rope scaling as the Llama 3.1 models.
    "debugmodel": ModelArgs(dim=256, n_layers=6, n_heads=16, vocab_size=-1, rope_scaling=LLAMA31_ROPE_SCALING),
    # Llama 3.2 (meta-llama/Llama-3.2-1B and -3B config.json)
    "1B": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256,
                    rope_scaling=LLAMA32_ROPE_SCALING, tie_word_embeddings=True),
    "3B": ModelArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim_multiplier=1.0, multiple_of=256,
                    rope_scaling=LLAMA32_ROPE_SCALING, tie_word_embeddings=True),
    # Llama 3.1 (Meta's reference params.json)
    "8B": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024,
                    rope_scaling=LLAMA31_ROPE_SCALING),
    "70B": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096,
                     rope_scaling=LLAMA31_ROPE_SCALING),
    "405B": ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2, multiple_of=4096,
                      rope_scaling=LLAMA31_ROPE_SCALING),
}


def model_args(flavor: str, vocab_size: int, max_seq_len: int) -> ModelArgs:
    """The flavor's ModelArgs for a tokenizer of ``vocab_size`` tokens and sequences up to ``max_seq_len``.

    A flavor with ``vocab_size=-1`` (debugmodel) takes the tokenizer's; the others keep their
    published 128256 and reject a larger tokenizer.

    Raises:
        ValueError: unknown flavor, a tokenizer larger than the model's vocabulary, bad max_seq_len.
    """
    if flavor not in LLAMA3_FLAVORS:
        raise ValueError(f"flavor: expected one of {', '.join(LLAMA3_FLAVORS)}, got {flavor!r}")
    args = LLAMA3_FLAVORS[flavor]
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size: expected an integer >= 1, got {vocab_size!r}")
    if args.vocab_size == -1:
        args = args.replace(vocab_size=vocab_size)
    elif vocab_size > args.vocab_size:
        raise ValueError(
            f"vocab_size: the tokenizer has {vocab_size} tokens but flavor {flavor!r} has an embedding of "
            f"{args.vocab_size}; use the model's own tokenizer"
        )
    return args.replace(max_seq_len=max_seq_len)
