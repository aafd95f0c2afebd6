"""Activation checkpointing: recompute a block's activations in the backward pass to save memory.

Modes (``[activation_checkpoint]``):
  none        keep every activation;
  full        every transformer block keeps only its input and recomputes the rest;
  selective   ``selective_ac_option = N``: every N-th block (layer_id % N == 0) as in full mode;
              ``selective_ac_option = "op"``: every block, but the outputs of the matmuls, of
              attention (``titan::flash_attn``: out and LSE) and of ``titan::fp8_linear`` /
              ``titan::linear_cross_entropy`` are saved and only the cheap element-wise ops (norms, rotary, SwiGLU's
              activation) are recomputed (Korthikanti et al., "Reducing Activation Recomputation in
              Large Transformer Models", 2022, sec. 4: the memory-heavy, cheap ops).

The block's ``forward`` is replaced in place (``torch.utils.checkpoint``, non-reentrant), so parameter
names and state_dict keys do not change, and FSDP2/compile applied afterwards wrap it as usual.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

MODES = ("none", "full", "selective")


def _save_ops() -> set:
    """Ops whose outputs "op" mode saves: the FLOP-heavy ones, aten's and ours (titan_kernels' ops run
    through the dispatcher under the checkpoint's dispatch mode, so the policy sees them)."""
    import titan_kernels  # noqa: F401  (registers the titan ops)

    ops = {
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.bmm.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    }
    for name in ("flash_attn", "fp8_linear", "linear_cross_entropy"):
        if hasattr(torch.ops.titan, name):
            ops.add(getattr(torch.ops.titan, name).default)
    return ops


_SAVE_OPS = _save_ops()


def _save_matmuls_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _op_context():
    return create_selective_checkpoint_contexts(_save_matmuls_policy)


def _checkpoint_forward(block: nn.Module, context_fn=None) -> None:
    inner = block.forward
    kwargs = {"context_fn": context_fn} if context_fn is not None else {}

    @functools.wraps(inner)
    def forward(*args, **kw):
        return checkpoint(inner, *args, use_reentrant=False, preserve_rng_state=False, **kwargs, **kw)

    block.forward = forward
    block._titan_ac = True


def apply_ac(model: nn.Module, mode: str, selective_ac_option: str = "2") -> int:
    """Apply activation checkpointing to the blocks of ``model`` (``model.blocks()``: its layers and a
    family's extra blocks, e.g. MTP) in place; returns how many blocks it wraps.

    Raises ValueError for an unknown mode or a bad selective_ac_option (not 'op' or an integer >= 1),
    and if a block is already wrapped.
    """
    if mode not in MODES:
        raise ValueError(f"activation_checkpoint.mode: expected one of {MODES}, got {mode!r}")
    if mode == "none":
        return 0
    every, context_fn = 1, None
    if mode == "selective":
        if selective_ac_option == "op":
            context_fn = _op_context
        elif str(selective_ac_option).isdigit() and int(selective_ac_option) >= 1:
            every = int(selective_ac_option)
        else:
            raise ValueError(
                "activation_checkpoint.selective_ac_option: expected 'op' or an integer >= 1, "
                f"got {selective_ac_option!r}"
            )
    blocks = _blocks(model)
    for layer_id, block in enumerate(blocks):
        if getattr(block, "_titan_ac", False):
            raise ValueError(f"model.layers[{layer_id}]: activation checkpointing is already applied")
    wrapped = 0
    for index, block in enumerate(blocks):
        # The model's own layer id: a pipeline stage holding layers 3..5 wraps the same ones as the whole model.
        if getattr(block, "layer_id", index) % every == 0:
            _checkpoint_forward(block, context_fn)
            wrapped += 1
    return wrapped


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The model's transformer blocks (``blocks()`` where it has it, else ``layers``)."""
    blocks = getattr(model, "blocks", None)
    return blocks() if blocks is not None else list(model.layers.values())
