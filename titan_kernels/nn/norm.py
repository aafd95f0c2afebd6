"""RMSNorm and AddRMSNorm on the fused titan kernels.

RMSNorm has the constructor, parameters and state_dict of ``torch.nn.RMSNorm``, so checkpoints and
code written for it load unchanged; AddRMSNorm is the same module fused with the residual add before it.
"""
from __future__ import annotations

import numbers

import torch
from torch import nn

from titan_kernels.ops.rms_norm import add_rms_norm, rms_norm


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
