"""torch.compile per transformer block (and of the loss), as torchtitan does.

Compiling each block separately keeps compile time flat in depth (all blocks share one graph via
the same code object) and composes with FSDP2, which wraps blocks after they are compiled.
``nn.Module.compile`` compiles in place, so parameter names do not change.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def apply_compile(model: nn.Module, fullgraph: bool = True) -> None:
    """Compile every block of ``model.layers`` in place."""
    if not hasattr(model, "layers"):
        raise TypeError(f"model: expected a module with .layers (transformer blocks), got {type(model).__name__}")
    for block in model.layers.values():
        block.compile(fullgraph=fullgraph)


def compile_loss(loss_fn: Callable) -> Callable:
    """The loss function compiled (the float32 upcast and cross-entropy fuse into one kernel)."""
    return torch.compile(loss_fn)
