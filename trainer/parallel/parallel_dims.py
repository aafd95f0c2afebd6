"""The parallel layout of a run (``ParallelDims``) and its named ``DeviceMesh``.

Five degrees, torchtitan's names and order (outermost first):

  pp            pipeline parallel: the layers are split into stages (``trainer.parallel.pipeline``)
  dp_replicate  data parallel, replicated (HSDP's outer dimension: gradients all-reduced)
  dp_shard      data parallel, sharded (FSDP2: parameters all-gathered, gradients reduce-scattered)
  cp            context parallel: each rank holds a part of every sequence (``context_parallel``)
  tp            tensor + sequence parallel inside each block (``tensor_parallel``)

``world_size = pp * dp_replicate * dp_shard * cp * tp``. The innermost dims talk the most (tp
every layer, cp every attention), so they get the neighbouring ranks (the same node on a GPU
cluster); pp, which only passes activations between stages, is outermost.

The mesh keeps every dim, size-1 ones included, so any component can ask for its sub-mesh by name.
Flattened dims for the components that span several (``DeviceMesh._flatten``):

  dp           (dp_replicate, dp_shard): ranks that read different data (the data loader);
  dp_shard_cp  (dp_shard, cp): what FSDP2 shards over. CP ranks hold the same parameters and their
               gradients must be summed, so FSDP2 treats them as more data-parallel ranks;
  dp_cp        (dp_replicate, dp_shard, cp): ranks whose token losses add up to the global loss.

Expert parallel (``ep``, MoE models) borrows data-parallel ranks: ``dp_shard = dp_shard_mod_ep *
ep``. With ep > 1 the mesh has ``dp_shard_mod_ep`` and ``ep`` in place of ``dp_shard`` (which is
then their flattening, so everything above is unchanged): the routed experts are split over ``ep``
(tokens reach them by all-to-all, ``trainer.parallel.expert_parallel``) and FSDP2 shards each rank's
experts over the remaining ``dp_shard_mod_ep`` ranks; every other parameter is sharded over
``dp_shard_cp`` as usual. The ep ranks read different data, like any data-parallel ranks.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# Outermost first (torchtitan's order).
_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

# Config key of each degree, for the error messages.
CONFIG_KEYS = {
    "dp_replicate": "parallelism.data_parallel_replicate_degree",
    "dp_shard": "parallelism.data_parallel_shard_degree",
    "cp": "parallelism.context_parallel_degree",
    "tp": "parallelism.tensor_parallel_degree",
    "pp": "parallelism.pipeline_parallel_degree",
    "ep": "parallelism.expert_parallel_degree",
}


def _above_one(dim: str) -> property:
    """A read-only property: whether the degree ``dim`` is more than 1 (that parallelism is on)."""
    return property(lambda self: getattr(self, dim) > 1, doc=f"Whether {dim} > 1.")


@dataclass
class ParallelDims:
    """Degrees of each parallel dimension for ``world_size`` processes.

    ``dp_shard = -1`` takes the rest of the world: ``world_size / (dp_replicate * cp * tp * pp)``.

    Raises ValueError, one line naming the config keys, when a degree is < 1 (other than
    dp_shard = -1), when the fixed degrees do not divide the world size, or when the product of
    the degrees is not the world size (the message shows the arithmetic).
    """

    dp_replicate: int
    dp_shard: int
    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size: expected an integer >= 1, got {self.world_size!r}")
        for name in ("dp_replicate", "tp", "pp", "cp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{CONFIG_KEYS[name]}: expected an integer >= 1, got {v!r}")
        if isinstance(self.dp_shard, bool) or not isinstance(self.dp_shard, int) or (
                self.dp_shard < 1 and self.dp_shard != -1):
            raise ValueError(f"{CONFIG_KEYS['dp_shard']}: expected -1 or an integer >= 1, got {self.dp_shard!r}")
        if self.dp_shard == -1:
            others = self.dp_replicate * self.cp * self.tp * self.pp
            if self.world_size % others:
                used = [n for n in ("dp_replicate", "cp", "tp", "pp") if getattr(self, n) > 1]
                if len(used) == 1:
                    what = f"{CONFIG_KEYS[used[0]]}: {others}"
                else:
                    what = f"parallelism: {_product(self, used)}"
                raise ValueError(
                    f"{what} does not divide the world size {self.world_size} "
                    f"(data_parallel_shard_degree = -1 takes the rest)"
                )
            self.dp_shard = self.world_size // others
        product = self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp
        if product != self.world_size:
            used = ["dp_replicate", "dp_shard"] + [n for n in ("cp", "tp", "pp") if getattr(self, n) > 1]
            raise ValueError(f"parallelism: {_product(self, used)}, expected the world size {self.world_size}")
        if isinstance(self.ep, bool) or not isinstance(self.ep, int) or self.ep < 1:
            raise ValueError(f"{CONFIG_KEYS['ep']}: expected an integer >= 1, got {self.ep!r}")
        if self.dp_shard % self.ep:
            raise ValueError(
                f"{CONFIG_KEYS['ep']}: {self.ep} does not divide data_parallel_shard_degree = {self.dp_shard} "
                f"(expert parallel borrows data-parallel shard ranks)"
            )
        if self.ep > 1 and (self.cp > 1 or self.dp_replicate > 1):
            raise ValueError(f"{CONFIG_KEYS['ep']}: not supported with context_parallel_degree > 1 or "
                             f"data_parallel_replicate_degree > 1 yet")

    # -- degrees ---------------------------------------------------------------------------------

    @property
    def degrees(self) -> dict[str, int]:
        """``{dim: degree}`` outermost first, size-1 dims included."""
        return {name: getattr(self, name) for name in _DIMS}

    @property
    def dp_size(self) -> int:
        """Number of data-parallel ranks (distinct batches per step)."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_size(self) -> int:
        """Ranks FSDP2 averages gradients over: dp_replicate * dp_shard * cp."""
        return self.dp_replicate * self.dp_shard * self.cp

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP2 (or HSDP, or pure replication) wraps the model: more than one rank holds the same parameters."""
        return self.fsdp_size > 1

    # Whether each parallelism is on: its degree is more than 1.
    hsdp_enabled = _above_one("dp_replicate")
    tp_enabled = _above_one("tp")
    pp_enabled = _above_one("pp")
    cp_enabled = _above_one("cp")
    ep_enabled = _above_one("ep")

    @property
    def dp_shard_mod_ep(self) -> int:
        """Data-parallel shard ranks that hold the same experts (FSDP2 shards the experts over them)."""
        return self.dp_shard // self.ep

    # -- mesh ------------------------------------------------------------------------------------

    def build_mesh(self, device_type: str, single_process: bool = False) -> DeviceMesh | None:
        """The named world mesh (all five dims, size-1 ones included) with the flattened dims
        ``dp``, ``dp_shard_cp`` and ``dp_cp`` (module docstring).

        For one process it is None unless ``single_process`` (e.g. to run FSDP2's mixed precision on
        one GPU). Needs an initialized default process group of ``world_size`` ranks.
        """
        if self.world_size == 1 and not single_process:
            return None
        if self.ep > 1:
            # dp_shard split into (dp_shard_mod_ep, ep), ep inner (module docstring).
            names = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "cp", "tp")
            sizes = (self.pp, self.dp_replicate, self.dp_shard_mod_ep, self.ep, self.cp, self.tp)
            mesh = init_device_mesh(device_type, sizes, mesh_dim_names=names)
            mesh["dp_shard_mod_ep", "ep"]._flatten("dp_shard")
            mesh["dp_replicate", "dp_shard_mod_ep", "ep"]._flatten("dp")
            mesh["dp_shard_mod_ep", "ep", "cp"]._flatten("dp_shard_cp")
            mesh["dp_replicate", "dp_shard_mod_ep", "ep", "cp"]._flatten("dp_cp")
            return mesh
        mesh = init_device_mesh(device_type, tuple(self.degrees.values()), mesh_dim_names=_DIMS)
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        return mesh

    def dp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The sub-mesh FSDP2 works on: 1-D ``dp_shard_cp`` (FSDP), or 2-D ``(dp_replicate, dp_shard_cp)`` (HSDP)."""
        if self.dp_replicate == 1:
            return submesh(mesh, "dp_shard_cp")
        return submesh(mesh, "dp_replicate", "dp_shard_cp")

    def dp_rank(self, mesh: DeviceMesh | None) -> int:
        """This process's data-parallel rank in [0, dp_size): replicate-major, shard-minor."""
        if mesh is None:
            return 0
        if self.ep > 1:
            shard = mesh.get_local_rank("dp_shard_mod_ep") * self.ep + mesh.get_local_rank("ep")
        else:
            shard = mesh.get_local_rank("dp_shard")
        return mesh.get_local_rank("dp_replicate") * self.dp_shard + shard

    def dp_group(self, mesh: DeviceMesh | None):
        """Process group over the ranks whose token losses make up the global loss: data parallel and
        context parallel (``dp_cp``); tensor-parallel ranks hold the same tokens and pipeline stages
        other than the last hold no loss. None for one process."""
        if mesh is None:
            return None
        return submesh(mesh, "dp_cp").get_group()

    def describe(self) -> str:
        """E.g. ``dp_replicate=1 x dp_shard=2 x tp=2 (world 4)``: the data-parallel dims and every other dim > 1."""
        shown = [n for n in (*_DIMS, "ep") if n in ("dp_replicate", "dp_shard") or getattr(self, n) > 1]
        return " x ".join(f"{n}={getattr(self, n)}" for n in shown) + f" (world {self.world_size})"


def _product(dims: ParallelDims, names: list[str]) -> str:
    """``key1 x key2 = 2 x 3 = 6`` with the config keys of ``names``."""
    value = 1
    for n in names:
        value *= getattr(dims, n)
    keys = " x ".join(CONFIG_KEYS[n].split(".")[1] for n in names)
    return f"{keys} = " + " x ".join(str(getattr(dims, n)) for n in names) + f" = {value}"


def submesh(mesh: DeviceMesh, *names: str) -> DeviceMesh:
    """``mesh[names]``, flattened dims included."""
    with warnings.catch_warnings():
        # torch (>= 2.11) announces another way to keep flattened meshes; slicing them from the root
        # is the way that works on every version we support.
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        return mesh[names[0] if len(names) == 1 else names]


def device_type() -> str:
    """'cuda' when a GPU is visible, else 'cpu'."""
    return "cuda" if torch.cuda.is_available() else "cpu"
