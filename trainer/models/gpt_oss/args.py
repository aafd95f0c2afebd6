"""GPT-OSS hyperparameters: ``GptOssArgs`` and the published flavors (torch-free).

OpenAI, "gpt-oss-120b & gpt-oss-20b Model Card" (2025), and Hugging Face ``GptOssForCausalLM``: the
shared decoder with
  - attention alternating sliding-window (128 keys, the query's own included) and full layers,
    sliding first (``layer_types``); a learned sink logit per head joining each row's softmax;
    biases on q/k/v/o; GQA (64 query heads, 8 key/value heads of head_dim 64);
  - YaRN rotary (factor 32 over 4096 original positions, theta 150000, untruncated ramp; cos/sin
    scaled by 0.1 ln 32 + 1);
  - a MoE in every layer: a router with a bias, softmax over the top-4 logits; experts with biases
    and the clamped SwiGLU (clamp(up, +-7) + 1) * g sigmoid(1.702 g), g = min(gate, 7); no shared
    experts;
  - RMSNorm eps 1e-5, a vocabulary of 201088 (o200k_harmony), untied embeddings.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from trainer.models.common.args import ModelArgs
from trainer.models.common.moe_args import MoEArgs

YARN = dict(rope_type="yarn", factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
            truncate=False)


def alternating(n_layers: int) -> tuple[str, ...]:
    """GPT-OSS's layer types: sliding, full, sliding, ... (``GptOssConfig``'s default)."""
    return tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers))


@dataclass(frozen=True)
class GptOssArgs(ModelArgs):
    """Hyperparameters of a GPT-OSS model (module docstring); every layer is a MoE layer, so the
    dense FFN width is the experts' (``ffn_hidden_dim``, unused)."""

    vocab_size: int = 201088
    head_dim: int | None = 64
    norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    max_seq_len: int = 131072
    attention_bias: bool = True
    attention_sinks: bool = True
    sliding_window: int = 128

    ACTIVE_INCLUDES_EMBEDDING: ClassVar[bool] = False  # the publisher counts without the lookup
    IGNORED_FIELDS: ClassVar[tuple[str, ...]] = ModelArgs.IGNORED_FIELDS

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", alternating(self.n_layers))
        super().__post_init__()
        if self.moe is None:
            raise ValueError("GptOssArgs.moe: GPT-OSS has a mixture of experts in every layer; got none")

    @property
    def ffn_hidden_dim(self) -> int:
        return self.moe.hidden_dim


def _moe(num_experts: int, top_k: int, hidden_dim: int) -> MoEArgs:
    return MoEArgs(num_experts=num_experts, top_k=top_k, hidden_dim=hidden_dim, score_func="softmax", route_norm=True,
                   router_bias=True, expert_proj_bias=True, swiglu_alpha=1.702, swiglu_limit=7.0, swiglu_up_offset=1.0)


GPT_OSS_FLAVORS: dict[str, GptOssArgs] = {
    # Small enough for our CPU: 4 layers (sliding window 16, full), 8 experts top-2, every feature on.
    "debugmodel": GptOssArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=32, vocab_size=-1,
                             sliding_window=16, max_seq_len=4096, rope_scaling=YARN, moe=_moe(8, 2, 256)),
    # openai/gpt-oss-20b config.json: 20.9e9 parameters, 3.6e9 active.
    "20B": GptOssArgs(dim=2880, n_layers=24, n_heads=64, n_kv_heads=8, rope_scaling=YARN, moe=_moe(32, 4, 2880)),
    # openai/gpt-oss-120b config.json: 116.8e9 parameters, 5.1e9 active.
    "120B": GptOssArgs(dim=2880, n_layers=36, n_heads=64, n_kv_heads=8, rope_scaling=YARN, moe=_moe(128, 4, 2880)),
}
