"""DTensor sharding rules for the titan ops.

Each rule tells DTensor which input placements let the op run on local shards with no
communication, and the placements of its outputs, for one mesh dimension (DTensor expands them to
the whole mesh). A placement not listed (e.g. a sharded hidden dim for rms_norm) makes DTensor
redistribute the inputs to a listed one, never compute a wrong answer.

Rules are registered on import of ``titan_kernels`` (when torch.distributed is available).
"""
from __future__ import annotations
