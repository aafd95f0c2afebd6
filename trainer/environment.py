"""The process a run lives in: the OpenMP wait policy (set before torch loads), logging and Python
warnings per rank, the default process group and the compute dtype.

``trainer.train`` imports this module before torch, so the OpenMP setting below takes effect for
``python -m trainer``.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from datetime import timedelta


def _cpu_is_busy() -> bool:
    """Whether other processes already keep every core busy (1-minute load average >= cores)."""
    try:
        return os.getloadavg()[0] >= (os.cpu_count() or 1)
    except OSError:  # no load average on this platform
        return False


# Set before torch loads OpenMP (``python -m trainer`` imports torch here first). On a CPU that other
# processes keep busy, idle OpenMP threads must sleep (PASSIVE): spinning ones take the cores the
# working threads need, and the debug model ran 1.1-3x faster with it under load. On an idle CPU
# spinning wins: 4,100-4,400 tokens/s with the default or ACTIVE policy against 3,640 with PASSIVE
# (debug model, 2 idle cores, 2026-12-01). So PASSIVE only when the machine is busy at start-up;
# a value set by the user wins.
if "OMP_WAIT_POLICY" not in os.environ and _cpu_is_busy():
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from trainer.config import ConfigError, JobConfig  # noqa: E402

logger = logging.getLogger("trainer")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def setup_logging(rank: int) -> None:
    """The ``trainer`` logger prints ``[trainer] HH:MM:SS message`` on stdout: info on rank 0, errors only elsewhere."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("[trainer] %(asctime)s %(message)s", datefmt="%H:%M:%S"))
    logger.handlers[:] = [handler]
    # Every rank would print the same warnings: rank 0 prints them, the others only errors.
    logger.setLevel(logging.INFO if rank == 0 else logging.ERROR)
    logger.propagate = False


@contextlib.contextmanager
def rank_zero_warnings(rank: int):
    """Python warnings (torch's and ours) print once, from rank 0, not once per rank under torchrun."""
    with warnings.catch_warnings():
        if rank != 0:
            warnings.simplefilter("ignore")
        yield


def resolve_compute_dtype(config: JobConfig, device: torch.device) -> torch.dtype:
    """The dtype the model computes in: ``training.dtype``; auto = float32 on the CPU, else
    ``training.mixed_precision_param``."""
    dtype = config.training.dtype
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else DTYPES[config.training.mixed_precision_param]
    return DTYPES[dtype]


def init_distributed(world_size: int, rank: int, device: torch.device, single_process_group: bool,
                     timeout_seconds: int = 1800) -> bool:
    """Start the default process group: gloo on the CPU, NCCL for CUDA tensors (and gloo for CPU ones).

    Args:
        world_size, rank: this process's place (from torchrun).
        device: the training device.
        single_process_group: one process still needs a group (FSDP2 on a one-process mesh).
        timeout_seconds: the collectives' timeout (``--comm.init_timeout_seconds``; the trainer sets
            ``train_timeout_seconds`` after the first step, ``trainer.run.watchdog``).

    Returns whether it started one: False for one process without ``single_process_group``, or when a
    group exists already.
    """
    if world_size == 1 and not single_process_group:
        return False
    if dist.is_initialized():
        return False
    # torch.distributed.nn.functional binds ``group=group.WORLD`` as default arguments when it is first
    # imported (torch._dynamo imports it). Imported after the group starts, it keeps the group alive past
    # destroy_process_group, and gloo's worker threads then free a last collective's tensors while the
    # interpreter shuts down: "terminate called without an active exception" (one exit in ten of a
    # two-rank generation under load). Imported first, its defaults are None.
    import torch.distributed.nn.functional  # noqa: F401
    # NCCL for GPU tensors, gloo for CPU ones (async checkpointing needs a CPU backend too).
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_seconds)
    if world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    elif os.environ.get("TORCHELASTIC_RESTART_COUNT") and os.environ.get("MASTER_ADDR"):
        # A group restarted by torchrun (--max-restarts) meets on the same store as the attempt before
        # (torch 2.13 keeps the agent's store and adds no prefix): without one of our own, a rank can
        # read a dead rank's address of the previous attempt and fail to connect.
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                              timeout=timeout)
        store = dist.PrefixStore(f"trainer/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    else:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    return True


def destroy_distributed(*meshes) -> None:
    """Destroy every process group, so that gloo's worker threads stop before the interpreter does.

    Args:
        meshes: the run's device meshes (None allowed). torch caches meshes (DTensor sharding and
            redistribution caches) and a mesh keeps its groups in ``_pg_registry``: a cached mesh would
            keep a destroyed group, and its threads, alive to interpreter shutdown, where freeing a last
            collective's tensors aborts the process. Each mesh given is unusable afterwards.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for mesh in meshes:
        registry = getattr(mesh, "_pg_registry", None)
        if isinstance(registry, dict):
            registry.clear()


def check_backend_environment() -> None:
    """A bad TITAN_KERNELS_BACKEND is a ConfigError before the run, not a traceback at the first op."""
    import titan_kernels  # (registers every op's implementations: their names are valid)

    try:
        titan_kernels.requested_backend()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def env_int(name: str, default: int) -> int:
    """The integer environment variable ``name`` (set by torchrun), ``default`` when unset."""
    raw = os.environ.get(name, "")
    try:
        return int(raw) if raw else default
    except ValueError:
        raise _training_error(f"environment variable {name}: expected an integer, got {raw!r}") from None


def _training_error(message: str) -> Exception:
    from trainer.errors import TrainingError

    return TrainingError(message)
