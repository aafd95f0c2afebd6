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
  overlap    FSDP2 copies each unit's shard host-to-device from pinned memory with ``non_blocking``
             when it all-gathers, so the next step's copies overlap the compute of the blocks
             before them; the optimizer step itself runs between the steps (the next forward needs
             its result)
  cost       ``trainer.estimate`` / ``trainer.estimate_offload``: host bytes, PCIe bytes and seconds
"""
from __future__ import annotations

import logging

import torch
from torch import nn

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
