"""Memory overlap among an in-place op's tensors: ``check_no_overlap`` refuses, before any kernel
runs, a tensor that is written while another argument (or another element of itself) reads or
writes the same bytes.

An in-place multi-tensor kernel (``fused_adamw_``) reads each tensor and writes its result back in
one pass: with ``exp_avg is exp_avg_sq``, or a gradient that is a view of its own parameter, the
second write lands on memory the first already changed, and the result is silently wrong (and
differs between backends, which order their reads differently). torch's own in-place ops refuse
the same cases ("unsupported operation: some elements of the input tensor and the written-to
tensor refer to a single memory location").

How: tensors are grouped by storage; within one storage, each tensor's byte span [lowest, highest
element] is compared with the others' (sorted, so disjoint slices of one flat buffer, FSDP2's
layout, cost O(n log n)). Spans that intersect are checked exactly when either tensor is not
contiguous (interleaved views such as x[0::2] and x[1::2] share a span and no byte); two tensors
that are only read may share memory. Cost: one pass of Python over the tensors' metadata, no
device work except for intersecting non-contiguous spans (then their element offsets).
"""
from __future__ import annotations

import torch

_EXACT_LIMIT = 1 << 24  # elements: beyond this an intersecting non-contiguous pair is refused unchecked


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[lo, hi) in bytes of the storage that ``t``'s elements occupy (their smallest box)."""
    item = t.element_size()
    lo = hi = t.storage_offset()
    for size, stride in zip(t.shape, t.stride()):
        if stride < 0:
            lo += (size - 1) * stride
        else:
            hi += (size - 1) * stride
    return lo * item, (hi + 1) * item


def _offsets(t: torch.Tensor) -> torch.Tensor:
    """The byte offset of every element of ``t`` in its storage (int64, on the CPU)."""
    off = torch.tensor(t.storage_offset(), dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride()):
        off = (off.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride).reshape(-1)
    return off * t.element_size()


def _internal_overlap(t: torch.Tensor) -> bool:
    """True when two elements of ``t`` share an address (an expanded view: stride 0). Dims sorted by
    stride, each stride beyond the reach of the smaller ones proves there is none; else exactly."""
    if t.is_contiguous():
        return False
    reach = 0
    for size, stride in sorted(((s, abs(st)) for s, st in zip(t.shape, t.stride()) if s > 1), key=lambda x: x[1]):
        if stride <= reach:
            if t.numel() > _EXACT_LIMIT:
                return True  # not worth an exact answer: refused
            return _offsets(t).unique().numel() < t.numel()
        reach += (size - 1) * stride
    return False


def _share_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` (same storage, intersecting spans) have a byte in common."""
    if a.is_contiguous() and b.is_contiguous():
        return True  # each fills its span
    if a.element_size() != b.element_size() or max(a.numel(), b.numel()) > _EXACT_LIMIT:
        return True  # not worth an exact answer: refused as overlapping
    return bool(torch.isin(_offsets(a), _offsets(b)).any())


def _storage_key(t: torch.Tensor):
    return (t.device, t.untyped_storage().data_ptr())


def check_no_overlap(lists: dict[str, list[torch.Tensor]], read_only: tuple[str, ...] = ()) -> None:
    """Raise ValueError naming two arguments (e.g. ``exp_avgs[0] and exp_avg_sqs[0]``) when a tensor
    of a list not in ``read_only`` shares memory with any other tensor of ``lists`` (itself included:
    an expanded tensor, several elements on one address). Tensors of ``read_only`` lists may share
    memory with each other. Empty tensors hold no memory and never overlap."""
    names = [n for n in lists if n not in read_only]
    if not names:
        return
    for name in names:
        for i, t in enumerate(lists[name]):
            if not t.is_contiguous() and t.numel() and _internal_overlap(t):
                raise ValueError(f"{name}[{i}]: several of its elements share one memory location (an expanded "
                                 "or overlapping view); it is written in place: pass a tensor with memory of its own")
    # The common case, every written tensor on a storage of its own, costs one pointer per tensor
    # (read-only tensors may share one: e.g. gradients that are views of one reduce-scatter buffer).
    written = [t.untyped_storage().data_ptr() for n in names for t in lists[n]]
    read = {t.untyped_storage().data_ptr() for n in lists if n not in names for t in lists[n]}
    if len(set(written)) == len(written) and read.isdisjoint(written):
        return
    writes = f"{', '.join(names[:-1])} and {names[-1]} are" if len(names) > 1 else f"{names[0]} is"
    groups: dict[tuple, list] = {}
    for name, lst in lists.items():
        for i, t in enumerate(lst):
            if t.numel():
                groups.setdefault(_storage_key(t), []).append((*_span(t), f"{name}[{i}]", name in names, t))
    for entries in groups.values():
        if len(entries) < 2 or not any(e[3] for e in entries):
            continue
        entries.sort(key=lambda e: e[0])
        active: list = []
        for e in entries:
            active = [a for a in active if a[1] > e[0]]  # spans still open at e's start
            for a in active:
                if (a[3] or e[3]) and _share_bytes(a[4], e[4]):
                    same = a[4].data_ptr() == e[4].data_ptr() and a[4].shape == e[4].shape \
                        and a[4].stride() == e[4].stride()
                    raise ValueError(
                        f"{a[2]} and {e[2]}: {'the same tensor' if same else 'overlapping memory'}; "
                        f"{writes} written in place, so each needs memory of its own, apart from every "
                        "other argument")
            active.append(e)
