"""torch.compile per transformer block (and of the loss), as torchtitan does.

Compiling each block separately keeps compile time flat in depth (all blocks share one graph via
the same code object) and composes with FSDP2, which wraps blocks after they are compiled.
``nn.Module.compile`` compiles in place, so parameter names do not change.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def apply_compile(model: nn.Module, fullgraph: bool = True, backend: str = "inductor") -> None:
    """Compile every block of ``model`` (its layers and a family's extra blocks) in place with
    ``torch.compile`` ``backend``
    ("inductor"; "aot_eager" traces the same graphs and autograd without generating code).

    ``fullgraph=False`` lets a block run a region eagerly (context parallel's ring attention, which
    communicates point to point); our ops themselves never break the graph.
    """
    if not hasattr(model, "layers") and not hasattr(model, "blocks"):
        raise TypeError(f"model: expected a module with .layers (transformer blocks), got {type(model).__name__}")
    for block in model.blocks() if hasattr(model, "blocks") else model.layers.values():
        block.compile(fullgraph=fullgraph, backend=backend)


def compile_loss(loss_fn: Callable, backend: str = "inductor") -> Callable:
    """The loss function compiled (the float32 upcast and cross-entropy fuse into one kernel)."""
    return torch.compile(loss_fn, backend=backend)
