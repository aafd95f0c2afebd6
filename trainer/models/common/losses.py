"""The token losses of the decoder: cross-entropy of logits, and the fused output projection +
cross-entropy that never materializes the logits."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import titan_kernels


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Sum of token cross-entropies in float32.

    logits (batch, seq, vocab) any float dtype; labels (batch, seq) int64, ``ignore_index`` skipped.
    Returns a float32 scalar: the SUM over tokens (the caller divides by the global token count so
    that gradient accumulation and data parallelism give the gradient of one big batch).
    """
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=ignore_index, reduction="sum"
    )


def linear_cross_entropy_loss(model, hidden: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """``cross_entropy_loss`` of the logits ``model.output_weight()`` would give, without making them.

    hidden (batch, seq, dim): the final-norm hidden states of ``model`` (or of its last pipeline
    stage) with ``return_hidden``; labels (batch, seq) int64, ``ignore_index`` skipped. Read right
    after that forward, while the output weight is gathered (FSDP2 keeps the root's parameters from
    forward to backward). Returns the float32 SUM over tokens, computed chunk by chunk by
    ``titan_kernels.linear_cross_entropy``; under tensor parallel (the output weight split on the
    vocabulary) its vocab-parallel loss, a replicated DTensor.
    """
    return titan_kernels.linear_cross_entropy(
        hidden, model.output_weight(), labels, ignore_index=ignore_index, reduction="sum"
    )


def future_labels(labels: torch.Tensor, depth: int, ignore_index: int = -100) -> torch.Tensor:
    """(batch, seq) labels -> (batch, seq, 1 + depth) for multi-token prediction: slice k holds the
    labels shifted left by k (token t + k + 1 at position t), ``ignore_index`` where that lies past the
    sequence; slice 0 is ``labels``. Built before a context-parallel split, so that each rank's shard
    holds the right future tokens."""
    out = labels.new_full((*labels.shape, depth + 1), ignore_index)
    seq = labels.shape[1]
    for k in range(depth + 1):
        out[:, : seq - k, k] = labels[:, k:]
    return out
