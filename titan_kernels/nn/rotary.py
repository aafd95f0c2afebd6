"""RotaryEmbedding: rotary position embedding of q and k with its own cos/sin tables."""
from __future__ import annotations

import torch
from torch import nn

from titan_kernels.ops.rotary import apply_rotary_emb, rope_cos_sin


class RotaryEmbedding(nn.Module):
    """Rotary position embedding of q and k (``titan_kernels.apply_rotary_emb``) with its own tables.

    Args:
        head_dim: size of a head; rotary_dim (default head_dim) dims are rotated, the rest copied.
        max_positions: table rows, i.e. the largest position + 1 (e.g. max_seq_len).
        theta: RoPE base (rope_theta; 500000 for Llama 3).
        scaling: None or the Llama 3.1 dict (factor, low_freq_factor, high_freq_factor,
            original_max_position_embeddings); see ``rope_cos_sin``.
        interleaved: True for the complex-pair layout of Meta's llama / torchtitan checkpoints,
            False for the Hugging Face rotate-half layout.
        rotary_dim: number of rotated dims, even and <= head_dim.
        device: device of the tables ("meta" for deferred init; call ``reset_parameters`` after
            ``to_empty``).

    Buffers: ``cos``, ``sin`` float32 (max_positions, rotary_dim // 2), non-persistent (rebuilt,
    never stored in checkpoints). They stay float32 under ``module.to(dtype)``: a cast would round
    the angles, so the tables are rebuilt in float32 instead.

    Forward: q (batch, seq, n_heads, head_dim), k (batch, seq, n_kv_heads, head_dim), optional
    position_ids (seq,) or (batch, seq) int -> (q_out, k_out), new tensors of the input dtype.
    Errors as ``apply_rotary_emb`` and ``rope_cos_sin``.

    Source: Su et al. 2021 (RoFormer), eq. 34; Llama 3.1 scaling as Meta's ``apply_scaling``.
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float = 500000.0,
        scaling: dict | None = None,
        interleaved: bool = True,
        *,
        rotary_dim: int | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(interleaved, bool):
            raise TypeError(f"interleaved: expected a bool, got {type(interleaved).__name__}")
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = dict(scaling) if scaling is not None else None
        self.interleaved = interleaved
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        cos, sin = self._tables(device)  # validates the arguments
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(
            self.head_dim, self.max_positions, self.theta, self.scaling, rotary_dim=self.rotary_dim, device=device
        )

    def reset_parameters(self) -> None:
        """Recompute cos/sin in place on their current device (e.g. after ``to_empty``)."""
        cos, sin = self._tables(self.cos.device)
        with torch.no_grad():
            self.cos.copy_(cos)
            self.sin.copy_(sin)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.cos.dtype != torch.float32:  # e.g. model.to(torch.bfloat16)
            self.cos, self.sin = self._tables(self.cos.device)
        return self

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary_emb(q, k, self.cos, self.sin, interleaved=self.interleaved, position_ids=position_ids)

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, max_positions={self.max_positions}, theta={self.theta}, "
            f"scaling={self.scaling}, interleaved={self.interleaved}, rotary_dim={self.rotary_dim}"
        )
