"""Does a run fit this machine? The devices found (:func:`detect_devices`) against the memory estimate
(``trainer.estimate.memory``); when it does not, the report of what would fit: on these devices with
activation offload or CPU offload where either makes it fit (with the host memory and PCIe time
they cost), and the planner's best layout at the smallest GPU count (``trainer.estimate.plan.smallest_fit``),
with its command. The trainer checks this
before it allocates anything large (:func:`fit_message`).

Torch is imported only to find the GPUs, so the check stays light.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from trainer.estimate.memory import GIB, Layout, MemoryEstimate, estimate_memory
from trainer.estimate.offload import PCIE_GEN5_X16, pcie_seconds, run_layer_modes
from trainer.estimate.step_time import GPUS
from trainer.models.common.args import ModelArgs, format_params
from trainer.estimate.plan import smallest_fit


@dataclass(frozen=True)
class Devices:
    """What this machine offers one training process."""

    kind: str  # "cuda" or "cpu"
    count: int
    memory_per_device: float  # bytes one process may use
    name: str
    host_per_process: float = float("inf")  # host memory one process may use (for offload)

    def describe(self) -> str:
        if self.kind == "cuda":
            return f"{self.count} x {self.name} ({self.memory_per_device / GIB:.0f} GiB each)"
        return f"no GPU; CPU ({self.name}) with {self.memory_per_device / GIB:.1f} GiB of memory available per process"


def detect_devices(processes_per_node: int | None = None) -> Devices:
    """The visible GPUs (their total memory), else the CPU (available RAM shared by this node's processes)."""
    import torch

    import psutil

    procs = processes_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    avail = psutil.virtual_memory().available / max(procs, 1)
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        props = torch.cuda.get_device_properties(0)
        return Devices("cuda", n, float(props.total_memory), props.name, float(avail))
    import platform

    return Devices("cpu", 1, float(avail), f"{_cpu_model() or platform.machine()}, {os.cpu_count()} cores")


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def fit_report(
    args: ModelArgs,
    flavor: str,
    layout: Layout,
    local_batch_size: int,
    seq_len: int,
    compute_bytes: int,
    ac_mode: str,
    selective_ac_option: str,
    devices: Devices,
    *,
    pp_schedule: str = "1F1B",
    microbatch_size: int = 1,
    grad_accum: int = 1,
    fused_loss: bool = True,
    optimizer: str = "adamw",
    state_bytes: int = 4,
    reshard_after_forward: bool | None = None,
    cpu_offload: bool = False,
    layer_modes: list[str] | None = None,
    pcie_bandwidth: float = PCIE_GEN5_X16,
) -> str | None:
    """None if the run fits ``devices``; otherwise the message explaining why not and what would fit.

    The message gives the parameter count, the estimated memory per device by component, the
    devices found, and the planner's best layout (FSDP/HSDP x TP x PP x CP, activation
    checkpointing) for the smallest GPU count that fits (``trainer.estimate.plan.smallest_fit``), with its
    command. ``cpu_offload`` / ``layer_modes`` (per-layer activation modes) are the run's offload; when
    the run does not fit, the lines "fits here with ..." name the offload that would make it fit on
    these devices, with its host memory and PCIe bytes and time (at ``pcie_bandwidth`` bytes/s).
    """
    def estimate(offload: bool, ac: str, modes) -> MemoryEstimate:
        return estimate_memory(args, layout, local_batch_size, seq_len, compute_bytes=compute_bytes,
                               ac_mode=ac, selective_ac_option=selective_ac_option, pp_schedule=pp_schedule,
                               microbatch_size=microbatch_size, grad_accum=grad_accum, fused_loss=fused_loss,
                               optimizer=optimizer, state_bytes=state_bytes,
                               reshard_after_forward=reshard_after_forward, cpu_offload=offload, layer_modes=modes)

    def fits(e: MemoryEstimate) -> bool:
        if devices.kind == "cpu":  # the host is the device: offloaded bytes stay in the same memory
            return e.total + e.host <= devices.memory_per_device
        return e.total <= devices.memory_per_device and e.host <= devices.host_per_process

    est = estimate(cpu_offload, ac_mode, layer_modes)
    if fits(est):
        return None
    dtype = {2: "bf16", 4: "fp32"}.get(compute_bytes, f"{compute_bytes}-byte")
    gpu = "H100"
    if devices.kind == "cuda":
        gpu = next((g for g in GPUS if g in devices.name.upper()), "H100")
    lines = [
        f"flavor {flavor!r} does not fit: {format_params(args)} ({args.num_params():,}).",
        f"  estimated memory per device ({layout.describe()}; {dtype} compute, "
        f"local_batch_size {local_batch_size}, seq_len {seq_len}, activation checkpointing {ac_mode}): "
        f"{est.describe()}",
        f"  devices found: {devices.describe()}",
    ]
    if devices.kind == "cuda":  # the last resorts, on these devices: activation offload, then CPU offload
        for flags, offload, ac in (("--activation_checkpoint.mode offload", cpu_offload, "offload"),
                                   ("--training.enable_cpu_offload", True, ac_mode),
                                   ("--training.enable_cpu_offload --activation_checkpoint.mode offload", True,
                                    "offload")):
            e = estimate(offload, ac, None if ac == "offload" else layer_modes)
            if fits(e):
                lines.append(f"  fits here with {flags}: peak {e.total / GIB:,.1f} GiB per device, host "
                             f"{e.host / GIB:,.1f} GiB per process, PCIe {e.h2d / GIB:,.1f} GiB in + {e.d2h / GIB:,.1f} GiB "
                             f"out per step ({pcie_seconds(max(e.h2d, e.d2h), pcie_bandwidth):.2g} s at "
                             f"{pcie_bandwidth / 1e9:.0f} GB/s, partly hidden behind compute"
                             + ("; the optimizer step runs on the CPU" if offload else "") + ")")
                break
    assumed = "" if devices.kind == "cuda" else f" (no GPU here; sized for {gpu} {GPUS[gpu].memory / GIB:.0f} GiB)"
    start = max(8, layout.n_devices) if devices.kind == "cuda" else 8
    found = smallest_fit(args, flavor, seq_len, gpu=gpu, start=start, fused_loss=fused_loss, optimizer=optimizer,
                         state_bytes=state_bytes)
    if found is None:
        lines.append(f"  no layout of up to 16384 x {gpu} fits{assumed}; reduce training.seq_len")
    else:
        lines.append(f"  would fit{assumed}: {found.n_gpus} x {gpu}, {found.summary()}")
        lines.append(f"    {found.command()}")
        from trainer.registry import family_of

        lines.append(f"  more layouts: python -m trainer.plan --model.name {family_of(args)} --flavor {flavor} "
                     f"--ngpu {found.n_gpus} --gpu {gpu} "
                     f"--seq_len {seq_len} --optimizer {optimizer} --state_dtype {'bfloat16' if state_bytes == 2 else 'float32'}")
    return "\n".join(lines)


def fit_message(config, args, dims, compute_dtype) -> str | None:
    """The memory report when the run of ``config`` (a JobConfig) with model ``args`` on ``dims`` (its
    ParallelDims) in ``compute_dtype`` (a torch dtype) does not fit this machine (:func:`fit_report`),
    else None."""
    from trainer.errors import ConfigError
    from trainer.parallel.fsdp import reshard_after_forward  # the caller has torch loaded already

    p = config.parallelism
    devices = detect_devices()
    try:
        modes = run_layer_modes(config, args, dims.tp, dims.cp, compute_dtype.itemsize,
                                devices.name if devices.kind == "cuda" else "")
    except ValueError as exc:  # a per_layer rule naming a missing layer, a budget too small
        raise ConfigError(str(exc)) from None
    return fit_report(
        args, config.model.flavor, Layout(dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp, dims.cp, ep=dims.ep),
        config.training.local_batch_size, config.training.seq_len, compute_bytes=compute_dtype.itemsize,
        ac_mode=config.activation_checkpoint.mode,
        selective_ac_option=config.activation_checkpoint.selective_ac_option,
        devices=devices, pp_schedule=p.pipeline_parallel_schedule,
        microbatch_size=p.pipeline_parallel_microbatch_size, grad_accum=config.grad_accum_steps(dims.dp_size),
        fused_loss=not (dims.tp_enabled and p.disable_loss_parallel), optimizer=config.optimizer.name.lower(),
        state_bytes=2 if config.optimizer.state_dtype == "bfloat16" else 4,
        reshard_after_forward=reshard_after_forward(p.fsdp_reshard_after_forward, dims.pp_enabled),
        cpu_offload=config.training.enable_cpu_offload, layer_modes=modes,
        pcie_bandwidth=config.training.pcie_bandwidth_gbps * 1e9,
    )
