"""Drop-in modules built on the titan ops.

RMSNorm has the constructor, parameters and state_dict of ``torch.nn.RMSNorm``, so checkpoints and
code written for it load unchanged; AddRMSNorm is the same module fused with the residual add before it.
"""
from __future__ import annotations

import numbers

import torch
from torch import nn

from titan_kernels.ops.rms_norm import add_rms_norm, rms_norm
from titan_kernels.ops.rotary import apply_rotary_emb, rope_cos_sin
from titan_kernels.float8_linear import Float8Linear, convert_to_float8  # noqa: F401  (nn.Linear in float8)


class RMSNorm(nn.Module):
    """``torch.nn.RMSNorm`` on the fused titan kernel.

    Args:
        normalized_shape: int or 1-tuple: the hidden size N (normalization over the last dim only).
        eps: added to the mean square; None means ``torch.finfo(dtype).eps`` as in torch.nn.RMSNorm.
        elementwise_affine: learn a (N,) weight initialised to ones.

    Shapes: input (..., N) float32/bf16/fp16 -> output of the same shape and dtype.
    Raises ValueError for a normalized_shape over more than the last dim (not fused here).
    """

    def __init__(
        self,
        normalized_shape: int | list[int] | tuple[int, ...] | torch.Size,
        eps: float | None = None,
        elementwise_affine: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (int(normalized_shape),)
        normalized_shape = tuple(normalized_shape)
        if len(normalized_shape) != 1:
            raise ValueError(
                f"normalized_shape: titan RMSNorm normalizes over the last dim only, expected one size, got {normalized_shape}"
            )
        self.normalized_shape = normalized_shape
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)

    def _eps(self, x: torch.Tensor) -> float:
        return self.eps if self.eps is not None else torch.finfo(x.dtype).eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self._eps(x))

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class AddRMSNorm(RMSNorm):
    """RMSNorm fused with the residual add before it (the pre-norm block's second norm).

    ``forward(x, residual) -> (rms_norm(x + residual), x + residual)``: both (..., N) in x.dtype, one
    kernel reading x and residual once (``titan_kernels.add_rms_norm``). Same constructor, parameters
    and state_dict as ``RMSNorm``; a module, not a function call, so that tensor parallel can give it a
    sequence-parallel plan like the other norms. Raises as ``add_rms_norm`` for mismatched inputs.
    """

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(x, residual, self.weight, self._eps(x))


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
