"""Newton-Schulz of sharded matrices for Muon: every matrix is orthogonalised whole by exactly one
rank, and each rank gets its shard of the result back.

Which ranks hold pieces of one matrix: the mesh dims whose placement (Shard or FSDP2's
_StridedShard) cuts one of the matrix dims (the last two); for a 3-D MoE weight (n_experts, in, out)
a cut of dim 0 (expert or FSDP2 sharding of the experts) leaves whole experts on each rank, so those
dims are a batch the rank orthogonalises locally (per expert). Replicated mesh dims (HSDP's replicas)
each repeat the work on their own copy. So: no sharded matrix dim -> local; else one "exchange group"
over the cutting mesh dims (FSDP2: dp_shard_cp; TP: tp; FSDP2 x TP: both, flattened).

Per exchange group (DistMuon's scheme, arranged our way): the matrices, in name order, are given
owners greedily by their Newton-Schulz cost (largest first, to the least loaded rank), and
exchanged in rounds (round k: the k-th matrix of every rank): an ``all_to_all_single`` sends each
rank's piece of every matrix to its owner, the owner assembles the matrix (each piece's global
indices come from DTensor's own split rules, so any placement order and uneven split is exact),
orthogonalises it, and a second all-to-all sends every rank its piece of the result, which is
applied at once. Asynchronous, ``WINDOW`` (2) rounds in flight: round k + 2's pieces travel while
round k is orthogonalised, and round k's results travel back during round k + 1's.

Memory at the optimizer step, per rank: per round in flight about one matrix of pieces sent, the
matrix it owns, and one matrix of results (in the iteration's dtype), plus one Newton-Schulz's
temporaries: bounded by the largest matrix, not by the number of parameters.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import titan_kernels
from titan_kernels import newton_schulz_flops

WINDOW = 2  # exchange rounds in flight per group (double buffering)


@dataclass
class MatrixPlan:
    """How one Muon parameter's update reaches Newton-Schulz."""

    name: str
    shape: tuple[int, ...]           # global shape
    group_key: tuple | None = None   # None: orthogonalised locally
    members: list[int] = field(default_factory=list)   # global ranks of the exchange group, in its order
    my_index: int = 0
    full_shape: tuple[int, ...] = ()  # what the owner assembles (local batch dims, global matrix dims)
    index_sets: list[tuple] = field(default_factory=list)  # per member: per dim, a LongTensor or a slice
    piece_shapes: list[tuple[int, ...]] = field(default_factory=list)
    owner: int = 0

    def piece_numel(self, j: int) -> int:
        return math.prod(self.piece_shapes[j])


def _is_shard(pl) -> bool:
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    return isinstance(pl, (Shard, _StridedShard))


def _as_dim0(pl):
    """The placement acting on dim 0 (to split an index vector the way it splits its tensor dim)."""
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    if isinstance(pl, _StridedShard):
        return _StridedShard(0, split_factor=pl.split_factor)
    return Shard(0)


def _index_sets(shape, mesh_sizes, coord, cut_dims, placements, local_shape) -> tuple[list, tuple]:
    """Per tensor dim: the global indices a rank at mesh coordinate ``coord`` holds, following the
    placements of ``cut_dims`` left to right (as DTensor applies them); other dims keep their local
    range. A contiguous index run becomes a slice. Returns (index sets, piece shape)."""
    idx = [None] * len(shape)
    for d, pl in enumerate(placements):
        if d not in cut_dims:
            continue
        t = pl.dim
        cur = idx[t] if idx[t] is not None else torch.arange(shape[t])
        chunks, _ = _as_dim0(pl)._split_tensor(cur, mesh_sizes[d], with_padding=False)
        idx[t] = chunks[coord[d]] if coord[d] < len(chunks) else cur[:0]
    sets, piece = [], []
    for t, ix in enumerate(idx):
        if ix is None:
            sets.append(slice(0, local_shape[t]))
            piece.append(local_shape[t])
            continue
        n = ix.numel()
        if n == 0 or bool((ix == torch.arange(int(ix[0]), int(ix[0]) + n)).all()):
            start = int(ix[0]) if n else 0
            sets.append(slice(start, start + n))
        else:
            sets.append(ix)
        piece.append(n)
    return sets, tuple(piece)


def _put(full: torch.Tensor, sets: list, piece: torch.Tensor) -> None:
    if all(isinstance(s, slice) for s in sets):
        full[tuple(sets)] = piece
        return
    ix = [torch.arange(s.start, s.stop) if isinstance(s, slice) else s for s in sets]
    full[torch.meshgrid(*ix, indexing="ij")] = piece


def _take(full: torch.Tensor, sets: list) -> torch.Tensor:
    if all(isinstance(s, slice) for s in sets):
        return full[tuple(sets)]
    ix = [torch.arange(s.start, s.stop) if isinstance(s, slice) else s for s in sets]
    return full[torch.meshgrid(*ix, indexing="ij")]


def local_indices(p: torch.Tensor, dim: int):
    """The global indices along ``dim`` of this rank's shard of ``p`` (a slice, or a LongTensor for a
    strided split); ``slice(0, size)`` for a plain tensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return slice(0, p.shape[dim])
    mesh, placements = p.device_mesh, p.placements
    cut = [d for d, pl in enumerate(placements) if _is_shard(pl) and pl.dim == dim]
    sets, _ = _index_sets(p.shape, mesh.shape, mesh.get_coordinate(), cut, placements, tuple(p.to_local().shape))
    return sets[dim]


def plan_matrix(name: str, p: torch.Tensor) -> tuple[MatrixPlan, tuple | None]:
    """The MatrixPlan of parameter ``p`` and, when it needs an exchange, the mesh dim names of its
    group (module docstring)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return MatrixPlan(name, tuple(p.shape)), None
    mesh, placements = p.device_mesh, p.placements
    matrix_dims = (p.dim() - 2, p.dim() - 1)
    cut = [d for d, pl in enumerate(placements) if _is_shard(pl) and pl.dim in matrix_dims]
    if not cut:
        return MatrixPlan(name, tuple(p.shape)), None
    names = mesh.mesh_dim_names
    if names is None:
        raise RuntimeError(f"Muon: parameter {name!r} is a DTensor on a mesh without dim names; the distributed "
                           f"Newton-Schulz needs named mesh dims")
    coord = mesh.get_coordinate()
    sizes = mesh.shape
    local_shape = tuple(p.to_local().shape)
    members, sets, pieces = [], [], []
    my_index = 0
    for combo in itertools.product(*(range(sizes[d]) for d in cut)):
        c = list(coord)
        for d, v in zip(cut, combo):
            c[d] = v
        if c == list(coord):
            my_index = len(members)
        members.append(int(mesh.mesh[tuple(c)].item()))
        s, pc = _index_sets(p.shape, sizes, c, cut, placements, local_shape)
        sets.append(s)
        pieces.append(pc)
    full_shape = tuple(p.shape[t] if any(placements[d].dim == t for d in cut) else local_shape[t]
                       for t in range(p.dim()))
    group_names = tuple(names[d] for d in cut)
    plan = MatrixPlan(name, tuple(p.shape), (group_names, tuple(members)), members, my_index, full_shape, sets,
                      pieces)
    return plan, group_names


class MatrixExchange:
    """Newton-Schulz of a fixed list of Muon parameters (module docstring).

    Args:
        names, params: the Muon parameters (same order on every rank of each exchange group:
            sorted by name here).
        mesh: the world mesh (None for one process): exchange groups over several mesh dims are
            flattened from it, collectively and in the same order on every rank.
        ns_dtype: the iteration's (and the exchange's) dtype; ns_steps: iterations.
    """

    def __init__(self, names: list[str], params: list[torch.Tensor], mesh, ns_dtype: torch.dtype,
                 ns_steps: int) -> None:
        self.ns_dtype, self.ns_steps = ns_dtype, ns_steps
        self.plans: list[MatrixPlan] = []
        self.groups: dict[tuple, dict] = {}
        needed = set()
        for n, p in zip(names, params):
            plan, gnames = plan_matrix(n, p)
            self.plans.append(plan)
            if gnames is not None:
                needed.add(gnames)
                self.groups.setdefault(plan.group_key, {"names": gnames, "mesh": p.device_mesh, "plans": []})
                self.groups[plan.group_key]["plans"].append(plan)
        self._make_process_groups(needed, mesh)
        for g in self.groups.values():
            self._assign_owners(g)

    def _make_process_groups(self, needed: set, world_mesh) -> None:
        # Flattening a mesh creates process groups: every rank of the world must do the same ones in the
        # same order, whatever parameters it holds (a pipeline stage may lack some).
        multi = sorted(n for n in needed if len(n) > 1)
        if world_mesh is not None and dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, multi)
            multi = sorted({tuple(n) for lst in everyone for n in lst})
        flat = {}
        for n in multi:
            flat[n] = world_mesh[n]._flatten("_".join(("muon",) + n)) if world_mesh is not None else None
        for key, g in self.groups.items():
            names, members = key
            if len(names) == 1:
                pg = g["mesh"].get_group(names[0])
            else:
                pg = flat[names].get_group() if flat.get(names) is not None else g["mesh"][names]._flatten().get_group()
            got = dist.get_process_group_ranks(pg)
            if list(got) != list(members):
                raise RuntimeError(f"Muon: the process group over mesh dims {names} holds ranks {got}, expected "
                                   f"{list(members)} (the order of the matrix pieces)")
            g["pg"] = pg

    @staticmethod
    def _assign_owners(g: dict) -> None:
        plans = sorted(g["plans"], key=lambda q: q.name)
        w = len(plans[0].members)
        load = [0.0] * w
        owned: list[list[MatrixPlan]] = [[] for _ in range(w)]
        cost = {q.name: newton_schulz_flops(q.full_shape[-2], q.full_shape[-1], batch=math.prod(q.full_shape[:-2]))
                for q in plans}
        for q in sorted(plans, key=lambda q: (-cost[q.name], q.name)):
            j = min(range(w), key=lambda i: (load[i], i))
            q.owner = j
            load[j] += cost[q.name]
            owned[j].append(q)
        g["rounds"] = [[owned[j][k] if k < len(owned[j]) else None for j in range(w)]
                       for k in range(max(len(o) for o in owned))]

    def _ns(self, x: torch.Tensor) -> torch.Tensor:
        return titan_kernels.newton_schulz(x, steps=self.ns_steps, dtype=self.ns_dtype)

    @torch.no_grad()
    def run(self, make_update, apply, window: int = WINDOW) -> None:
        """Orthogonalise every parameter's update and apply it, a few at a time (bounded memory).

        ``make_update(i)`` returns parameter i's update (its local shard, a plain tensor; called once
        per parameter, in the order it is sent); ``apply(i, o)`` receives the Newton-Schulz result of
        that shard (same shape). Local matrices go one by one; each exchange group keeps at most
        ``window`` rounds in flight: round k + window starts travelling while round k is
        orthogonalised, and a round's results are applied as soon as they are back.
        """
        for i, q in enumerate(self.plans):
            if q.group_key is None:
                apply(i, self._ns(make_update(i)))
        pos = {id(q): i for i, q in enumerate(self.plans)}
        for g in self.groups.values():
            self._exchange(g, make_update, apply, pos, window)

    def _exchange(self, g: dict, make_update, apply, pos, window: int) -> None:
        pg, dt = g["pg"], self.ns_dtype
        rounds, first = g["rounds"], g["plans"][0]
        me, w = first.my_index, len(first.members)
        shapes: dict[int, torch.Size] = {}
        dtypes: dict[int, torch.dtype] = {}
        dev = None

        def send(rnd):  # this rank's pieces of the round's matrices, to their owners
            nonlocal dev
            parts = []
            for q in rnd:
                if q is None:
                    parts.append(None)
                    continue
                i = pos[id(q)]
                u = make_update(i)
                shapes[i], dtypes[i], dev = u.shape, u.dtype, u.device
                parts.append(u.reshape(-1).to(dt))
            parts = [t if t is not None else torch.empty(0, dtype=dt, device=dev) for t in parts]
            mine = rnd[me]
            out_split = [mine.piece_numel(s) if mine is not None else 0 for s in range(w)]
            recv = torch.empty(sum(out_split), dtype=dt, device=dev)
            work = dist.all_to_all_single(recv, torch.cat(parts), out_split, [t.numel() for t in parts], group=pg,
                                          async_op=True)
            return work, recv, out_split

        def finish(item):  # this rank's pieces of the results: applied
            work, back, out_split, rnd = item
            work.wait()
            for q, chunk in zip(rnd, torch.split(back, out_split)):
                if q is not None:
                    i = pos[id(q)]
                    apply(i, chunk.view(shapes[i]).to(dtypes[i]))

        inflight = [send(rounds[k]) for k in range(min(window, len(rounds)))]
        backs = []
        for k, rnd in enumerate(rounds):
            work, recv, out_split = inflight.pop(0)
            work.wait()
            if k + window < len(rounds):
                inflight.append(send(rounds[k + window]))
            mine = rnd[me]
            result = [torch.empty(0, dtype=dt, device=dev)] * w
            if mine is not None:
                full = torch.empty(mine.full_shape, dtype=dt, device=dev)
                for s, chunk in enumerate(torch.split(recv, out_split)):
                    _put(full, mine.index_sets[s], chunk.view(mine.piece_shapes[s]))
                del recv
                o = self._ns(full)
                del full
                result = [_take(o, mine.index_sets[s]).reshape(-1) for s in range(w)]
                del o
            out_split = [q.piece_numel(me) if q is not None else 0 for q in rnd]
            back = torch.empty(sum(out_split), dtype=dt, device=dev)
            work = dist.all_to_all_single(back, torch.cat(result), out_split, [t.numel() for t in result], group=pg,
                                          async_op=True)
            backs.append((work, back, out_split, rnd))
            while len(backs) >= window:
                finish(backs.pop(0))
        for item in backs:
            finish(item)
