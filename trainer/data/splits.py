"""A held-out validation split of a document source, without a second data set.

Every ``every``-th document of the source (indices ``every - 1``, ``2 * every - 1``, ...) belongs to
the validation part, every other document to the training part. The split is by document index,
so it needs neither the size of the source nor a pass over it (a streamed Hugging Face data set
works too), and the two parts never share a document: with validation on, the training loader
reads only the training part, so the validation loss is measured on text the model never saw.
"""
from __future__ import annotations

from typing import Iterator

from trainer.data.datasets import DocumentSource

PARTS = ("train", "validation")


class SplitSource(DocumentSource):
    """The ``part`` ("train" or "validation") of ``source`` when 1 document in ``every`` is held out.

    Raises ValueError for ``every < 2`` or an unknown part.
    """

    def __init__(self, source: DocumentSource, every: int, part: str) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 2:
            raise ValueError(f"validation.split_every: expected an integer >= 2, got {every!r}")
        if part not in PARTS:
            raise ValueError(f"part: expected one of {', '.join(PARTS)}, got {part!r}")
        self.source, self.every, self.part = source, every, part
        # The name goes into the loader state: a resume with another split is refused.
        self.name = f"{source.name} [{part} part, 1 in {every} documents held out]"

    def iter_from(self, start: int) -> Iterator[str]:
        k = self.every
        if self.part == "validation":
            first = start * k + k - 1
            for i, doc in enumerate(self.source.iter_from(first), first):
                if i % k == k - 1:
                    yield doc
        else:
            # Training document j is source document j + j // (k - 1) (k - 1 of every k are kept).
            first = start + start // (k - 1)
            for i, doc in enumerate(self.source.iter_from(first), first):
                if i % k != k - 1:
                    yield doc


def held_out_split(config) -> bool:
    """Whether validation reads a held-out part of the training source (no dataset of its own)."""
    v = config.validation
    return v.enable and not (v.dataset or v.dataset_path)


def split_source(source: DocumentSource, every: int, part: str) -> SplitSource:
    """:class:`SplitSource` of ``source``."""
    return SplitSource(source, every, part)
