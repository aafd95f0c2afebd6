"""Hyperparameters of a mixture-of-experts feed-forward (``MoEArgs``) and their analytic counts.

Plain Python (no torch): the estimate and the planner read them; ``trainer.models.common.moe`` builds the
layer. Shared by every family with experts (Qwen3-MoE, DeepSeek-V3, GPT-OSS).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

LOAD_BALANCE = ("bias", "aux_loss", "none")
SCORE_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEArgs:
    """A mixture-of-experts feed-forward (``trainer.models.common.moe.MoE``).

    ``num_experts`` routed SwiGLU experts of hidden size ``hidden_dim``; each token goes to ``top_k``
    of them (token choice). ``score_func``: softmax (Qwen3) or sigmoid (DeepSeek-V3) router scores;
    ``route_norm``: the top-k weights renormalised to sum to 1; ``route_scale`` multiplies them
    (DeepSeek-V3's ``routed_scaling_factor``). ``num_shared_experts``: experts every token goes
    through (DeepSeek-V3; one SwiGLU of hidden ``num_shared_experts * hidden_dim``).

    Group-limited routing (DeepSeek-V3, ``n_group`` > 1): the experts form ``n_group`` equal groups;
    a token first keeps the ``topk_group`` groups whose two best (bias-corrected) scores sum
    highest, then picks its top_k experts inside them. ``n_group`` 1 routes over all experts.

    GPT-OSS's experts: ``router_bias`` (a learned bias on the router's logits), ``expert_proj_bias``
    (biases on the experts' projections), and the clamped SwiGLU ``(clamp(up, +-limit) + up_offset) *
    g sigmoid(alpha g)`` with g = min(gate, limit) (``swiglu_alpha`` 1.702, ``swiglu_limit`` 7,
    ``swiglu_up_offset`` 1; limit 0 = none: the plain SwiGLU).

    ``load_balance``: "bias" = auxiliary-loss-free balancing (Wang et al. 2024, arXiv 2408.15664;
    DeepSeek-V3's ``e_score_correction_bias``): a per-expert bias added to the scores for the top-k
    choice only, moved by ``bias_update_rate * sign(mean load - load)`` after each optimizer step;
    "aux_loss" = the sequence-wise auxiliary loss of DeepSeek-V3 (sec. 2.1.2) with weight
    ``aux_loss_coeff``; "none".
    """

    num_experts: int = 8
    top_k: int = 2
    hidden_dim: int = 256
    num_shared_experts: int = 0
    score_func: str = "softmax"
    route_norm: bool = True
    route_scale: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    router_bias: bool = False
    expert_proj_bias: bool = False
    swiglu_alpha: float = 1.0
    swiglu_limit: float = 0.0
    swiglu_up_offset: float = 0.0
    load_balance: str = "bias"
    bias_update_rate: float = 1e-3
    aux_loss_coeff: float = 1e-3

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "hidden_dim", "n_group", "topk_group"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"MoEArgs.{name}: expected an integer >= 1, got {v!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEArgs.top_k: expected at most num_experts={self.num_experts}, got {self.top_k}")
        if not isinstance(self.num_shared_experts, int) or self.num_shared_experts < 0:
            raise ValueError(f"MoEArgs.num_shared_experts: expected an integer >= 0, got {self.num_shared_experts!r}")
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"MoEArgs.score_func: expected one of {', '.join(SCORE_FUNCS)}, got {self.score_func!r}")
        if self.load_balance not in LOAD_BALANCE:
            raise ValueError(
                f"MoEArgs.load_balance: expected one of {', '.join(LOAD_BALANCE)}, got {self.load_balance!r}")
        if not self.bias_update_rate >= 0 or not self.aux_loss_coeff >= 0:
            raise ValueError(f"MoEArgs: bias_update_rate and aux_loss_coeff must be >= 0, got "
                             f"{self.bias_update_rate!r}, {self.aux_loss_coeff!r}")
        if self.num_experts % self.n_group:
            raise ValueError(f"MoEArgs.n_group: expected a divisor of num_experts={self.num_experts}, got "
                             f"{self.n_group}")
        if self.topk_group > self.n_group:
            raise ValueError(f"MoEArgs.topk_group: expected at most n_group={self.n_group}, got {self.topk_group}")
        if self.n_group > 1 and self.num_experts // self.n_group < 2:
            raise ValueError(f"MoEArgs.n_group: group-limited routing scores a group by its two best experts; "
                             f"{self.num_experts} experts in {self.n_group} groups leave fewer than 2 per group")
        if not (self.swiglu_alpha > 0 and self.swiglu_limit >= 0):
            raise ValueError(f"MoEArgs: swiglu_alpha must be > 0 and swiglu_limit >= 0 (0 = none), got "
                             f"{self.swiglu_alpha!r}, {self.swiglu_limit!r}")
        if self.n_group > 1 and self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError(f"MoEArgs.top_k: {self.top_k} experts do not fit in topk_group={self.topk_group} groups "
                             f"of {self.num_experts // self.n_group}")

    def replace(self, **changes) -> "MoEArgs":
        return dataclasses.replace(self, **changes)

    # -- counts of one MoE layer of model width ``dim`` --

    def router_params(self, dim: int) -> int:
        return (dim + self.router_bias) * self.num_experts

    def one_expert_params(self, dim: int) -> int:
        """w1, w2, w3 of one expert (and their biases)."""
        return 3 * dim * self.hidden_dim + (2 * self.hidden_dim + dim if self.expert_proj_bias else 0)

    def expert_params(self, dim: int) -> int:
        """The routed experts' weights (w1, w2, w3 of every expert, and their biases)."""
        return self.num_experts * self.one_expert_params(dim)

    def shared_params(self, dim: int) -> int:
        return 3 * dim * self.hidden_dim * self.num_shared_experts

    def total_params(self, dim: int) -> int:
        return self.router_params(dim) + self.expert_params(dim) + self.shared_params(dim)

    def active_params(self, dim: int) -> int:
        """Weights one token uses: the router, its top_k experts and the shared experts."""
        return self.router_params(dim) + self.top_k * self.one_expert_params(dim) + self.shared_params(dim)

    def active_width(self) -> int:
        """The SwiGLU hidden width one token passes through: top_k experts and the shared ones."""
        return (self.top_k + self.num_shared_experts) * self.hidden_dim
