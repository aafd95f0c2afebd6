"""Activation checkpointing: recompute a block's activations in the backward pass to save memory.

Modes (``[activation_checkpoint]``):
  none        keep every activation;
  full        every transformer block keeps only its input and recomputes the rest;
  selective   ``selective_ac_option = N``: every N-th block (layer_id % N == 0) as in full mode;
              ``selective_ac_option = "op"``: every block, but the outputs of the matmuls, of
              attention (``titan::flash_attn``: out and LSE) and of ``titan::fp8_linear`` /
              ``titan::linear_cross_entropy`` are saved and only the cheap element-wise ops (norms, rotary, SwiGLU's
              activation) are recomputed (Korthikanti et al., "Reducing Activation Recomputation in
              Large Transformer Models", 2022, sec. 4: the memory-heavy, cheap ops);
  offload     every block's saved activations go to pinned host memory and come back one block ahead
              in the backward (``trainer.parallel.activation_offload``);
  budget      each block kept, offloaded or recomputed to fit ``memory_budget_gib``
              (``trainer.config.activation_policy.budget_modes``; the caller resolves it into ``layer_modes``).
``per_layer`` (``layer_modes``) overrides the mode of single blocks: none, op, full or offload.

The block's ``forward`` is replaced in place (``torch.utils.checkpoint``, non-reentrant), so parameter
names and state_dict keys do not change, and FSDP2/compile applied afterwards wrap it as usual.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from trainer.config.activation_policy import base_mode
from trainer.parallel.activation_offload import ActivationOffloader

MODES = ("none", "full", "selective", "offload", "budget")


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


def apply_ac(model: nn.Module, mode: str, selective_ac_option: str = "2", *,
             layer_modes: dict[int, str] | None = None, device: torch.device | str = "cpu") -> int:
    """Apply activation checkpointing (or offload) to the blocks of ``model`` (``model.blocks()``: its
    layers and a family's extra blocks, e.g. MTP) in place; returns how many blocks it wraps.

    ``layer_modes``: {layer id: none | op | full | offload} overriding ``mode`` per block (required
    with mode budget, whose choice the caller makes); ``device``: the training device (offload's
    streams and pinned buffers). The offloader (one per model) is ``model._titan_offloader``.

    Raises ValueError for an unknown mode, a bad selective_ac_option (not 'op' or an integer >= 1),
    mode budget without layer_modes, and if a block is already wrapped.
    """
    if mode not in MODES:
        raise ValueError(f"activation_checkpoint.mode: expected one of {MODES}, got {mode!r}")
    layer_modes = dict(layer_modes or {})
    if mode == "selective" and selective_ac_option != "op" and not (
            str(selective_ac_option).isdigit() and int(selective_ac_option) >= 1):
        raise ValueError(
            "activation_checkpoint.selective_ac_option: expected 'op' or an integer >= 1, "
            f"got {selective_ac_option!r}"
        )
    if mode == "budget" and not layer_modes:
        raise ValueError("activation_checkpoint.mode: budget needs the per-layer modes it chose (layer_modes)")
    if mode == "none" and not layer_modes:
        return 0
    blocks = _blocks(model)
    for layer_id, block in enumerate(blocks):
        if getattr(block, "_titan_ac", False):
            raise ValueError(f"model.layers[{layer_id}]: activation checkpointing is already applied")
    offloader = None
    wrapped = 0
    for index, block in enumerate(blocks):
        # The model's own layer id: a pipeline stage holding layers 3..5 wraps the same ones as the whole model.
        layer_id = getattr(block, "layer_id", index)
        m = layer_modes.get(layer_id) or ("none" if mode == "budget" else base_mode(mode, selective_ac_option, layer_id))
        if m == "none":
            continue
        if m == "offload":
            if offloader is None:
                offloader = ActivationOffloader(torch.device(device))
                model._titan_offloader = offloader
            offloader.wrap(block)
        else:
            _checkpoint_forward(block, _op_context if m == "op" else None)
        wrapped += 1
    return wrapped


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The model's transformer blocks (``blocks()`` where it has it, else ``layers``)."""
    blocks = getattr(model, "blocks", None)
    return blocks() if blocks is not None else list(model.layers.values())
