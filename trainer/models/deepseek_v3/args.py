"""DeepSeek-V3 hyperparameters: ``DeepSeekV3Args`` and the published flavors (torch-free).

DeepSeek-AI, "DeepSeek-V3 Technical Report" (arXiv 2412.19437), and Hugging Face
``DeepseekV3ForCausalLM``:
  - multi-head latent attention (MLA, sec. 2.1.1): q through a low-rank latent (``q_lora_rank``; 0 =
    one plain projection), keys and values from one joint latent (``kv_lora_rank``) plus a decoupled
    rotary key of ``qk_rope_head_dim`` shared by the heads; q/k head_dim qk_nope + qk_rope (192), v's
    ``v_head_dim`` (128); YaRN rotary with its softmax-scale correction mscale^2;
  - DeepSeekMoE (sec. 2.1.2): sigmoid scores, group-limited top-k, the auxiliary-loss-free bias,
    normalised top-k weights times ``routed_scaling_factor``, shared experts, the first
    ``n_dense_layers`` (``first_k_dense_replace``) dense;
  - multi-token prediction (MTP, sec. 2.2): ``num_mtp_layers`` extra blocks, the k-th predicting token
    t + k + 1 from the (k-1)-th's hidden state and token t + k's embedding, sharing the embedding and
    the output head.

Flavors: debugmodel / debugmodel_mla_only (our CPU), 16B and 236B (the DeepSeek-V2-Lite and V2 shapes
in V3's architecture, as torchtitan's), 671B (V3) and kimi_k2 (Moonshot's Kimi K2: V3's architecture,
384 experts, 64 heads).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from trainer.models.common.args import ModelArgs
from trainer.models.common.moe_args import MoEArgs


@dataclass(frozen=True)
class DeepSeekV3Args(ModelArgs):
    """Hyperparameters of a DeepSeek-V3 model (module docstring). ``hidden_dim``: the dense layers'
    SwiGLU width (intermediate_size). ``head_dim`` is set to the q/k head_dim (qk_nope + qk_rope);
    all heads have their own keys and values (n_kv_heads = n_heads)."""

    vocab_size: int = 129280
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_seq_len: int = 4096
    hidden_dim: int = 18432
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    num_mtp_layers: int = 0

    ACTIVE_INCLUDES_EMBEDDING: ClassVar[bool] = False  # the publisher counts without the lookup
    EXTRA_NAME: ClassVar[str] = "MTP"
    SHAPE_FIELDS: ClassVar[tuple[str, ...]] = ModelArgs.SHAPE_FIELDS + (
        "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_mtp_layers")

    def __post_init__(self) -> None:
        object.__setattr__(self, "head_dim", self.qk_nope_head_dim + self.qk_rope_head_dim)
        super().__post_init__()
        for key in ("hidden_dim", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"DeepSeekV3Args.{key}: expected an integer >= 1, got {v!r}")
        for key in ("q_lora_rank", "num_mtp_layers"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"DeepSeekV3Args.{key}: expected an integer >= 0, got {v!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"DeepSeekV3Args.qk_rope_head_dim: must be even for rotary, got {self.qk_rope_head_dim}")
        if self.kv_heads != self.n_heads:
            raise ValueError(f"DeepSeekV3Args.n_kv_heads: MLA gives every head its own keys and values; expected "
                             f"{self.n_heads} (or none), got {self.n_kv_heads}")

    def replace(self, **changes):
        changes.setdefault("head_dim", None)  # re-derived from the MLA head dims
        return super().replace(**changes)

    def record(self) -> dict:
        out = super().record()
        out["head_dim"] = None  # derived (qk_nope + qk_rope)
        return out

    def configure(self, model_config):
        """``ModelArgs.configure`` plus ``--model.mtp_layers`` (-1 keeps the flavor's MTP modules)."""
        args = super().configure(model_config)
        n = getattr(model_config, "mtp_layers", -1)
        return args if n < 0 else args.replace(num_mtp_layers=n)

    @property
    def ffn_hidden_dim(self) -> int:
        return self.hidden_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def tp_divisible(self) -> dict[str, int]:
        out = super().tp_divisible()
        out.pop("n_kv_heads", None)
        return out

    # -- counts --

    def attention_params(self) -> int:
        """MLA: wq (or wq_a, q_norm, wq_b), wkv_a, kv_norm, wkv_b, wo."""
        d, h = self.dim, self.n_heads
        if self.q_lora_rank:
            q = d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * self.qk_head_dim
        else:
            q = d * h * self.qk_head_dim
        kv = d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank \
            + self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + h * self.v_head_dim * d

    def mtp_layer_params(self, active: bool = False) -> int:
        """One MTP module: its two input norms, the (2 dim -> dim) projection, a block (a MoE block
        when the model has experts, as DeepSeek-V3's), its output norm; embedding and head shared."""
        block = self.moe_layer_params(active) if self.moe is not None else self.dense_layer_params()
        return 2 * self.dim + 2 * self.dim * self.dim + block + self.dim

    def extra_params(self, active: bool = False) -> int:
        return self.num_mtp_layers * self.mtp_layer_params(active)

    def attention_layers(self) -> int:
        return self.n_layers + self.num_mtp_layers

    def attention_saved_values(self) -> tuple[int, int]:
        """MLA keeps, per token: on every rank the latents (q's before and after its norm, the joint KV
        latent with the rotary key, its normed part); per head q and k (qk_head_dim), the up-projected
        k_nope and v (kept whole for v's view), the attention output (v_head_dim) and the log-sum-exp."""
        whole = 2 * self.q_lora_rank + 2 * self.kv_lora_rank + self.qk_rope_head_dim
        per_head = self.n_heads * (2 * self.qk_head_dim + self.qk_nope_head_dim + 2 * self.v_head_dim + 1)
        return whole, per_head

    def pipeline_refusal(self) -> str | None:
        if self.num_mtp_layers:
            return ("multi-token prediction is not supported with pipeline parallel (its modules need the first "
                    "stage's embedding on the last stage); use --model.mtp_layers 0")
        return None

    def flops_per_token(self, seq_len: int) -> float:
        """``ModelArgs.flops_per_token`` plus, per MTP module, the shared output head's matmul (the
        MTP blocks' own weights and attention are counted there already)."""
        return super().flops_per_token(seq_len) + 6 * self.num_mtp_layers * self.dim * self.vocab_size


def _moe(num_experts: int, top_k: int, hidden_dim: int, shared: int, **kw) -> MoEArgs:
    return MoEArgs(num_experts=num_experts, top_k=top_k, hidden_dim=hidden_dim, num_shared_experts=shared, **kw)


# YaRN as the published configs have it (factor 40 over an original 4096 positions; Kimi K2 32).
_YARN_V3 = dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                mscale=1.0, mscale_all_dim=1.0)
_YARN_V2_LITE = dict(_YARN_V3, mscale=0.707, mscale_all_dim=0.707)
_YARN_K2 = dict(_YARN_V3, factor=32.0, beta_fast=1.0, beta_slow=1.0)
_V3_ROUTER = dict(score_func="sigmoid", route_norm=True, route_scale=2.5, n_group=8, topk_group=4)

DEEPSEEK_V3_FLAVORS: dict[str, DeepSeekV3Args] = {
    # Small enough for our CPU, every feature on: q-lora, group-limited sigmoid routing with the
    # correction bias, a shared expert, a dense first layer, YaRN, one MTP module.
    "debugmodel": DeepSeekV3Args(
        dim=256, n_layers=4, n_heads=8, vocab_size=-1, hidden_dim=768, q_lora_rank=128, kv_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_dense_layers=1, num_mtp_layers=1,
        rope_scaling=_YARN_V3, moe=_moe(8, 2, 128, 1, score_func="sigmoid", route_norm=True, route_scale=2.5,
                                       n_group=4, topk_group=2)),
    # MLA alone: every layer dense, q without the low-rank path, no MTP.
    "debugmodel_mla_only": DeepSeekV3Args(
        dim=256, n_layers=4, n_heads=8, vocab_size=-1, hidden_dim=768, q_lora_rank=0, kv_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, rope_scaling=_YARN_V3),
    # DeepSeek-V2-Lite's shapes (deepseek-ai/DeepSeek-V2-Lite config.json): 15.7e9, 2.4e9 active.
    "16B": DeepSeekV3Args(
        dim=2048, n_layers=27, n_heads=16, vocab_size=102400, hidden_dim=10944, q_lora_rank=0, n_dense_layers=1,
        max_seq_len=163840, rope_scaling=_YARN_V2_LITE, moe=_moe(64, 6, 1408, 2, score_func="softmax",
                                                                route_norm=False)),
    # DeepSeek-V2's shapes (deepseek-ai/DeepSeek-V2 config.json): 236e9, 21e9 active.
    "236B": DeepSeekV3Args(
        dim=5120, n_layers=60, n_heads=128, vocab_size=102400, hidden_dim=12288, n_dense_layers=1,
        max_seq_len=163840, rope_scaling=_YARN_V3, moe=_moe(160, 6, 1536, 2, score_func="softmax", route_norm=False,
                                                           route_scale=16.0, n_group=8, topk_group=3)),
    # DeepSeek-V3 (deepseek-ai/DeepSeek-V3 config.json): 671e9, 37e9 active, plus one MTP module.
    "671B": DeepSeekV3Args(
        dim=7168, n_layers=61, n_heads=128, hidden_dim=18432, n_dense_layers=3, num_mtp_layers=1,
        max_seq_len=163840, rope_scaling=_YARN_V3, moe=_moe(256, 8, 2048, 1, **_V3_ROUTER)),
    # Kimi K2 (moonshotai/Kimi-K2-Base config.json): 1.04e12, 32.6e9 active.
    "kimi_k2": DeepSeekV3Args(
        dim=7168, n_layers=61, n_heads=64, vocab_size=163840, hidden_dim=18432, n_dense_layers=1, rope_theta=50000.0,
        max_seq_len=131072, rope_scaling=_YARN_K2,
        moe=_moe(384, 8, 2048, 1, score_func="sigmoid", route_norm=True, route_scale=2.827)),
}
