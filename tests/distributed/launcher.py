"""Run a test function on N CPU processes joined by a gloo process group.

Usage: ``run_distributed(fn, world_size, *args)``; ``fn(rank, world_size, *args)`` runs in each
process after ``init_process_group("gloo")``. A failure on any rank fails the test with that rank's
traceback. Processes are spawned (not forked) so each starts clean.
"""
from __future__ import annotations

import os
import socket
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn, args, errors) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), TRITON_INTERPRET="1")
    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        # Every rank finishes its checks before any tears down: a rank leaving early makes gloo's
        # background threads abort the others ("terminate called without an active exception").
        dist.barrier()
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    else:
        errors.put((rank, None))
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 300.0) -> None:
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, errors)) for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    msgs, passed = [], set()
    while not errors.empty():
        rank, tb = errors.get()
        if tb is None:
            passed.add(rank)
        else:
            msgs.append(f"rank {rank}:\n{tb}")
    if msgs:
        raise AssertionError("distributed test failed\n" + "\n".join(msgs))
    if alive:
        raise AssertionError(f"distributed test timed out after {timeout}s on ranks {[procs.index(p) for p in alive]}")
    # A rank that passed every check and the final barrier may still be killed by gloo's teardown;
    # that is not what these tests check. Any other non-zero exit is a failure.
    bad = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode != 0 and i not in passed]
    if bad:
        raise AssertionError(f"ranks exited with non-zero codes: {bad}")
