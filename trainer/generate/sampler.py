"""Choosing the next token from the logits, outside the model (DESIGN.md section 4b).

The order is transformers' (``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``):
divide by the temperature, keep the ``top_k`` largest logits, keep the smallest set of the largest
probabilities whose sum reaches ``top_p`` (nucleus sampling, Holtzman et al. 2020), then draw from the
softmax of what is left. Temperature 0 is greedy (the argmax; the lowest id on ties, as torch.argmax).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """temperature >= 0 (0 = greedy), top_k >= 0 (0 = all tokens), 0 < top_p <= 1 (1 = all)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"temperature: expected a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k: expected an integer >= 0 (0 = no limit), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p: expected a number in (0, 1] (1 = no limit), got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``logits`` (batch, vocab) float32 after temperature, top-k and top-p: the removed tokens at -inf."""
    # shifted so that the largest is 0 first (the softmax is the same): a tiny temperature then sends
    # the others to -inf, not every logit to +-inf and the probabilities to NaN
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the ones before it already reach top_p (the first always stays)
        drop_sorted = (probs.cumsum(-1) - probs) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token of each row: ``logits`` (batch, vocab) -> int64 (batch,). Random draws use
    ``generator`` (on the logits' device), so a seed reproduces them."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = torch.softmax(filter_logits(logits.float(), params), dim=-1)
    return torch.multinomial(probs, 1, generator=generator).view(-1)
