"""The optimizer's memory for ``trainer.estimate.memory``: state values per optimizer, and Muon's buffers
at the optimizer step. Torch-free, like the estimate.

  AdamW  2 states (exp_avg, exp_avg_sq) per parameter.
  Muon   1 state (the momentum) per parameter of the hidden matrices and MoE experts, 2 (AdamW's)
         for the rest: embedding, output, norms, biases, routers, sinks (``trainer.optim.groups``).
         At the step the Newton-Schulz exchange holds, in bf16, 2 rounds in flight of about 3
         matrices each (pieces out, the owned matrix, results back) and one iteration's X, X', A, B
         of the largest matrix; a MoE layer's E/ep local experts (one of w1/w2/w3) are one batch
         (``trainer.optim.muon_dist``).
"""
from __future__ import annotations

OPTIMIZERS = ("adamw", "muon")


def block_vector_params(c) -> float:
    """Parameters of an (average) block that stay on AdamW under Muon: norms (QK-norms, MLA's latent
    norms), biases, attention sinks and routers. ``c``: a ``trainer.estimate.memory.ModelCosts``."""
    a = c.args
    if a is None:
        return 2 * c.dim
    q_dim, kv_dim = a.n_heads * a.qk_head_dim, a.kv_heads * a.qk_head_dim
    n = 2 * a.dim + (2 * a.head_dim if getattr(a, "qk_norm", False) else 0)
    n += (getattr(a, "q_lora_rank", 0) or 0) + (getattr(a, "kv_lora_rank", 0) or 0)
    if getattr(a, "attention_bias", False):
        n += q_dim + 2 * kv_dim + a.dim
    if getattr(a, "attention_sinks", False):
        n += a.n_heads
    if a.moe is not None:
        router = a.moe.num_experts * (a.dim + (1 if getattr(a.moe, "router_bias", False) else 0))
        n += router * a.n_moe_layers / a.n_layers
    return n


def state_values(c, layers: float, p_stage: float, optimizer: str) -> float:
    """Optimizer state values of a stage holding ``p_stage`` parameters, ``layers`` of its blocks."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer: expected one of {OPTIMIZERS}, got {optimizer!r}")
    if optimizer == "adamw":
        return 2 * p_stage
    return 2 * p_stage - layers * (c.block_params - block_vector_params(c))


def muon_step_bytes(c, ep: int = 1) -> float:
    """Muon's transient bytes at the optimizer step (module docstring)."""
    a = c.args
    widest = c.ffn_hidden if a is None else max(a.ffn_hidden_dim, a.moe.hidden_dim if a.moe else 0)
    big = max(c.dim * widest, c.q_dim * c.dim)
    if c.n_moe_layers:
        big = max(big, c.expert_params / (3 * c.n_moe_layers * ep))
    return 2 * (8 * big + 2 * c.dim ** 2)
