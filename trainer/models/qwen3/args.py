"""Qwen3 hyperparameters (dense and mixture-of-experts): ``Qwen3Args`` and the published flavors
(torch-free).

Qwen3 (Qwen team, "Qwen3 Technical Report", 2025; the models' config.json) differs from Llama 3 in:
QK-norm (RMSNorm over head_dim on every query and key head, before the rotary), head_dim 128
whatever dim / n_heads is, rope_theta 1e6 without frequency scaling, RMSNorm eps 1e-6, a vocabulary
of 151936, tied embeddings in the 0.6B/1.7B/4B models, no biases. The MoE models (30B-A3B, 235B-A22B)
replace every feed-forward with 128 routed SwiGLU experts, softmax router, top-8 with the top-k
weights renormalised, no shared experts. Configs with sliding windows (``use_sliding_window``,
``layer_types``) give windowed layers (``ModelArgs.layer_types``).
"""
from __future__ import annotations

from dataclasses import dataclass

from trainer.models.common.args import ModelArgs
from trainer.models.common.moe_args import MoEArgs

QWEN3_VOCAB = 151936


@dataclass(frozen=True)
class Qwen3Args(ModelArgs):
    """Hyperparameters of a Qwen3 model: ``ModelArgs`` with Qwen3's defaults and ``hidden_dim``, the
    dense SwiGLU hidden size (intermediate_size; unused in MoE layers). With ``moe`` every layer is a
    MoE layer (Qwen3's decoder_sparse_step = 1), except the first ``n_dense_layers``."""

    head_dim: int | None = 128
    vocab_size: int = QWEN3_VOCAB
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 4096
    qk_norm: bool = True
    hidden_dim: int = 3072

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.hidden_dim, bool) or not isinstance(self.hidden_dim, int) or self.hidden_dim < 1:
            raise ValueError(f"Qwen3Args.hidden_dim: expected an integer >= 1, got {self.hidden_dim!r}")

    @property
    def ffn_hidden_dim(self) -> int:
        return self.hidden_dim


def _moe(num_experts: int, top_k: int, hidden_dim: int) -> MoEArgs:
    return MoEArgs(num_experts=num_experts, top_k=top_k, hidden_dim=hidden_dim, score_func="softmax", route_norm=True)


QWEN3_FLAVORS: dict[str, Qwen3Args] = {
    # Small enough for our CPU: head_dim 32 (not 128) keeps attention cheap; vocab from the tokenizer.
    "debugmodel": Qwen3Args(dim=256, n_layers=6, n_heads=16, n_kv_heads=8, head_dim=32, hidden_dim=768,
                            vocab_size=-1),
    "debugmodel_moe": Qwen3Args(dim=256, n_layers=4, n_heads=16, n_kv_heads=8, head_dim=32, hidden_dim=768,
                                vocab_size=-1, moe=_moe(8, 2, 256)),
    # Qwen/Qwen3-*/config.json
    "0.6B": Qwen3Args(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, hidden_dim=3072, tie_word_embeddings=True),
    "1.7B": Qwen3Args(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, hidden_dim=6144, tie_word_embeddings=True),
    "4B": Qwen3Args(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, hidden_dim=9728, tie_word_embeddings=True),
    "8B": Qwen3Args(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, hidden_dim=12288),
    "14B": Qwen3Args(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, hidden_dim=17408),
    "32B": Qwen3Args(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, hidden_dim=25600),
    "30B-A3B": Qwen3Args(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, hidden_dim=6144, moe=_moe(128, 8, 768)),
    "235B-A22B": Qwen3Args(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, hidden_dim=12288,
                           moe=_moe(128, 8, 1536)),
}
