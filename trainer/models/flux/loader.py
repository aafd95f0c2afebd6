"""The Flux loader: captioned images -> batches of pixels and caption token ids, for one
data-parallel rank, resumable.

Order. Samples are numbered over all ranks (``sample`` g = 0, 1, 2, ...) and dealt round-robin:
rank r takes g = r, r + dp, r + 2 dp, ... (as the text loader deals windows), so the union of a
step's batches over the ranks is the same for every layout. Sample g is item ``perm_e[g mod N]`` of
the source (N items, e = g div N its epoch, ``perm_e`` a permutation seeded by (seed, e); no shuffle
for validation). Caption dropout (classifier-free guidance) replaces the caption of sample g by ""
with probability p, from a generator seeded by (seed, g): the same samples drop in every layout.

Batches: ``images`` (b, 3, S, S) float32 in [-1, 1], ``t5_ids`` / ``clip_ids`` int64, ``sample``
(b,) int64 (the global sample numbers: the task seeds each sample's noise and timestep from them)
and ``item`` (b,) int64 (the source index: the encode cache's image key). The state is
``window_index`` (the next sample number of this rank) with the layout and the dataset, the text
loader's format, so ``trainer.data.reshard`` reshards it.
"""
from __future__ import annotations

from typing import Any

import torch

from trainer.models.flux.sources import preprocess

STATE_VERSION = 1


def _seed(*parts: int) -> int:
    out = 0
    for p in parts:
        out = (out * 1_000_003 + int(p)) % (2**63)
    return out


class FluxLoader:
    """Batches of ``local_batch_size`` samples of ``source`` for rank ``dp_rank`` of ``dp_world_size``
    (module docstring). ``tokenize(captions) -> (t5_ids, clip_ids)``. ``one_epoch`` (validation):
    ``rewind`` restarts at sample 0, no shuffle, no caption dropout. Raises ValueError for bad sizes."""

    def __init__(self, source, tokenize, img_size: int, local_batch_size: int, dp_rank: int = 0,
                 dp_world_size: int = 1, seed: int = 0, caption_dropout: float = 0.0, one_epoch: bool = False,
                 units_per_sample: int = 1) -> None:
        if local_batch_size < 1:
            raise ValueError(f"training.local_batch_size: expected an integer >= 1, got {local_batch_size}")
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank: expected 0..{dp_world_size - 1}, got {dp_rank}")
        self.source, self.tokenize, self.img_size = source, tokenize, img_size
        self.local_batch_size, self.dp_rank, self.dp_world_size = local_batch_size, dp_rank, dp_world_size
        self.seed, self.caption_dropout, self.one_epoch = seed, caption_dropout, one_epoch
        self.units_per_sample = units_per_sample  # what the run's repeat check counts per sample (seq_len + 1)
        self._next = dp_rank  # the next global sample number of this rank
        self._perm: tuple[int, torch.Tensor] | None = None

    def _item_of(self, g: int) -> int:
        n = len(self.source)
        epoch, i = divmod(g, n)
        if self.one_epoch:
            return i
        if self._perm is None or self._perm[0] != epoch:
            gen = torch.Generator().manual_seed(_seed(self.seed, epoch))
            self._perm = (epoch, torch.randperm(n, generator=gen))
        return int(self._perm[1][i])

    def _dropped(self, g: int) -> bool:
        if self.one_epoch or self.caption_dropout <= 0:
            return False
        gen = torch.Generator().manual_seed(_seed(self.seed, 7919, g))
        return bool(torch.rand((), generator=gen) < self.caption_dropout)

    def __iter__(self) -> "FluxLoader":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        samples = [self._next + k * self.dp_world_size for k in range(self.local_batch_size)]
        self._next += self.local_batch_size * self.dp_world_size
        items = [self._item_of(g) for g in samples]
        images, captions = [], []
        for g, i in zip(samples, items):
            img, cap = self.source.item(i)
            images.append(preprocess(img, self.img_size))
            captions.append("" if self._dropped(g) else cap)
        t5_ids, clip_ids = self.tokenize(captions)
        return {"images": torch.stack(images), "t5_ids": t5_ids, "clip_ids": clip_ids,
                "sample": torch.tensor(samples, dtype=torch.int64), "item": torch.tensor(items, dtype=torch.int64)}

    def captions(self, n: int) -> list[str]:
        """The first ``n`` captions of the source in loader order (validation's sample prompts)."""
        return [self.source.item(self._item_of(g))[1] for g in range(min(n, len(self.source)))]

    def rewind(self) -> None:
        self._next = self.dp_rank

    def check(self) -> None:
        """Read the first item (a bad source fails at setup, in one line)."""
        img, _ = self.source.item(self._item_of(self.dp_rank))
        preprocess(img, self.img_size)

    def repeat_warning(self, units_per_step: int, steps: int, scan_limit: int = 0) -> str | None:
        samples = units_per_step // max(1, self.units_per_sample) * steps
        n = len(self.source)
        if samples > n:
            return (f"the run reads {samples} samples from {self.source.name}: {samples / n:.1f} epochs, each image "
                    f"seen that many times (with new noise and timesteps)")
        return None

    def state_dict(self) -> dict[str, Any]:
        """``consumed``: every sample below it was read (the same on every rank at a step boundary);
        ``window_index``: this rank's next sample (what ``trainer.data.reshard`` checks)."""
        return {"version": STATE_VERSION, "window_index": self._next, "consumed": self._next - self.dp_rank,
                "dp_rank": self.dp_rank, "dp_world_size": self.dp_world_size, "dataset": self.source.name,
                "img_size": self.img_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue with exactly the next sample, in this layout or (resharded) another. Raises
        ValueError for another dataset or resolution, or a malformed state."""
        for key, mine in (("dataset", self.source.name), ("img_size", self.img_size)):
            if state.get(key) != mine:
                raise ValueError(f"state: the checkpoint's data loader has {key}={state.get(key)!r} but this run has "
                                 f"{key}={mine!r}; resume with the same data or start a fresh run")
        consumed = state.get("consumed")
        if isinstance(consumed, bool) or not isinstance(consumed, int) or consumed < 0:
            raise ValueError(f"state: consumed must be an integer >= 0, got {consumed!r}")
        self._next = consumed + self.dp_rank
