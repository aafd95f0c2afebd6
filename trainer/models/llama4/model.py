"""The Llama 4 model: the shared decoder with Llama 4's attention (``Llama4Attention``) in every block.

The feed-forwards are the shared ones: ``TransformerBlock.make_feed_forward`` builds a ``MoE`` on
``args.moe_layers`` (top-1 sigmoid routing whose weight scales the expert's input,
``MoEArgs.score_before_experts``, and one shared expert) and a dense SwiGLU of ``args.hidden_dim``
elsewhere. Parameter names are the shared decoder's, so every parallel layout treats the family alike.
"""
from __future__ import annotations

import torch
from torch import nn

import titan_kernels
from titan_kernels.nn import RotaryEmbedding
from trainer.models.common.attention import Attention
from trainer.models.common.decoder import Transformer, TransformerBlock


def temperature_scale(positions: torch.Tensor, floor_scale: int, attn_scale: float) -> torch.Tensor:
    """Llama 4's attention temperature tuning (Hugging Face ``Llama4TextAttention``; Meta's reference
    ``llama4/model.py``, after Nakanishi 2025, arXiv 2501.19399): the factor multiplying the query at
    position p, ``1 + attn_scale * ln(1 + floor((p + 1) / floor_scale))``. positions int64 (any
    shape) -> float32 of that shape (1.0 for p < floor_scale - 1)."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0


class Llama4Attention(Attention):
    """Grouped-query attention of one Llama 4 layer (``trainer.models.llama4.args`` module docstring).

    A RoPE layer (``args.uses_rope``) rotates q and k on interleaved pairs, then, with
    ``use_qk_norm``, normalises every query and key head by a weightless RMS norm; its mask is the
    layer's chunk (``args.attention_window``). A NoPE layer does not rotate; with
    ``attn_temperature_tuning`` its queries are scaled by ``temperature_scale`` of their positions
    (the global ones under context parallel, the document's with ``position_ids``). The softmax scale
    is head_dim^-0.5 on both. Shapes as ``Attention``.
    """

    def __init__(self, args, layer_id: int = 0) -> None:
        super().__init__(args, layer_id)
        self.use_rope = args.uses_rope(layer_id)
        self.qk_norm_eps = args.norm_eps if (args.use_qk_norm and self.use_rope) else None
        self.temperature = (args.floor_scale, args.attn_scale) if (args.attn_temperature_tuning
                                                                   and not self.use_rope) else None

    def position_qk(self, q: torch.Tensor, k: torch.Tensor, rope: RotaryEmbedding,
                    position_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.use_rope:
            q, k = rope(q, k, position_ids)
            if self.qk_norm_eps is not None:
                # Hugging Face's Llama4TextWeightlessRMSNorm (once named L2Norm): RMS, not L2, over head_dim.
                q = titan_kernels.rms_norm(q, None, self.qk_norm_eps)
                k = titan_kernels.rms_norm(k, None, self.qk_norm_eps)
            return q, k
        if self.temperature is not None:
            seq = q.shape[1]
            pos = torch.arange(seq, device=q.device) if position_ids is None else position_ids
            scale = temperature_scale(pos, *self.temperature)
            # (seq,) or (batch, seq) -> broadcast over heads and head_dim
            q = q * scale.view(*scale.shape, 1, 1).to(q.dtype)
        return q, k

    def extra_repr(self) -> str:
        kind = "rope" if self.use_rope else "nope"
        return f"{kind}, qk_norm_eps={self.qk_norm_eps}, temperature={self.temperature}, mask={self.mask}"


class Llama4Block(TransformerBlock):
    """A pre-norm block with Llama 4's attention (the feed-forward: dense or MoE as the args say)."""

    def make_attention(self, layer_id: int, args) -> nn.Module:
        return Llama4Attention(args, layer_id)


class Llama4(Transformer):
    """The Llama 4 text decoder: ``forward(tokens (batch, seq) int64, position_ids=None)`` as
    ``Transformer``. The rotary table serves the RoPE layers only."""

    block_cls = Llama4Block

