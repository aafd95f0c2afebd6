"""The stateful loader: documents -> BOS/EOS-joined token stream -> packed windows -> rank batches.

Packing. Each non-empty document becomes ``[BOS] + tokens + [EOS]``; the documents are joined into
one stream in source order, and the stream is cut into consecutive, non-overlapping windows of
``seq_len + 1`` tokens. A window gives ``input_ids = w[:-1]`` and ``labels = w[1:]`` (the next
tokens). ``position_ids`` restart at 0 wherever a document starts inside the window, and at the
window's first token (a document carried over from the previous window continues from 0), so they
always lie in ``[0, seq_len)``; they are computed from the packing itself, not by searching for EOS.
They are meant for document masking; a model without it can ignore them.

Ranks. Windows are numbered in stream order over all ranks and dealt round-robin: window ``g``
goes to data-parallel rank ``g % dp_world_size``. Every rank reads the whole stream (tokenizing is
cheap next to a training step) and keeps its own windows, so for the same global batch the union of
the windows of all ranks in one step is the same for every layout: ranks x local batch x
micro-batches over ``dp`` ranks covers exactly the windows one process would see.

State. The position in the stream is ``(epoch, doc_index, token_offset, window_index)``; that is
the whole state (plain ints), so a resume, however many times, continues with exactly the next
sample. At the end of the source the next epoch starts from its first document again.

Tokenized documents are cached in memory (up to ``max_cached_tokens``), so later epochs and
resumes do not tokenize again.

One pass (``one_epoch=True``, for validation): at the end of the source the stream stops instead of
starting the next epoch. The last window is filled up with padding whose labels are
``ignore_index``, and every later window is all padding, so a batch never mixes in a second epoch
and the loss over the batches is the loss over exactly the tokens of one pass.

From a configuration: :func:`build_dataloader` (training) and :func:`build_validation_loader` (one
pass of the validation source, or of the training source's held-out part).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from trainer.data.datasets import DocumentSource, build_source
from trainer.data.splits import held_out_split, split_source
from trainer.data.tokenizer import Tokenizer

logger = logging.getLogger("trainer")

STATE_VERSION = 1
IGNORE_INDEX = -100  # labels of padding (one_epoch mode); the loss skips them


class DataLoader:
    """Infinite iterator of batches ``{"input_ids", "labels", "position_ids"}`` for one dp rank.

    Each value is an int64 tensor of shape ``(local_batch_size, seq_len)`` on the CPU.

    Args:
        source: the documents (see :mod:`trainer.data.datasets`).
        tokenizer: gives ``encode_array``, ``bos_id`` and ``eos_id``.
        seq_len: tokens per sequence (windows hold ``seq_len + 1`` tokens).
        local_batch_size: sequences per batch on this rank.
        dp_rank / dp_world_size: this rank's index and the number of data-parallel ranks.
        max_cached_tokens: how many tokens of tokenized documents to keep in memory.
        one_epoch: stop at the end of the source (padding, labels ``IGNORE_INDEX``) instead of
            starting the next epoch; batches after the end are all padding.

    Raises:
        ValueError: a bad argument (named in the message); a source with no text at all (on first use).
    """

    def __init__(
        self,
        source: DocumentSource,
        tokenizer: Tokenizer,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        max_cached_tokens: int = 1 << 26,
        one_epoch: bool = False,
    ) -> None:
        for arg, value, low in (("seq_len", seq_len, 1), ("local_batch_size", local_batch_size, 1),
                                ("dp_world_size", dp_world_size, 1), ("max_cached_tokens", max_cached_tokens, 0)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{arg}: expected an int, got {type(value).__name__}")
            if value < low:
                raise ValueError(f"{arg}: expected an integer >= {low}, got {value}")
        if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank: expected an integer in [0, {dp_world_size}), got {dp_rank!r}")
        self.source = source
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.max_cached_tokens = max_cached_tokens
        self.one_epoch = one_epoch
        # Position in the stream: the next token is token `token_offset` of document `doc_index`.
        self._epoch = 0
        self._doc_index = 0
        self._token_offset = 0
        self._window_index = 0  # windows produced so far, all ranks together
        self._doc: np.ndarray | None = None  # tokens of document `doc_index`, once read
        # Tokenized documents of one epoch, by index; `_num_docs` is known after the first full pass.
        self._cache: dict[int, np.ndarray] = {}
        self._cached_tokens = 0
        self._num_docs: int | None = None
        self._reader: Iterator[str] | None = None
        self._reader_index = -1  # index of the document `_reader` yields next
        self._tokens_seen_this_epoch = 0

    # -- documents ------------------------------------------------------------------------------

    def _tokens_of(self, index: int) -> np.ndarray | None:
        """Tokens of document ``index`` with BOS/EOS (empty for an empty document); None past the end."""
        if self._num_docs is not None and index >= self._num_docs:
            return None
        cached = self._cache.get(index)
        if cached is not None:
            return cached
        if self._reader is None or self._reader_index != index:
            self._reader = self.source.iter_from(index)
            self._reader_index = index
        try:
            text = next(self._reader)
        except StopIteration:
            self._num_docs = index
            self._reader = None
            return None
        self._reader_index += 1
        if text:
            body = self.tokenizer.encode_array(text)
            tokens = np.empty(body.size + 2, dtype=np.int32)
            tokens[0], tokens[1:-1], tokens[-1] = self.tokenizer.bos_id, body, self.tokenizer.eos_id
        else:
            tokens = np.empty(0, dtype=np.int32)
        if self._cached_tokens + tokens.size <= self.max_cached_tokens:
            self._cache[index] = tokens
            self._cached_tokens += tokens.size
        return tokens

    def _current_doc(self) -> np.ndarray | None:
        """Tokens of the document under the cursor, moving to the next document (or epoch) as needed;
        None at the end of the source in one_epoch mode."""
        while True:
            if self._doc is None:
                self._doc = self._tokens_of(self._doc_index)
                if self._doc is None:  # end of the source: next epoch
                    if self._doc_index == 0 or self._tokens_seen_this_epoch == 0:
                        use = "evaluate" if self.one_epoch else "train on"  # one_epoch: the validation loader
                        raise ValueError(
                            f"dataset {self.source.name!r} has no text to {use} (no document, or only empty ones)"
                        )
                    if self.one_epoch:
                        return None
                    self._epoch += 1
                    self._doc_index = 0
                    self._token_offset = 0
                    self._tokens_seen_this_epoch = 0
                    continue
            if self._token_offset < self._doc.size:
                return self._doc
            self._doc_index += 1
            self._token_offset = 0
            self._doc = None

    # -- windows --------------------------------------------------------------------------------

    def _next_window(self, keep: bool) -> tuple[np.ndarray, np.ndarray, int] | None:
        """Advance over one window of seq_len + 1 tokens; return (tokens, positions, real tokens) if
        ``keep`` (real tokens < seq_len + 1 only at the end of a one-epoch pass: the rest is padding)."""
        need = self.seq_len + 1
        tokens = np.empty(need, dtype=np.int64) if keep else None
        positions = np.empty(need, dtype=np.int64) if keep else None
        filled = 0
        while filled < need:
            doc = self._current_doc()
            if doc is None:  # one_epoch: the pass is over; pad (a fresh "document" from position 0)
                if keep:
                    tokens[filled:] = self.tokenizer.eos_id
                    positions[filled:] = np.arange(need - filled)
                self._window_index += 1
                return (tokens, positions, filled) if keep else None
            take = min(need - filled, doc.size - self._token_offset)
            if keep:
                tokens[filled:filled + take] = doc[self._token_offset:self._token_offset + take]
                positions[filled:filled + take] = np.arange(take)  # restart at a document / window start
            self._token_offset += take
            self._tokens_seen_this_epoch += take
            filled += take
        self._window_index += 1
        return (tokens, positions, need) if keep else None

    def __iter__(self) -> "DataLoader":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        windows = np.empty((self.local_batch_size, self.seq_len + 1), dtype=np.int64)
        positions = np.empty_like(windows)
        real = np.empty(self.local_batch_size, dtype=np.int64)
        row = 0
        while row < self.local_batch_size:
            mine = self._window_index % self.dp_world_size == self.dp_rank
            out = self._next_window(keep=mine)
            if mine:
                windows[row], positions[row], real[row] = out
                row += 1
        labels = np.ascontiguousarray(windows[:, 1:])
        if self.one_epoch:
            # label j is token j + 1 of the window: padding from there on
            labels[np.arange(self.seq_len)[None, :] + 1 >= real[:, None]] = IGNORE_INDEX
        return {
            "input_ids": torch.from_numpy(np.ascontiguousarray(windows[:, :-1])),
            "labels": torch.from_numpy(labels),
            "position_ids": torch.from_numpy(np.ascontiguousarray(positions[:, :-1])),
        }

    def advance_to(self, window_index: int) -> None:
        """Skip the windows (of the other ranks) up to global window ``window_index``, so that every
        rank's loader stands at the same position: the end of the step (replica groups, whose number
        may change at the next step)."""
        while self._window_index < window_index:
            self._next_window(keep=False)

    def rewind(self) -> None:
        """Go back to the first token of the first epoch (tokenized documents stay cached)."""
        self._epoch = self._doc_index = self._token_offset = self._window_index = 0
        self._tokens_seen_this_epoch = 0
        self._doc = None

    def check(self) -> None:
        """Read the first batch, then rewind: a source without text or with a file that is not text
        fails now (ValueError naming it), before a model is built, rather than in the first step."""
        state = self.state_dict()
        next(self)
        self.load_state_dict(state)

    def epoch_tokens(self, limit: int) -> int | None:
        """Tokens in one pass over the source (BOS/EOS included), if it has at most ``limit``; None if more.

        Reads (and caches) documents from the start without moving the stream position."""
        total = 0
        for index in range(1 << 62):
            tokens = self._tokens_of(index)
            if tokens is None:
                return total
            total += tokens.size
            if total > limit:
                return None
        return None

    def repeat_warning(self, tokens_per_step: int, steps: int, scan_limit: int = 1 << 24) -> str | None:
        """One line when the run would read the data more than once: the source has N tokens, a step
        reads ``tokens_per_step`` (all ranks), so it repeats every K steps. None when the source is
        larger than the run (or than ``scan_limit`` tokens, which is not read further)."""
        n = self.epoch_tokens(min(scan_limit, tokens_per_step * steps))
        if n is None or n >= tokens_per_step * steps:
            return None
        every = n // tokens_per_step
        repeats = (f"it repeats every {every} step{'s' if every > 1 else ''}" if every >= 1 else
                   "every step reads it more than once")
        return (f"dataset {self.source.name!r} has {n:,} tokens and a step reads {tokens_per_step:,} (all ranks), so "
                f"{repeats} over the run's {steps} steps: the model will memorize it; use more data or fewer steps")

    # -- state ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The position in the stream and the layout it belongs to, as plain ints and strings."""
        return {
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "doc_index": self._doc_index,
            "token_offset": self._token_offset,
            "window_index": self._window_index,
            "tokens_seen_this_epoch": self._tokens_seen_this_epoch,
            "dp_rank": self.dp_rank,
            "dp_world_size": self.dp_world_size,
            "seq_len": self.seq_len,
            "dataset": self.source.name,
            "tokenizer": self.tokenizer.name,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict`), with exactly the next sample.

        Raises:
            ValueError: the state belongs to another data-parallel layout, sequence length, dataset
                or tokenizer (resuming would silently change the data), or is malformed.
        """
        if not isinstance(state, dict):
            raise TypeError(f"state: expected a dict from DataLoader.state_dict(), got {type(state).__name__}")
        missing = [k for k in self.state_dict() if k not in state]
        if missing:
            raise ValueError(f"state: not a DataLoader state (missing {', '.join(missing)})")
        if state["version"] != STATE_VERSION:
            raise ValueError(f"state: version {state['version']!r} is not supported (expected {STATE_VERSION})")
        for key, mine in (("dp_world_size", self.dp_world_size), ("dp_rank", self.dp_rank),
                          ("seq_len", self.seq_len), ("dataset", self.source.name), ("tokenizer", self.tokenizer.name)):
            if state[key] != mine:
                raise ValueError(
                    f"state: the checkpoint's data loader has {key}={state[key]!r} but this run has {key}={mine!r}; "
                    f"resuming would change which samples come next. Resume with the same data-parallel layout, "
                    f"seq_len, dataset and tokenizer, or start a fresh run"
                )
        for key in ("epoch", "doc_index", "token_offset", "window_index", "tokens_seen_this_epoch"):
            if isinstance(state[key], bool) or not isinstance(state[key], int) or state[key] < 0:
                raise ValueError(f"state: {key} must be an integer >= 0, got {state[key]!r}")
        self._epoch = state["epoch"]
        self._doc_index = state["doc_index"]
        self._token_offset = state["token_offset"]
        self._window_index = state["window_index"]
        self._tokens_seen_this_epoch = state["tokens_seen_this_epoch"]
        self._doc = None  # re-read (from the cache or the source) on next use


def build_dataloader(config, tokenizer: Tokenizer, dp_rank: int, dp_world_size: int) -> DataLoader:
    """The loader for ``config.training`` (dataset or dataset_path, seq_len, local_batch_size).

    With validation on and no validation dataset of its own, the training source is the
    training part of :func:`trainer.data.splits.split_source` (the held-out documents are never
    trained on).

    Args:
        config: a ``trainer.config.JobConfig``.
        tokenizer: from :func:`trainer.data.tokenizer.build_tokenizer`.
        dp_rank / dp_world_size: this rank's data-parallel index and the data-parallel degree
            (replicate x shard).

    Raises:
        ValueError / RuntimeError: from :func:`trainer.data.datasets.build_source`.
    """
    t = config.training
    source = build_source(t.dataset, t.dataset_path)
    if held_out_split(config):
        source = split_source(source, config.validation.split_every, "train")
    return DataLoader(source, tokenizer, t.seq_len, t.local_batch_size, dp_rank, dp_world_size)


def build_validation_loader(config, tokenizer, dp_rank: int, dp_world_size: int):
    """The one-pass validation loader for ``config.validation`` (its dataset, or the training source's
    held-out part), on this data-parallel rank.

    Raises ValueError / RuntimeError as :func:`trainer.data.datasets.build_source` (messages name the
    ``validation.*`` or ``training.*`` key whose source failed).
    """
    v, t = config.validation, config.training
    if held_out_split(config):
        source = split_source(build_source(t.dataset, t.dataset_path), v.split_every, "validation")
    else:
        source = build_source(v.dataset, v.dataset_path, section="validation")
        same_path = bool(v.dataset_path and t.dataset_path) and \
            Path(v.dataset_path).expanduser().resolve() == Path(t.dataset_path).expanduser().resolve()
        if same_path or (not v.dataset_path and not t.dataset_path and v.dataset == t.dataset):
            logger.warning("validation: the validation dataset is the training dataset; the validation loss is "
                           "measured on text the model trains on (leave validation.dataset empty for a held-out part)")
    seq_len = t.seq_len if v.seq_len == -1 else v.seq_len
    batch = t.local_batch_size if v.local_batch_size == -1 else v.local_batch_size
    return DataLoader(source, tokenizer, seq_len, batch, dp_rank, dp_world_size, one_epoch=True)
