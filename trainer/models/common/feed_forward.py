"""The SwiGLU feed-forward of the shared decoder (and the shared experts of a MoE layer), with its
tensor-parallel plan."""
from __future__ import annotations

import torch
from torch import nn

import titan_kernels


class FeedForward(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): ``w2(silu(w1 x) * w3 x)``; x (..., dim) -> (..., dim).

    ``silu(.) * .`` is one fused titan op (forward and backward one kernel each). w1 and w3 stay two
    matmuls: one fused (2·hidden, dim) matmul measured no faster at the debugmodel's shape on the
    CPU (bench/bench_swiglu.py, ``ffn_variants``), and separate w1/w3 keep the checkpoint names and
    the tensor-parallel plan.
    """

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(titan_kernels.swiglu(self.w1(x), self.w3(x)))

    def tp_plan(self, gather_input: bool = True) -> dict:
        """w1/w3 colwise, w2 rowwise with its output reduce-scattered onto the sequence; the input
        all-gathered from the sequence (unless the caller gathered it: ``gather_input`` False)."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

        plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel(output_layouts=Shard(1)), "w3": ColwiseParallel()}
        if gather_input:
            plan[""] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        return plan
