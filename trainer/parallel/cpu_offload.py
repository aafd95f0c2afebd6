"""FSDP2 CPU offload (``--training.enable_cpu_offload``, torchtitan's key and meaning): the run's side
of it beside ``trainer.parallel.fsdp`` (which puts ``CPUOffloadPolicy`` on every unit).

  memory     sharded fp32 parameters, their gradients and the optimizer states in host memory (pinned
             on GPUs); the device holds the gathered blocks and the activations only
  init       the model is materialized and initialised on the CPU (``materialize``): its sharded
             parameters never exist on the device; buffers (the rotary table) go to the device
  optimizer  its step runs where the states are, on the CPU: titan's ``fused_adamw_`` (at::vec kernel,
             float32 or bfloat16 states with stochastic rounding) and Muon's Newton-Schulz in float32
             for Muon groups (``trainer.optim.build``); the gradient clip's norm is reduced over
             the process group's CPU backend (gloo beside NCCL, ``trainer.environment``)
  overlap    the AdamW step runs in a background thread one FSDP unit at a time, in the order the next
             forward needs them (root, then block 0, 1, ...), with the gradients and learning rate of
             its own step (``TitanOptimizer.deferred_adamw``); each unit's forward waits for its own
             update only (a forward pre-hook ahead of FSDP2's), so the update of the later blocks
             overlaps the forward, and FSDP2's host-to-device copies of the earlier ones (pinned,
             ``non_blocking``). A state_dict (checkpoints), ``TitanOptimizer.synchronize`` and the
             end of the run wait for it. Muon groups and QK-clip need collectives over the whole
             step: with them the step runs whole, before the next forward; so it does under pipeline
             parallel, whose schedule gathers a stage's units itself before their forward hooks run
             (measured: the overlapped step there trained on stale shards)
  cost       ``trainer.estimate.memory`` / ``trainer.estimate.offload``: host bytes, PCIe bytes and seconds
"""
from __future__ import annotations

import functools
import logging
import threading

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

logger = logging.getLogger("trainer")


def materialize(stage: nn.Module, device: torch.device, seed: int, cpu_offload: bool) -> None:
    """Allocate ``stage`` (a meta-device, parallelized module) and initialise its weights from ``seed``:
    on ``device``, or with ``cpu_offload`` on the CPU with its buffers then moved to ``device``."""
    if not cpu_offload:
        stage.to_empty(device=device)
        stage.init_weights(seed)
        return
    stage.to_empty(device="cpu")
    stage.init_weights(seed)
    local = [p.to_local() if hasattr(p, "to_local") else p for p in stage.parameters()]
    logger.info("CPU offload: %.1f MiB of sharded parameters (their gradients and optimizer states alike) in host "
                "memory on %s; the optimizer steps on the CPU", sum(t.numel() * t.element_size() for t in local) / 2**20,
                ", ".join(sorted({str(t.device) for t in local})))
    if device.type != "cpu":
        for module in stage.modules():
            for name, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[name] = buf.to(device)


class OverlappedStep:
    """The overlapped CPU optimizer step of a CPU-offloaded model (module docstring).

    Installed on ``optimizer`` (a TitanOptimizer): its ``step()`` launches the update in a thread and
    returns; ``synchronize()`` waits for it (and raises what it raised). ``units``: the FSDP2 modules
    in forward order, each updating the parameters it owns (not those of the units inside it).
    """

    def __init__(self, model: nn.Module, optimizer) -> None:
        self.optimizer = optimizer
        self.units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        owner: dict[int, int] = {}
        for i in reversed(range(len(self.units))):  # a parameter belongs to its innermost unit
            for prm in self.units[i].parameters():
                owner.setdefault(id(prm), i)
        self.unit_params: list[set[int]] = [set() for _ in self.units]
        for pid, i in owner.items():
            self.unit_params[i].add(pid)
        self.done = [threading.Event() for _ in self.units]
        for e in self.done:
            e.set()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        for i, unit in enumerate(self.units):  # ahead of FSDP2's own pre-forward (its all-gather)
            unit.register_forward_pre_hook(functools.partial(self._before_forward, i), prepend=True)
        model.register_state_dict_pre_hook(lambda *_args, **_kw: self.synchronize())
        optimizer._overlap = self

    def launch(self) -> bool:
        """Start this step's update in the background; False when it must run whole (Muon, QK-clip)."""
        self.synchronize()
        run = self.optimizer.deferred_adamw()
        if run is None:
            return False
        for e in self.done:
            e.clear()

        def work() -> None:
            try:
                for i, ids in enumerate(self.unit_params):
                    run(ids)
                    self.done[i].set()
            except BaseException as exc:  # noqa: BLE001  (raised again in the training thread)
                self._error = exc
            finally:
                for e in self.done:
                    e.set()

        self._thread = threading.Thread(target=work, name="cpu-offload-optimizer-step", daemon=True)
        self._thread.start()
        return True

    def _before_forward(self, i: int, *_args) -> None:
        self.done[i].wait()
        self._raise()

    def synchronize(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            exc, self._error = self._error, None
            raise exc
