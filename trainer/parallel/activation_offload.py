"""Activation offload: what a block saves for its backward goes to pinned host memory during the
forward and comes back one block ahead during the backward (``--activation_checkpoint.mode offload``
or ``per_layer ...:offload``; ``trainer/config/activation_policy.py`` says when it pays).

Mechanism: the block's forward runs under ``torch.autograd.graph.saved_tensors_hooks``. The pack hook
copies each saved activation to a pinned host buffer on a side stream (``non_blocking``, after an
event on the compute stream; ``record_stream`` keeps the device block from reuse until the copy is
done) and hands autograd a handle instead of the tensor, so the device memory is freed when the
forward drops its own reference. In the backward the first unpack of a block brings the whole block
back on the side stream and at once starts the copy of the block before it (the next the backward
needs), so each copy overlaps the backward compute of the block after it; the compute stream waits
on the copy's event only when it uses the tensor.

Kept on the device (not worth or not safe to move): parameters and their views (FSDP2's gathered
weights are freed and re-gathered by FSDP2 itself), tensor subclasses (DTensor, float8), tensors
already on the host and tensors under ``OFFLOAD_MIN_BYTES``.

On a CPU device the hooks run all the same (a copy into fresh host memory and back, without
streams), so the CPU tests check that training with offload gives the losses without it.
One backward per forward: a handle is released when unpacked (``retain_graph`` is refused with a
RuntimeError naming the option).
"""
from __future__ import annotations

import functools

import torch
from torch import nn

# Saved tensors smaller than this stay on the device: per-row statistics (RMSNorm's rstd, the
# attention LSE of a short sequence) cost more in copy launches than they free.
OFFLOAD_MIN_BYTES = 2**14


def _storage_ptr(p: torch.Tensor) -> int:
    """The address of a parameter's storage; a DTensor's (tensor parallel without FSDP: its storage is
    not a real one and raised "invalid python storage") is its local shard's."""
    local = getattr(p, "_local_tensor", p)
    return local.untyped_storage().data_ptr()


class _Handle:
    __slots__ = ("host", "device_copy", "d2h", "h2d")

    def __init__(self, host: torch.Tensor, d2h) -> None:
        self.host, self.d2h, self.device_copy, self.h2d = host, d2h, None, None


class _Block:
    """One forward of one offloaded block: its handles, in the order they were saved."""

    def __init__(self, params: set[int]) -> None:
        self.params = params
        self.handles: list[_Handle] = []
        self.fetched = False


class ActivationOffloader:
    """Offloads the saved activations of the blocks it wraps (module docstring).

    Args:
        device: the training device (CUDA: a side stream and pinned buffers; CPU: plain copies).
        min_bytes: saved tensors below this stay on the device.
    """

    def __init__(self, device: torch.device, min_bytes: int = OFFLOAD_MIN_BYTES) -> None:
        self.device = torch.device(device)
        self.min_bytes = min_bytes
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._pending: list[_Block] = []  # forwards whose blocks the backward has not started yet
        self.bytes_offloaded = 0  # over the run, for tests and logs

    def wrap(self, block: nn.Module) -> None:
        """Run ``block.forward`` under the offload hooks (in place; names and state_dict unchanged)."""
        inner = block.forward

        @functools.wraps(inner)
        def forward(*args, **kw):
            if not torch.is_grad_enabled():  # validation: nothing is saved
                return inner(*args, **kw)
            # Under FSDP2 the block holds its gathered parameters now (its pre-forward hook ran).
            rec = _Block({_storage_ptr(p) for p in block.parameters()})
            self._pending = [b for b in self._pending if not b.fetched]
            self._pending.append(rec)
            with torch.autograd.graph.saved_tensors_hooks(functools.partial(self._pack, rec),
                                                          functools.partial(self._unpack, rec)):
                return inner(*args, **kw)

        block.forward = forward
        block._titan_ac = True

    # -- hooks -------------------------------------------------------------------------------------

    def _keep(self, rec: _Block, t: torch.Tensor) -> bool:
        if type(t) is not torch.Tensor:  # parameters, DTensors, float8 tensors
            return True
        if t.device != self.device or t.numel() * t.element_size() < self.min_bytes:
            return True
        return t.untyped_storage().data_ptr() in rec.params

    def _pack(self, rec: _Block, t: torch.Tensor):
        if self._keep(rec, t):
            return t
        if self.cuda:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                host.copy_(t, non_blocking=True)
                t.record_stream(self.stream)  # the block is not reused before the copy is done
                d2h = self.stream.record_event()
        else:
            host = torch.empty(t.shape, dtype=t.dtype)
            host.copy_(t)
            d2h = None
        self.bytes_offloaded += host.numel() * host.element_size()
        h = _Handle(host, d2h)
        rec.handles.append(h)
        return h

    def _unpack(self, rec: _Block, h):
        if not isinstance(h, _Handle):
            return h
        if not rec.fetched:  # the backward reached this block: bring it, and start the one before it
            self._fetch(rec)
            idx = next((i for i, b in enumerate(self._pending) if b is rec), len(self._pending))
            before = [b for b in self._pending[:idx] if not b.fetched]
            if before:
                self._fetch(before[-1])
        if h.device_copy is None:
            raise RuntimeError("activation_checkpoint.mode offload: a saved activation was used twice "
                               "(backward with retain_graph=True is not supported with activation offload)")
        out = h.device_copy
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(h.h2d)
            out.record_stream(torch.cuda.current_stream(self.device))
        h.device_copy = h.host = None
        return out

    def _fetch(self, rec: _Block) -> None:
        rec.fetched = True
        for h in rec.handles:
            if self.cuda:
                with torch.cuda.stream(self.stream):
                    self.stream.wait_event(h.d2h)
                    h.device_copy = h.host.to(self.device, non_blocking=True)
                    h.h2d = self.stream.record_event()
            else:
                h.device_copy = torch.empty(h.host.shape, dtype=h.host.dtype, device=self.device)
                h.device_copy.copy_(h.host)
