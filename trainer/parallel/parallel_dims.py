"""The parallel layout of a run (``ParallelDims``) and its named ``DeviceMesh``.

Today: data parallel as ``dp_replicate x dp_shard`` (FSDP2 when only dp_shard > 1, HSDP when both
are). The mesh dims are kept in torchtitan's order (pp, dp_replicate, dp_shard, cp, tp); tensor,
pipeline and context parallel add their degree to ``_DIMS`` and a field here, and everything that
asks for a sub-mesh by name keeps working.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# Outermost first. Only the data-parallel dims exist for now.
_DIMS = ("dp_replicate", "dp_shard")


@dataclass
class ParallelDims:
    """Degrees of each parallel dimension for ``world_size`` processes.

    ``dp_shard = -1`` takes the rest of the world: ``world_size / dp_replicate``.

    Raises ValueError (naming the config key) when a degree is < 1 (other than dp_shard = -1), or
    when the product of the degrees is not the world size.
    """

    dp_replicate: int
    dp_shard: int
    world_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size: expected an integer >= 1, got {self.world_size}")
        if self.dp_replicate < 1:
            raise ValueError(
                f"parallelism.data_parallel_replicate_degree: expected an integer >= 1, got {self.dp_replicate}"
            )
        if self.dp_shard == -1:
            if self.world_size % self.dp_replicate:
                raise ValueError(
                    f"parallelism.data_parallel_replicate_degree: {self.dp_replicate} does not divide the "
                    f"world size {self.world_size}"
                )
            self.dp_shard = self.world_size // self.dp_replicate
        if self.dp_shard < 1:
            raise ValueError(
                f"parallelism.data_parallel_shard_degree: expected -1 or an integer >= 1, got {self.dp_shard}"
            )
        if self.dp_replicate * self.dp_shard != self.world_size:
            raise ValueError(
                f"parallelism: data_parallel_replicate_degree x data_parallel_shard_degree = "
                f"{self.dp_replicate} x {self.dp_shard} = {self.dp_replicate * self.dp_shard}, "
                f"expected the world size {self.world_size}"
            )

    @property
    def degrees(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in _DIMS}

    @property
    def dp_size(self) -> int:
        """Number of data-parallel ranks (distinct batches per step)."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        return self.dp_size > 1

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP2 wraps the model whenever there is more than one process (plain FSDP, HSDP or pure replicate)."""
        return self.world_size > 1

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1

    def build_mesh(self, device_type: str, single_process: bool = False) -> DeviceMesh | None:
        """The named world mesh (all dims, size-1 ones included).

        For one process it is None unless ``single_process`` (e.g. to run FSDP2's mixed precision on
        one GPU). Needs an initialized default process group of ``world_size`` ranks.
        """
        if self.world_size == 1 and not single_process:
            return None
        shape = tuple(self.degrees.values())
        return init_device_mesh(device_type, shape, mesh_dim_names=_DIMS)

    def dp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The sub-mesh FSDP2 works on: 1-D ``dp_shard`` (FSDP), or 2-D ``(dp_replicate, dp_shard)`` (HSDP)."""
        if self.dp_replicate == 1:
            return mesh["dp_shard"]
        return mesh["dp_replicate", "dp_shard"]

    def dp_rank(self, mesh: DeviceMesh | None) -> int:
        """This process's data-parallel rank in [0, dp_size): replicate-major, shard-minor."""
        if mesh is None:
            return 0
        return mesh.get_local_rank("dp_replicate") * self.dp_shard + mesh.get_local_rank("dp_shard")

    def dp_group(self, mesh: DeviceMesh | None):
        """Process group over the data-parallel ranks (None = the default group, which it is while data
        parallel is the only dimension; tensor/context parallel will narrow it)."""
        return None

    def describe(self) -> str:
        return " x ".join(f"{k}={v}" for k, v in self.degrees.items()) + f" (world {self.world_size})"


def device_type() -> str:
    """'cuda' when a GPU is visible, else 'cpu'."""
    return "cuda" if torch.cuda.is_available() else "cpu"
