"""FSDP2 (``torch.distributed.fsdp.fully_shard``): one unit per transformer block, plus the root.

On GPUs, parameters are all-gathered in ``param_dtype`` (bf16 by default) and gradients reduced in
``reduce_dtype`` (fp32), while the sharded master weights and the optimizer stay fp32
(``MixedPrecisionPolicy``). On a 2-D mesh (dp_replicate, dp_shard) this is HSDP: shard within a
group, all-reduce across groups.

Gloo (CPU) does not implement every reduce op FSDP2 may pick (ReduceOp.AVG, PREMUL_SUM), so on gloo
every FSDP unit is told to use plain SUM collectives with a separate division by the data-parallel
size (``set_force_sum_reduction_for_comms``). The result is the same average of gradients.

``cpu_offload`` (``--training.enable_cpu_offload``): FSDP2's ``CPUOffloadPolicy`` on every unit, so the
sharded parameters, their gradients and (through them) the optimizer states live in host memory
(pinned on GPUs); each unit's shard is copied to the device before its all-gather and its reduced
gradient back after the reduce-scatter (``trainer/parallel/cpu_offload.py`` has the rest).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard


RESHARD_POLICIES = ("default", "always", "never")


def reshard_after_forward(policy: str, pp_enabled: bool) -> bool:
    """FSDP2's ``reshard_after_forward`` for the blocks under ``--parallelism.fsdp_reshard_after_forward``.

    ``default``: free the gathered parameters after each block's forward (the backward gathers them
    again), except under pipeline parallel, where the micro-batches' forwards would gather them again
    and again; ``always``: True; ``never``: False (more memory, one all-gather per step fewer).

    Raises:
        ValueError: ``policy`` not one of ``default``, ``always``, ``never``.
    """
    if policy not in RESHARD_POLICIES:
        raise ValueError(f"parallelism.fsdp_reshard_after_forward: expected one of {', '.join(RESHARD_POLICIES)}, "
                         f"got {policy!r}")
    if policy == "default":
        return not pp_enabled
    return policy == "always"


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
    expert_mesh: DeviceMesh | None = None,
    expert_params: list[nn.Parameter] | None = None,
    cpu_offload: bool = False,
) -> nn.Module:
    """Shard ``model`` (a Transformer with ``model.layers``) in place with FSDP2 and return it.

    ``param_dtype``/``reduce_dtype`` None keep the parameters' own dtype (fp32 on CPU).
    The root keeps its parameters (embedding, final norm, output) gathered from forward to backward,
    as FSDP2 does for the root. Works on the meta device (materialize afterwards with ``to_empty``).
    """
    if not hasattr(model, "layers") and not hasattr(model, "blocks"):
        raise TypeError(f"model: expected a module with .layers (transformer blocks), got {type(model).__name__}")
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # Pinned host memory makes the copies to and from the GPU asynchronous; a CPU-only run cannot pin.
    offload = CPUOffloadPolicy(pin_memory=dp_mesh.device_type == "cuda") if cpu_offload else OffloadPolicy()
    # Expert parallel: the routed experts (DTensors on the ep mesh) are their own FSDP unit over the
    # ranks that hold the same experts (``expert_mesh``, dp_shard_mod_ep); with none left over
    # (ep = dp_shard) FSDP2 leaves them alone (nothing to shard or average).
    experts = {id(p) for p in expert_params or ()}
    ignored: set[nn.Parameter] = set()
    for block in model.blocks() if hasattr(model, "blocks") else model.layers.values():
        ff = getattr(block, "feed_forward", None)
        if experts and hasattr(ff, "experts") and id(ff.experts.w1) in experts:
            if expert_mesh is not None and expert_mesh.size() > 1:
                fully_shard(ff.experts, mesh=expert_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                            offload_policy=offload)
            else:
                ignored.update(ff.experts.parameters())
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                    ignored_params=ignored or None, offload_policy=offload)
    # The root (embedding, final norm, output) stays gathered from forward to backward: the fused
    # loss reads output.weight after the forward (trainer.models.common.losses.linear_cross_entropy_loss).
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False, ignored_params=ignored or None,
                offload_policy=offload)
    if dist.get_backend(dp_mesh.get_group(0)) == "gloo":
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    return model
