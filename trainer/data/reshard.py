"""Resharding the data loader's position to another data-parallel degree, exactly or not at all.

Used when a checkpoint is resumed with another number of data-parallel ranks (an elastic restart:
4 -> 2 -> 3 ranks); ``trainer.checkpoint.checkpointer`` calls it with the states of all ranks of the checkpoint.
"""
from __future__ import annotations

from typing import Any


def reshard_loader_state(states: list[dict[str, Any]], dp_rank: int, dp_world_size: int) -> dict[str, Any]:
    """The loader state for data-parallel rank ``dp_rank`` of ``dp_world_size`` from the states of all
    ranks of a checkpoint (``trainer.data.loader.DataLoader.state_dict``), whatever their layout.

    The same layout gets its own state back. Otherwise: the loader deals the windows of one stream
    round-robin over the ranks, and at a step boundary rank r of D has consumed exactly the windows
    below ``W - (D - 1 - r)``, W being the largest ``window_index``; so the windows below W were all
    trained on and the stream position after window W - 1 (the state of the last rank) is where
    every rank of the new layout continues, dealing from window W on. Resumed so, the union of the
    next step's batches over the new ranks is exactly what the old layout would have read next.

    Raises ValueError when the states are not from one step of one layout (then no position is
    exact, and nothing is silently reset). Whether dataset, tokenizer and seq_len match is the
    loader's own check (``load_state_dict``).
    """
    if not states:
        raise ValueError("the checkpoint holds no data loader state")
    old_world = states[0].get("dp_world_size")
    by_rank = {s.get("dp_rank"): s for s in states}
    if old_world == dp_world_size and dp_rank in by_rank:
        return by_rank[dp_rank]
    if sorted(by_rank) != list(range(len(states))) or len(states) != old_world or any(
            s.get("dp_world_size") != old_world for s in states):
        raise ValueError(
            f"data loader states of ranks {sorted(by_rank)} do not form one layout of dp_world_size={old_world}; "
            f"cannot reshard them to {dp_world_size} ranks"
        )
    last = by_rank[old_world - 1]
    end = last["window_index"]
    behind = [r for r, s in by_rank.items() if s["window_index"] != end - (old_world - 1 - r)]
    if behind:
        raise ValueError(
            f"data loader states of ranks {behind} are not at the same step as rank {old_world - 1}; cannot reshard "
            f"dp_world_size={old_world} -> {dp_world_size} without skipping or repeating samples"
        )
    return {**last, "dp_rank": dp_rank, "dp_world_size": dp_world_size}
