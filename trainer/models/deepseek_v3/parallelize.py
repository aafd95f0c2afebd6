"""DeepSeek-V3's tensor-parallel plan beyond the shared blocks (``ModelSpec.tensor_parallel``): the
multi-token-prediction modules."""
from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel, parallelize_module

from trainer.parallel.tensor_parallel import block_plan, finish_block


def tp_mtp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard the MTP modules of ``model`` (a ``DeepSeekV3`` or a pipeline stage of one; none without MTP)
    as the main blocks are, with ``eh_proj`` colwise over the sequence-parallel input."""
    for module in (getattr(model, "mtp", None) or {}).values():
        plan = {"enorm": SequenceParallel(), "hnorm": SequenceParallel(), "post_norm": SequenceParallel(),
                "eh_proj": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(1))}
        plan.update({f"block.{k}": v for k, v in block_plan(module.block).items()})
        parallelize_module(module, tp_mesh, plan)
        finish_block(module.block, tp_mesh)
