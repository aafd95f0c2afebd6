"""Replica groups that survive one another, on torchft (``--fault_tolerance.enable``; torchtitan's keys).

The job is ``group_size`` replica groups, each a torchrun of its own (FSDP/TP inside it as
configured) with ``--fault_tolerance.replica_id``, all joined through a torchft Lighthouse whose
address is in ``TORCHFT_LIGHTHOUSE`` (``torchft_lighthouse --min_replicas 1``, or
``torchft._torchft.LighthouseServer``). Each group writes into ``<dump_folder>/replica_<id>/``.

Every step (:meth:`ReplicaGroups.run_step`):

1. the group's torchft ``Manager`` joins the Lighthouse quorum, synchronously. A group that is
   behind (a restarted one) first receives the live state from a peer (model, optimizer, LR
   schedule, data position, step: :meth:`_state_dict`) and continues from there;
2. the step's global batch (``training.global_batch_size`` sequences; -1 = all groups' local
   batches) is split over the participating groups: group ``i`` of ``n`` reads every n-th window of
   the step (the loader's data-parallel rank and size are set for the step: every loader has read
   the whole stream to the same position at a step boundary), with ``global / (n x local batch x
   data-parallel size)`` micro-batches. So the tokens of a step, and the gradient of their mean
   loss, do not depend on how many groups are alive;
3. forward and backward inside the group; then the gradients (each rank's local shard) and the
   loss are averaged over the participating groups by ``Manager.allreduce`` (equal token counts
   per group make the average the global token mean);
4. ``Manager.should_commit``: every group commits the step, or none. A group that died during the
   step makes it fail: the survivors put the data position back and run the same step again with
   the new quorum, so no sample is lost or repeated and the optimizer never sees a partial step.

A dead group is dropped from the quorum (after the Lighthouse's heartbeat timeout) while the others
keep training; ``--fault_tolerance.min_replica_size`` groups are needed to commit.
"""
from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from trainer.errors import TrainingError

logger = logging.getLogger("trainer")


def _local(obj: Any) -> Any:
    """``obj`` with every DTensor replaced by its local shard (what one rank sends to its peer rank)."""
    if isinstance(obj, DTensor):
        return obj.to_local()
    if isinstance(obj, dict):
        return {k: _local(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_local(v) for v in obj]
    return obj


def _like(template: Any, obj: Any) -> Any:
    """``obj`` (local shards) rebuilt as DTensors wherever ``template`` (a parameter, or a state of
    its shape) is one: the peer rank of the other group holds the same shard."""
    if isinstance(template, DTensor) and isinstance(obj, torch.Tensor):
        return DTensor.from_local(obj.to(template.device), template.device_mesh, template.placements,
                                  shape=template.shape, stride=template.stride())
    if isinstance(obj, dict):
        return {k: _like(template.get(k) if isinstance(template, dict) else template, v) for k, v in obj.items()}
    return obj


class ReplicaGroups:
    """This replica group's torchft Manager and the per-step protocol (module docstring).

    Args:
        trainer: a ``trainer.train.Trainer`` after its checkpointer (and resume) is set up.

    Raises:
        TrainingError: torchft is missing, TORCHFT_LIGHTHOUSE is unset, or the global batch cannot
            be split over every possible number of groups.
    """

    def __init__(self, trainer) -> None:
        try:
            import torchft
        except ImportError as exc:
            raise TrainingError(f"--fault_tolerance.enable: needs the torchft package ({exc}); "
                                f"pip install -e '.[ft]'") from None
        cfg, t = trainer.config.fault_tolerance, trainer.config.training
        lighthouse = os.environ.get("TORCHFT_LIGHTHOUSE")
        if not lighthouse:
            raise TrainingError("--fault_tolerance.enable: set TORCHFT_LIGHTHOUSE to the Lighthouse's address "
                                "(e.g. http://HOST:29510, started with torchft_lighthouse --min_replicas 1)")
        self.trainer = trainer
        self.dp_local, self.dp_rank_local = trainer.dims.dp_size, trainer.dp_rank
        per_group = t.local_batch_size * self.dp_local
        self.global_batch = t.global_batch_size if t.global_batch_size != -1 else per_group * cfg.group_size
        for n in range(cfg.min_replica_size, cfg.group_size + 1):
            if self.global_batch % (per_group * n):
                raise TrainingError(
                    f"--training.global_batch_size: {self.global_batch} sequences cannot be split over {n} replica "
                    f"groups of local_batch_size x data-parallel size = {per_group}; choose a multiple of "
                    f"{per_group} x every group count from min_replica_size {cfg.min_replica_size} to group_size "
                    f"{cfg.group_size}")
        if not os.environ.get("MASTER_ADDR"):  # one process without torchrun: the Manager needs a store
            self._store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self._store.port))
        timeout = timedelta(milliseconds=cfg.process_group_timeout_ms)
        pg = (torchft.ProcessGroupGloo(timeout=timeout) if cfg.process_group == "gloo"
              else torchft.ProcessGroupNCCL(timeout=timeout))
        self.manager = torchft.Manager(
            pg=pg, load_state_dict=self._load_state_dict, state_dict=self._state_dict,
            min_replica_size=cfg.min_replica_size, use_async_quorum=False, replica_id=f"titan_ft_{cfg.replica_id}",
            rank=trainer.rank, world_size=trainer.world_size, lighthouse_addr=lighthouse, hostname=socket.gethostname(),
            timeout=timeout, quorum_timeout=timedelta(seconds=trainer.config.comm.init_timeout_seconds),
            connect_timeout=timedelta(seconds=60))
        self.manager.load_state_dict({"step": trainer.step, "batches_committed": 0})  # after a resume
        self.participants = 1
        logger.info("fault tolerance: replica group %d of %d (at least %d commit a step), Lighthouse %s",
                    cfg.replica_id, cfg.group_size, cfg.min_replica_size, lighthouse)

    # -- the live state a recovering group receives from a peer --------------------------------------

    def _state_dict(self) -> dict[str, Any]:
        tr = self.trainer
        # Before the first update there are no moments to send; get_optimizer_state_dict would create
        # them with a zero-gradient step, which advances Adam's step count and changes every later update.
        optim = _local(get_optimizer_state_dict(tr.model, tr.optimizer)) if tr.optimizer.state else None
        return {"model": _local(get_model_state_dict(tr.model)), "optimizer": optim,
                "lr_scheduler": tr.scheduler.state_dict(), "dataloader": tr.loader.state_dict(),
                "step": tr.step, "tokens_seen": tr.tokens_seen}

    def _load_state_dict(self, sd: dict[str, Any]) -> None:
        tr = self.trainer
        params = dict(tr.model.named_parameters())
        set_model_state_dict(tr.model, _like(get_model_state_dict(tr.model), sd["model"]))
        optim = sd["optimizer"]
        if optim is not None:  # moments shaped like their parameter take its sharding
            optim["state"] = {k: {n: _like(params.get(k), v) if getattr(v, "dim", lambda: 0)() else v
                                  for n, v in st.items()} for k, st in optim["state"].items()}
            set_optimizer_state_dict(tr.model, tr.optimizer, optim)
        tr.scheduler.load_state_dict(sd["lr_scheduler"])
        tr.loader.load_state_dict({**sd["dataloader"], "dp_rank": tr.loader.dp_rank,
                                   "dp_world_size": tr.loader.dp_world_size})
        tr.step, tr.tokens_seen = int(sd["step"]), int(sd["tokens_seen"])
        logger.warning("fault tolerance: recovered the live state of step %d from a peer replica group", tr.step)

    # -- one step --------------------------------------------------------------------------------------

    def _layout(self, rank: int, world: int) -> None:
        loader = self.trainer.loader
        loader.dp_rank, loader.dp_world_size = rank, world

    def run_step(self, trainer, forward_backward: Callable[[], tuple[torch.Tensor, float]]):
        """Run the next step until the quorum commits it; returns ``(step, loss, data_wait)`` with the
        gradients averaged over the participating groups (the caller clips and updates)."""
        t = trainer.config.training
        while True:
            self.manager.start_quorum()  # blocks for the quorum; a group behind receives the live state here
            n, r = self.manager.num_participants(), self.manager.participating_rank()
            if r is None:
                raise TrainingError("fault tolerance: this replica group is not participating (a spare); not supported")
            self.participants = n
            start = trainer.loader.state_dict()
            self._layout(r * self.dp_local + self.dp_rank_local, n * self.dp_local)
            trainer.grad_accum = self.global_batch // (t.local_batch_size * self.dp_local * n)
            step = trainer.step + 1
            try:
                loss, data_wait = forward_backward()
                trainer.loader.advance_to(start["window_index"] + self.global_batch)  # the step's end, for all
                works = [self.manager.allreduce(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
                         for p in trainer._params if p.grad is not None]
                loss = loss.detach().clone()
                works.append(self.manager.allreduce(loss))
                for w in works:
                    w.wait()
            finally:
                self._layout(self.dp_rank_local, self.dp_local)
            if self.manager.should_commit():
                return step, loss, data_wait
            logger.warning("fault tolerance: step %d was not committed (a replica group failed); running it again "
                           "with the new quorum", step)
            trainer.optimizer.zero_grad(set_to_none=True)
            trainer.loader.load_state_dict(start)

    def close(self) -> None:
        self.manager.shutdown(wait=False)
