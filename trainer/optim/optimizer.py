"""``TitanOptimizer``: AdamW and Muon parameter groups in one ``torch.optim.Optimizer``, one step.

AdamW groups: ``titan_kernels.fused_adamw_`` (one launch per group and dtype combination; states
float32 or bfloat16 with stochastic rounding, keyed by (seed, step, the parameter's name) so a
resumed run draws the same bits; DTensor shards updated in place, no communication). The state is
torch.optim.AdamW's (``step``, ``exp_avg``, ``exp_avg_sq``), so checkpoints of either load into the other.

Muon groups (Jordan et al. 2024; Liu et al., "Muon is Scalable for LLM Training", arXiv 2502.16982),
per parameter, exactly ``torch.optim.Muon``'s update with ``adjust_lr_fn="match_rms_adamw"``:
    B <- B + (1 - mu) (G - B)                      (momentum_buffer, an EMA of the gradients)
    U <- G + mu (B - G)  (Nesterov)  or  B
    O <- NewtonSchulz(U)                           (per matrix; a 3-D MoE weight per expert)
    W <- W (1 - lr wd) - lr * rms_match * sqrt(max(rows, cols)) * O
The Newton-Schulz runs whole matrices on one rank each (``trainer.optim.muon_dist``); everything
else is elementwise on the local shards. A bfloat16 momentum is computed in float32 and rounded to
nearest (its increments, (1 - mu) = 5% of the gap, are far above bf16's resolution).

After the updates, QK-clip (``trainer.optim.qk_clip``) when configured.
"""
from __future__ import annotations

import math
import zlib

import torch

import titan_kernels
from trainer.optim.muon_dist import MatrixExchange

STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Per-group keys that the configuration decides (restored after loading an older checkpoint's groups).
_CONFIG_KEYS = ("optimizer", "lr_multiplier", "label", "betas", "eps", "state_dtype", "momentum", "nesterov",
                "ns_steps", "rms_match", "seed")


def _local(t: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """The local shard of a DTensor (laid out like ``like`` first, when given), else ``t``."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    if like is not None and (t.device_mesh != like.device_mesh or tuple(t.placements) != tuple(like.placements)):
        t = t.redistribute(like.device_mesh, like.placements)
    return t.to_local()


class TitanOptimizer(torch.optim.Optimizer):
    """AdamW and Muon groups (module docstring).

    Args:
        groups: param groups as ``trainer.optim.groups.param_groups`` makes them: ``params``,
            ``param_names``, ``optimizer`` ("adamw" / "muon"), ``lr``, ``lr_multiplier``,
            ``weight_decay``, ``label``.
        betas, eps: AdamW's. state_dtype: "float32" or "bfloat16" (AdamW states, Muon momentum).
        seed: of the stochastic rounding. momentum, nesterov, ns_steps, rms_match: Muon's.
        ns_dtype: the Newton-Schulz dtype (None: bfloat16 on CUDA, else float32).
        mesh: the world DeviceMesh (None in one process), for the Newton-Schulz exchange groups.
        after_step: called after every step (QK-clip), or None.

    Raises ValueError for an unknown optimizer or state dtype, or a Muon parameter that is not 2-D/3-D.
    """

    def __init__(self, groups: list[dict], *, betas=(0.9, 0.95), eps: float = 1e-8, state_dtype: str = "float32",
                 seed: int = 0, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 rms_match: float = 0.2, ns_dtype: torch.dtype | None = None, mesh=None, after_step=None) -> None:
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"optimizer.state_dtype: expected one of {tuple(STATE_DTYPES)}, got {state_dtype!r}")
        self._names: dict[int, str] = {}
        clean = []
        for g in groups:
            g = dict(g)
            if g.get("optimizer") not in ("adamw", "muon"):
                raise ValueError(f"optimizer.groups: expected optimizer adamw or muon, got {g.get('optimizer')!r}")
            for p, n in zip(g["params"], g.pop("param_names")):
                self._names[id(p)] = n
                if g["optimizer"] == "muon" and p.dim() not in (2, 3):
                    raise ValueError(f"optimizer.groups: Muon parameter {n!r} has shape {tuple(p.shape)}; "
                                     f"expected 2 dims (a matrix) or 3 (experts)")
            clean.append(g)
        defaults = dict(lr=1e-3, weight_decay=0.0, optimizer="adamw", lr_multiplier=1.0, label="", betas=tuple(betas),
                        eps=eps, state_dtype=state_dtype, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        rms_match=rms_match, seed=seed)
        super().__init__(clean, defaults)
        self._config = [{k: g[k] for k in _CONFIG_KEYS} for g in self.param_groups]
        self.after_step = after_step
        muon = sorted(((self._names[id(p)], p) for g in self.param_groups if g["optimizer"] == "muon"
                       for p in g["params"]), key=lambda x: x[0])
        self._muon_params = [p for _, p in muon]
        if ns_dtype is None:
            dev = self._muon_params[0].device.type if self._muon_params else "cpu"
            ns_dtype = torch.bfloat16 if dev == "cuda" else torch.float32
        self.ns_dtype = ns_dtype
        # Built now: with a mesh it creates process groups, collectively on every rank.
        self._exchange = MatrixExchange([n for n, _ in muon], self._muon_params, mesh, ns_dtype, ns_steps)
        self._overlap = None  # trainer.parallel.cpu_offload.OverlappedStep, installed by CPU offload

    def param_name(self, p: torch.Tensor) -> str:
        return self._names[id(p)]

    # -- step ------------------------------------------------------------------------------------

    def synchronize(self) -> None:
        """Wait for an update still running in the background (CPU offload's overlapped step)."""
        if self._overlap is not None:
            self._overlap.synchronize()

    def state_dict(self) -> dict:
        self.synchronize()
        return super().state_dict()

    @torch.no_grad()
    def step(self, closure=None):
        if self._overlap is not None and closure is None and self._overlap.launch():
            return None
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["optimizer"] == "adamw":
                self._adamw(group)
        if self._muon_params:
            self._muon()
        if self.after_step is not None:
            self.after_step()
        return loss

    def _adamw(self, group: dict, params=None, grads: dict | None = None, lr: float | None = None,
               local: bool = False) -> None:
        """AdamW over ``params`` of ``group`` (default all), with ``grads`` ({id: gradient}, default each
        ``p.grad``) and ``lr`` (default the group's); ``local``: on the DTensors' local shards."""
        sdt = STATE_DTYPES[group["state_dtype"]]
        by_step: dict[int, list] = {}
        grad_of = {}
        for p in group["params"] if params is None else params:
            g = p.grad if grads is None else grads.get(id(p))
            if g is None:
                continue
            grad_of[id(p)] = g
            st = self._adamw_state(p, sdt)
            st["step"] += 1
            by_step.setdefault(int(st["step"].item()), []).append(p)
        beta1, beta2 = group["betas"]
        view = _local if local else (lambda t: t)
        for step, ps in by_step.items():
            titan_kernels.fused_adamw_(
                [view(p) for p in ps], [view(grad_of[id(p)]) for p in ps],
                [view(self.state[p]["exp_avg"]) for p in ps], [view(self.state[p]["exp_avg_sq"]) for p in ps],
                lr=float(group["lr"] if lr is None else lr), beta1=beta1, beta2=beta2, eps=group["eps"],
                weight_decay=group["weight_decay"], step=step, seed=group["seed"],
                param_keys=[zlib.crc32(self._names[id(p)].encode()) for p in ps])

    def _adamw_state(self, p: torch.Tensor, sdt: torch.dtype) -> dict:
        st = self.state[p]
        if not st:
            st["step"] = torch.tensor(0.0)
            st["exp_avg"] = torch.zeros_like(p, dtype=sdt, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, dtype=sdt, memory_format=torch.preserve_format)
        return st

    def deferred_adamw(self):
        """The AdamW part of this step, to run later piece by piece (CPU offload's overlapped step,
        ``trainer.parallel.cpu_offload``): returns ``run(ids)``, which updates the parameters whose
        ``id`` is in ``ids`` with the gradients and learning rates of now (so zero_grad and the LR
        schedule may move on meanwhile). None when the step has more than AdamW groups (Muon's
        exchange, QK-clip): those run whole, in :meth:`step`."""
        if self._muon_params or self.after_step is not None:
            return None
        groups = [(g, float(g["lr"]), {id(p): p.grad for p in g["params"] if p.grad is not None})
                  for g in self.param_groups if g["optimizer"] == "adamw"]
        for g, _, grads in groups:  # new states now, in this thread: the worker touches local shards only
            for p in g["params"]:
                if id(p) in grads:
                    self._adamw_state(p, STATE_DTYPES[g["state_dtype"]])

        @torch.no_grad()
        def run(ids: set[int]) -> None:
            for group, lr, grads in groups:
                params = [p for p in group["params"] if id(p) in ids]
                if params:
                    self._adamw(group, params, grads, lr, local=True)

        return run

    def _muon(self) -> None:
        group_of = {id(p): g for g in self.param_groups if g["optimizer"] == "muon" for p in g["params"]}
        params = self._muon_params

        def update(i: int) -> torch.Tensor:
            """Momentum, then the (Nesterov) update of parameter i's local shard."""
            p = params[i]
            g = group_of[id(p)]
            if p.grad is None:  # still part of the (collective) exchange; not applied
                return torch.zeros_like(_local(p))
            st = self.state[p]
            grad = _local(p.grad, like=p)
            if "momentum_buffer" not in st:
                st["momentum_buffer"] = torch.zeros_like(p, dtype=STATE_DTYPES[g["state_dtype"]],
                                                         memory_format=torch.preserve_format)
            buf = _local(st["momentum_buffer"])
            mu = g["momentum"]
            if buf.dtype == grad.dtype:
                b = buf.lerp_(grad, 1 - mu)
            else:
                b = buf.float().lerp_(grad.float(), 1 - mu)
                buf.copy_(b)
            return grad.lerp(b, mu) if g["nesterov"] else b

        def apply(i: int, o: torch.Tensor) -> None:
            p = params[i]
            if p.grad is None:
                return
            g = group_of[id(p)]
            lr, wd = float(g["lr"]), g["weight_decay"]
            w = _local(p)
            w.mul_(1 - lr * wd)
            w.add_(o.to(w.dtype), alpha=-lr * g["rms_match"] * math.sqrt(max(p.shape[-2], p.shape[-1])))

        self._exchange.run(update, apply)

    # -- checkpoints -----------------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, then: the configuration's group keys a checkpoint lacks are restored (e.g. one
        written by torch.optim.AdamW), and the states are cast back to the configured dtype (torch
        casts them to the parameter's). Raises ValueError when a group's saved optimizer differs
        from the configured one (its states would not fit)."""
        self.synchronize()
        super().load_state_dict(state_dict)
        for g, cfg in zip(self.param_groups, self._config):
            saved = g.get("optimizer", cfg["optimizer"])
            if saved != cfg["optimizer"]:
                raise ValueError(f"optimizer: the checkpoint's group {cfg['label']!r} was trained with {saved}, the "
                                 f"configuration gives it {cfg['optimizer']} (optimizer.name / optimizer.groups)")
            for k, v in cfg.items():
                g.setdefault(k, v)
            sdt = STATE_DTYPES[g["state_dtype"]]
            for p in g["params"]:
                st = self.state.get(p, {})
                for key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
                    if key in st and st[key].dtype != sdt:
                        st[key] = st[key].to(sdt)
