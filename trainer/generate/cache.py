"""KV caches for generation, one class per attention layer kind (DESIGN.md section 4b).

A cache is owned by the attention module that uses it (``module.kv_cache``; the module's forward
hands it q, k, v after the rotary and takes back the attention output). All caches of a model share
one :class:`CacheState`, which the generation loop advances: which phase runs (prefill or decode),
how many tokens each sequence holds, and the prefill's packing.

Phases:
  prefill  the prompts of a batch packed into one row without padding (positions restarting at 0
           per prompt): attention is the model's own ``flash_attn_varlen`` over the prompts, and
           each cache keeps the keys its layer kind needs.
  decode   one new token per sequence: its key/value is written into the cache, then one query
           attends over the cache through ``flash_attn`` on views of the cache: one call when every
           row reads as many slots, else one per run of rows reading the same count (no copy, no
           padding read); bottom-right causal alignment would let the one query see them all, so
           it runs as the unmasked case (``attend_cached``).

Layer kinds (what a row keeps; a slot is where the key of position p lives):
  FullCache           every position, slot p (grows to the batch's longest sequence).
  SlidingWindowCache  a ring of W slots, slot p mod W: the window of the query at p is p-W+1..p,
                      which the ring holds once it has written p (GPT-OSS; sinks join each step).
  ChunkedCache        the current chunk of C positions, slot p mod C: the query at p sees
                      C*(p//C)..p (Llama 4's chunked attention).
  MLACache            (``trainer.generate.mla_cache``) the normed latent and the rotary key.

Keys are stored after the rotary, so the order of the slots is irrelevant to the softmax. Memory
for every cache is allocated once, at the prefill, for the batch and its longest sequence
(``CacheState.capacity``), in the dtype and on the device of the keys; under tensor parallel each
rank holds its own heads (the shapes come from the module's local k/v).

A new layer kind is a subclass giving ``size`` (slots per row), ``keep`` (which prefill positions
stay) and ``visible`` (how many slots the query at a position reads); ``cache_kind`` picks the
class of a module, and ``CACHE_KINDS`` lets a family add its own rule.
"""
from __future__ import annotations

from typing import Callable

import torch

import titan_kernels
from trainer.generate.decode_attention import grouped_decode_attention
from trainer.models.common.attention import attend


class CacheState:
    """What every cache of a model shares during one generation (the loop sets it; the caches read it).

    Attributes:
        batch: sequences in the batch.
        capacity: the most tokens any sequence reaches (longest prompt + max_new_tokens); slots of
            a full cache.
        lengths: int64 (batch,) tokens each sequence holds before the current forward (the position
            of its next token), on the model's device; ``lengths_host`` the same as a list.
        phase: "prefill" or "decode".
        prompt_lengths: the prompts' lengths (prefill), their packing ``cu_seqlens`` int32
            (batch + 1,), and for each packed token its row ``rows`` and position ``positions``
            (int64 (total,)).
    """

    def __init__(self, prompt_lengths: list[int], capacity: int, device: torch.device) -> None:
        if not prompt_lengths or min(prompt_lengths) < 1:
            raise ValueError(f"prompts: expected at least one prompt of at least one token, got lengths {prompt_lengths}")
        if max(prompt_lengths) > capacity:
            raise ValueError(f"capacity: {capacity} is shorter than the longest prompt ({max(prompt_lengths)})")
        self.batch, self.capacity, self.device = len(prompt_lengths), capacity, device
        self.prompt_lengths = list(prompt_lengths)
        lengths = torch.tensor(prompt_lengths, dtype=torch.int64)
        self.cu_seqlens = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32).to(device)
        self.rows = torch.repeat_interleave(torch.arange(self.batch), lengths).to(device)
        self.row_lengths = torch.repeat_interleave(lengths, lengths).to(device)  # each packed token's prompt length
        self.positions = torch.cat([torch.arange(n) for n in prompt_lengths]).to(device)
        self.batch_rows = torch.arange(self.batch, device=device)
        self.lengths = torch.zeros(self.batch, dtype=torch.int64, device=device)
        self.lengths_host = [0] * self.batch
        self.phase = "prefill"
        self._plans: dict = {}
        self._index: dict = {}

    def prefill_inputs(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(tokens, position_ids) of the prefill: the prompts packed into one row, each (1, total) int64
        (attention per prompt through ``flash_attn_varlen``); prompts of one length are already
        unpadded as a (batch, length) batch, which runs the dense causal attention instead (one
        kernel call rather than one per prompt), position_ids None. Either way the tokens are in the
        order of ``rows`` / ``positions``."""
        tokens = torch.tensor([t for p in prompts for t in p], dtype=torch.int64, device=self.device)
        if len(set(self.prompt_lengths)) == 1:
            return tokens.view(self.batch, -1), None
        return tokens[None], self.positions[None]

    def last_positions(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final hidden state (batch, dim) of each prompt from the prefill's output."""
        return hidden.flatten(0, 1)[self.cu_seqlens[1:].long() - 1]

    def decode_inputs(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens (batch, 1), position_ids (batch, 1)) of a decode step on the new ``tokens`` (batch,)."""
        return tokens.view(self.batch, 1), self.lengths.view(self.batch, 1)

    def start_decode(self) -> None:
        """After the prefill: every sequence holds its prompt."""
        self.phase = "decode"
        self.lengths_host = list(self.prompt_lengths)
        self.lengths = torch.tensor(self.lengths_host, dtype=torch.int64, device=self.device)
        self._plans.clear()
        self._index.clear()

    def advance(self) -> None:
        """After a decode step: every sequence holds one more token. Raises RuntimeError when the next
        token would not fit the cache (the loop sizes it so that this never happens)."""
        if any(n + 1 >= self.capacity for n in self.lengths_host):
            raise RuntimeError(f"generation: a sequence would pass the cache's capacity of {self.capacity} tokens")
        self.lengths_host = [n + 1 for n in self.lengths_host]
        self.lengths += 1
        self._plans.clear()
        self._index.clear()

    def decode_index(self, key, slot: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, slots) int64 (batch,) where this decode step writes each row's new key, for a cache
        whose position p lives at ``slot(p)``; computed once per step and layer kind ``key``."""
        index = self._index.get(key)
        if index is None:
            index = self._index[key] = (self.batch_rows, slot(self.lengths))
        return index

    def decode_plan(self, key, visible: Callable[[int], int]):
        """The attention layout of this decode step for a cache whose query at position p reads
        ``visible(p)`` slots: a list of (first row, last row + 1, count) for runs of consecutive rows
        reading the same count (one dense call each; one run when every row reads as many, e.g. equal
        prompts or full windows). Computed once per step and layer kind ``key`` (the layers of a kind
        share it)."""
        plan = self._plans.get(key)
        if plan is None:
            counts = [visible(p) for p in self.lengths_host]
            plan = []
            for b, n in enumerate(counts):
                if plan and plan[-1][2] == n:
                    plan[-1] = (plan[-1][0], b + 1, n)
                else:
                    plan.append((b, b + 1, n))
            self._plans[key] = plan
        return plan


def attend_cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan, softmax_scale=None, sinks=None):
    """One query per row (q (batch, 1, heads, d)) over cached keys k (batch, slots, kv_heads, d) /
    v (batch, slots, kv_heads, dv) (any strides) laid out by ``CacheState.decode_plan``; returns
    (batch, 1, heads, dv). Each run of rows is one ``flash_attn`` call on views of the cache (no copy).

    The one query of a row sees every key the plan gives it: with bottom-right alignment causal is
    the same mask, so the call says causal=False, which every backend runs as its plain (unmasked)
    case (on the CPU causal with seq_q < seq_k goes through the query-block decomposition instead;
    measured 15 ms against 0.03 ms per call at batch 1, 150 keys, 16 heads)."""
    extra = {} if sinks is None else {"sinks": sinks}
    outs = [titan_kernels.flash_attn(q[lo:hi], k[lo:hi, :n], v[lo:hi, :n], causal=False, softmax_scale=softmax_scale,
                                     **extra) for lo, hi, n in plan]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


class KVCache:
    """The cache of one attention layer of the shared kind (GQA with rotary keys): keys and values
    (batch, size, kv_heads, head_dim), written at ``slot(p)``. Subclasses define the layer kind.

    ``grouped_decode`` (class switch, default on): decode on the CPU without sinks runs
    ``grouped_decode_attention`` (two batched matmuls on the head-major storage) instead of
    ``flash_attn`` (measured faster at one query: ``bench/bench_generate.py``); off, or on other
    devices and with sinks, ``attend_cached``."""

    grouped_decode = True

    def __init__(self, state: CacheState) -> None:
        self.state = state
        self.k = self.v = None

    # -- the layer kind: overridden by subclasses ----------------------------------------------------

    def size(self) -> int:
        """Slots per row."""
        return self.state.capacity

    def slot(self, positions: torch.Tensor) -> torch.Tensor:
        return positions % self.size()

    def keep(self, positions: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Which prefill tokens (their positions, their prompt's lengths) the cache keeps."""
        return torch.ones_like(positions, dtype=torch.bool)

    def visible(self, position: int) -> int:
        """Slots the query at ``position`` reads (after its own key is written)."""
        return position + 1

    def kind_key(self) -> tuple:
        """Equal for the caches that read the same slots (they share one decode plan per step)."""
        return (type(self), self.size())

    # -- shared ----------------------------------------------------------------------------------------

    def _allocate(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """(batch, size, kv_heads, d) views of head-major storage (batch, kv_heads, size, d): each head's
        keys lie contiguous, the layout attention kernels read best (transformers' cache has it too)."""
        b, n = self.state.batch, self.size()
        self.k = k.new_zeros((b, k.shape[2], n, k.shape[3])).transpose(1, 2)
        self.v = v.new_zeros((b, v.shape[2], n, v.shape[3])).transpose(1, 2)

    def _store_prefill(self, *tensors_and_buffers) -> None:
        st = self.state
        kept = self.keep(st.positions, st.row_lengths)
        rows, slots = st.rows[kept], self.slot(st.positions[kept])
        for src, buf in tensors_and_buffers:  # src: (1, total, ...) packed or (batch, length, ...)
            buf[rows, slots] = src.flatten(0, 1)[kept].to(buf.dtype)

    def _store_decode(self, *tensors_and_buffers) -> None:
        st = self.state
        index = st.decode_index(self.kind_key(), self.slot)
        for src, buf in tensors_and_buffers:
            buf.index_put_(index, src[:, 0].to(buf.dtype))

    def attend(self, q, k, v, position_ids, cu_seqlens, mask: dict, sinks=None, softmax_scale=None):
        """The attention of the module's q (batch, seq, heads, d), k/v (batch, seq, kv_heads, .) (after
        the rotary), which it would have run itself with ``mask``; keeps k/v. Returns
        (batch, seq, heads, dv)."""
        if self.state.phase == "prefill":
            if self.k is None:
                self._allocate(k, v)
            self._store_prefill((k, self.k), (v, self.v))
            return attend(q, k, v, position_ids, cu_seqlens, mask, softmax_scale=softmax_scale, sinks=sinks)
        self._store_decode((k, self.k), (v, self.v))
        plan = self.state.decode_plan(self.kind_key(), self.visible)
        if self.grouped_decode and sinks is None and q.device.type == "cpu":
            # head-major storage (batch, kv_heads, slots, d) as allocated: see trainer.generate.decode_attention
            return grouped_decode_attention(q, self.k.transpose(1, 2), self.v.transpose(1, 2), plan, softmax_scale)
        return attend_cached(q, self.k, self.v, plan, softmax_scale, sinks)


class FullCache(KVCache):
    """Causal attention over the whole sequence: every position kept, slot p."""

    def slot(self, positions: torch.Tensor) -> torch.Tensor:
        return positions


class _RingCache(KVCache):
    """A kind whose query reads at most ``span`` keys: a ring of that many slots (fewer where the
    batch's longest sequence is shorter)."""

    def __init__(self, state: CacheState, span: int) -> None:
        super().__init__(state)
        self.span = span

    def size(self) -> int:
        return min(self.span, self.state.capacity)

    def kind_key(self) -> tuple:
        return (*super().kind_key(), self.span)  # two spans can cap to one size yet keep other slots


class SlidingWindowCache(_RingCache):
    """A sliding window of ``span`` keys (the query's own included)."""

    def keep(self, positions, lengths):
        return positions >= lengths - self.span

    def visible(self, position: int) -> int:
        return min(position + 1, self.span)


class ChunkedCache(_RingCache):
    """Chunked attention (chunks of ``span`` absolute positions): the current chunk only."""

    def keep(self, positions, lengths):
        return positions >= (lengths - 1) // self.span * self.span

    def visible(self, position: int) -> int:
        return position % self.span + 1
