"""Multi-head latent attention (MLA; DeepSeek-V2 sec. 2.1, DeepSeek-V3 sec. 2.1.1) and its
tensor-parallel plan.

For x (batch, seq, dim):
  q      = wq(x), or wq_b(rms_norm(wq_a(x))) with a query latent of ``q_lora_rank``   (heads, qk_nope + qk_rope)
  c, k_r = wkv_a(x) split into the joint KV latent (``kv_lora_rank``) and one rotary key (``qk_rope``)
  k_nope, v = wkv_b(rms_norm(c)) split per head                                (heads, qk_nope), (heads, v)
  q = [q_nope, rope(q_rope)], k = [k_nope, rope(k_r) shared by every head]
  out = wo(flash_attn(q, k, v))  with v's head_dim (128) other than q/k's (192)
The latent norms use eps 1e-6, as Hugging Face's (not ``norm_eps``). The softmax scale is
qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 when rotary is YaRN-scaled (Hugging Face's
``yarn_apply_mscale``; DeepSeek's reference code applies it only past the original length).

Rotary runs on Meta's interleaved pairs of the rope dims (Hugging Face's ``rope_interleave`` true, the
published configs' setting): the pairs land in another order than Hugging Face's output, but q and k
are permuted alike, so the scores are the same; weights load unpermuted (``trainer.models.deepseek_v3.hf``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import titan_kernels
from titan_kernels.nn import RMSNorm, RotaryEmbedding
from titan_kernels.ops.rope_tables import rope_type, yarn_mscale
from trainer.models.common.attention import attend, layer_mask

LATENT_NORM_EPS = 1e-6


def mla_softmax_scale(args) -> float:
    """qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 (module docstring)."""
    scale = args.qk_head_dim ** -0.5
    sc = args.rope_scaling
    if rope_type(sc) == "yarn" and sc.get("mscale_all_dim"):
        scale *= yarn_mscale(sc["factor"], sc["mscale_all_dim"]) ** 2
    return scale


class MLA(nn.Module):
    """Multi-head latent attention (module docstring). forward(x, rope, position_ids=None,
    cu_seqlens=None) as the shared ``Attention``'s: x (batch, seq, dim) -> (batch, seq, dim)."""

    def __init__(self, args, layer_id: int = 0) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.q_lora_rank, self.kv_lora_rank = args.q_lora_rank, args.kv_lora_rank
        self.qk_nope, self.qk_rope, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.qk_dim = self.qk_nope + self.qk_rope
        dim = args.dim
        if self.q_lora_rank:
            self.wq = None
            self.wq_a = nn.Linear(dim, self.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(self.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(self.q_lora_rank, self.n_heads * self.qk_dim, bias=False)
        else:
            self.wq = nn.Linear(dim, self.n_heads * self.qk_dim, bias=False)
            self.wq_a = self.q_norm = self.wq_b = None
        self.wkv_a = nn.Linear(dim, self.kv_lora_rank + self.qk_rope, bias=False)
        self.kv_norm = RMSNorm(self.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(self.kv_lora_rank, self.n_heads * (self.qk_nope + self.v_dim), bias=False)
        self.wo = nn.Linear(self.n_heads * self.v_dim, dim, bias=False)
        self.softmax_scale = mla_softmax_scale(args)
        self.mask = layer_mask(args, layer_id)
        # Set by trainer.parallel.context_parallel (as the shared Attention's).
        self.context_parallel = None
        # Set by QK-clip (trainer.optim.qk_clip): (local heads,) float32 max-logit bounds (``attend``).
        self.register_buffer("max_logit", None, persistent=False)
        # Set by tensor parallel (tp_finish): the latents are replicated, the heads split.
        self.tp_mesh = None

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, position_ids: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        bsz, seq, _ = x.shape
        if self.wq is not None:
            q = self.wq(x)
        else:
            q = self.wq_b(self._replicated(self.q_norm, self._replicated(self.wq_a, x)))
        q = q.view(bsz, seq, -1, self.qk_dim)  # -1: this rank's heads under tensor parallel
        q_nope, q_rope = q.split([self.qk_nope, self.qk_rope], dim=-1)
        latent, k_rope = self._replicated(self.wkv_a, x).split([self.kv_lora_rank, self.qk_rope], dim=-1)
        kv = self.wkv_b(self._replicated(self.kv_norm, latent)).view(bsz, seq, -1, self.qk_nope + self.v_dim)
        k_nope, v = kv.split([self.qk_nope, self.v_dim], dim=-1)
        k_rope = self._rope_key_grad(k_rope).view(bsz, seq, 1, self.qk_rope)
        if self.context_parallel is not None:
            position_ids = self.context_parallel.position_ids(seq, x.device)
        q_rope, k_rope = rope(q_rope, k_rope, position_ids)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        if self.context_parallel is not None:
            out = self.context_parallel(q, k, v, softmax_scale=self.softmax_scale, **self.mask)
        else:
            out = attend(q, k, v, position_ids, cu_seqlens, self.mask, softmax_scale=self.softmax_scale,
                         max_logit=self.max_logit)
        return self.wo(out.reshape(bsz, seq, -1))

    def _replicated(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A latent projection or norm; under tensor parallel through the local tensor of its
        replicated weight (``tp_finish``)."""
        if self.tp_mesh is None:
            return module(x)
        w = module.weight.to_local()
        return F.linear(x, w) if isinstance(module, nn.Linear) else titan_kernels.rms_norm(x, w, module.eps)

    def _rope_key_grad(self, t: torch.Tensor) -> torch.Tensor:
        """Under tensor parallel the shared rotary key, which every rank computes whole, feeds only this
        rank's heads: its gradient is a partial sum, all-reduced over tp in the backward (Megatron's
        "f"). The latents need none: their colwise up-projections' DTensor inputs reduce it."""
        if self.tp_mesh is None:
            return t
        from trainer.models.common.moe import _sum_grad_over

        return _sum_grad_over(t, self.tp_mesh)

    def tp_plan(self) -> dict:
        """The input all-gathered on the sequence; the latent projections and norms replicated (every
        rank computes them whole, ``tp_finish``), the up-projections wq/wq_b and wkv_b colwise (this
        rank's heads), wo rowwise with its output reduce-scattered onto the sequence (as torchtitan's
        DeepSeek-V3 plan)."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

        plan = {
            "": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                   desired_input_layouts=(Replicate(), None, None, None), use_local_output=True),
            "wkv_b": ColwiseParallel(), "wo": RowwiseParallel(output_layouts=Shard(1)),
        }
        plan["wq" if self.wq is not None else "wq_b"] = ColwiseParallel()
        return plan

    def tp_finish(self, tp_mesh) -> None:
        """The replicated parts' weights become replicated DTensors on tp (their gradients are whole,
        and alike on every rank), computed through their local tensors (``_replicated``)."""
        from torch.distributed.tensor import Replicate, distribute_tensor

        for module in (self.wq_a, self.q_norm, self.wkv_a, self.kv_norm):
            if module is not None:
                w = module.weight
                module.weight = nn.Parameter(distribute_tensor(w.data, tp_mesh, [Replicate()], src_data_rank=None),
                                             requires_grad=w.requires_grad)
        self.tp_mesh = tp_mesh
