"""QK-clip (MuonClip, Kimi K2 technical report 2025, section 2.1): after each optimizer step, every
attention head whose largest pre-softmax logit of the step exceeded tau gets its query and key
weights scaled down so that logit becomes tau.

The max logit comes from the attention itself, through one interface: a module that has a
``max_logit`` buffer (float32, one value per local head) updates it in its forward with the running
max, over the step's rows, of each head's log-sum-exp of the scaled logits (``flash_attn(...,
return_lse=True)``; ``trainer.models.common.attention.attend``). We use the LSE because every attention
backend returns it at no extra cost, and max_j s_j <= lse = log sum_j exp(s_j) <= max_j s_j + log(n):
an upper bound, at most log(keys) (about 9 at 8k tokens) above the true max, so the clip is
conservative: it may clip a head whose true max is a little below tau, never miss one above. The
exact max would need the row maxima of the online softmax, which not every backend returns.
Cost: one amax over (batch, heads, seq) floats per layer and micro-batch, and after each step an
all-reduce (max) over the data-parallel ranks and an all-gather over tensor parallel of one float
per head and layer, then an elementwise scale of W_q and W_k.

Scales, per layer, with gamma_h = min(1, tau / max_logit_h) for query head h:
  grouped-query attention (wq, wk; groups g of n_heads / n_kv_heads query heads sharing a key head):
    W_k rows of key head g times sqrt(m_g), m_g = min over the group's gamma_h, and W_q rows of head
    h times gamma_h / sqrt(m_g): every head's logits are scaled by exactly gamma_h (the paper's
    sqrt(gamma) on both sides when n_kv_heads = n_heads). Rows are head-major (head h: rows
    h*head_dim .. (h+1)*head_dim - 1).
  multi-head latent attention (DeepSeek-V3, Kimi K2; wq or wq_b, wkv_b): the paper's recipe: each
    head's q_nope rows (of wq / wq_b) and k_nope rows (of wkv_b) times sqrt(gamma_h), its q_rope rows
    times gamma_h; the rotary key shared by all heads (wkv_a) and the values are left alone.

Not available with QK-norm (the logits do not depend on the scale of W_q/W_k) or context parallel
(ring attention does not report the LSE through this interface yet).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from trainer.optim.muon_dist import local_indices


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _tp_size(w: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    if not isinstance(w, DTensor) or w.device_mesh.mesh_dim_names is None:
        return 1
    names = w.device_mesh.mesh_dim_names
    return w.device_mesh.shape[names.index("tp")] if "tp" in names else 1


def _kind(m: nn.Module) -> str | None:
    """"mla" (multi-head latent attention), "gqa" (wq/wk per head) or None (not an attention)."""
    if all(hasattr(m, a) for a in ("wkv_b", "qk_nope", "qk_rope", "v_dim", "n_heads")):
        return "mla"
    if all(hasattr(m, a) for a in ("wq", "wk", "n_heads", "head_dim")):
        return "gqa"
    return None


class QKClip:
    """QK-clip over every attention module of ``model`` (module docstring); call it after each step.

    Args:
        model: this rank's model: its grouped-query (wq, wk, n_heads, n_kv_heads, head_dim) or latent
            (wq / wq_b, wkv_b, n_heads, qk_nope, qk_rope, v_dim) attention modules.
        tau: the threshold (``optimizer.qk_clip_threshold``).
        mesh: the world mesh or None; the max is reduced over ``dp_cp`` and gathered over ``tp``.

    Raises ValueError when the model has no attention module, has QK-norm, or runs context parallel.
    """

    def __init__(self, model: nn.Module, tau: float, mesh=None) -> None:
        self.tau = float(tau)
        self.layers = [(m, k) for m in model.modules() if (k := _kind(m)) is not None]
        if not self.layers:
            raise ValueError("optimizer.qk_clip_threshold: the model has no attention module (wq/wk or wkv_b)")
        for m, kind in self.layers:
            if kind == "gqa" and getattr(m, "q_norm", None) is not None:
                raise ValueError("optimizer.qk_clip_threshold: the model has QK-norm (Qwen3); the logits do not "
                                 "depend on the scale of W_q/W_k, so QK-clip cannot bound them")
            if getattr(m, "context_parallel", None) is not None:
                raise ValueError("optimizer.qk_clip_threshold: not supported with context parallel yet (ring "
                                 "attention does not record the per-head max logit)")
        self.tp = _tp_size(self._q_proj(*self.layers[0]).weight)
        self.dp_group = self.tp_group = None
        if mesh is not None:
            dp = _submesh(mesh, "dp_cp")  # the ranks that see different tokens
            if dp is not None and dp.size() > 1:
                self.dp_group = dp.get_group()
            if self.tp > 1:
                self.tp_group = mesh["tp"].get_group()
        dev = _local(self._q_proj(*self.layers[0]).weight).device
        for m, _ in self.layers:
            m.max_logit = torch.full((m.n_heads // self.tp,), float("-inf"), device=dev)

    @staticmethod
    def _q_proj(m: nn.Module, kind: str) -> nn.Module:
        """The projection whose rows are the heads' queries (MLA with a query latent: wq_b)."""
        return m.wq_b if kind == "mla" and getattr(m, "wq", None) is None else m.wq

    @torch.no_grad()
    def __call__(self) -> None:
        m = torch.stack([layer.max_logit for layer, _ in self.layers])  # (layers, local heads)
        if self.dp_group is not None:
            dist.all_reduce(m, dist.ReduceOp.MAX, group=self.dp_group)
        if self.tp_group is not None:
            parts = torch.empty(self.tp, *m.shape, device=m.device, dtype=m.dtype)
            dist.all_gather_into_tensor(parts, m.contiguous(), group=self.tp_group)
            m = parts.permute(1, 0, 2).reshape(m.shape[0], -1)  # tp rank r holds heads r*H/tp ..
        gamma = torch.where(m > self.tau, self.tau / m, torch.ones_like(m))
        for (layer, kind), g in zip(self.layers, gamma):
            if kind == "gqa":
                n_kv = layer.n_kv_heads if getattr(layer, "n_kv_heads", None) else layer.n_heads
                group = g.view(n_kv, -1)
                k_scale = group.amin(dim=1).sqrt()
                q_scale = (group / k_scale[:, None]).reshape(-1)
                _scale_rows(layer.wq, q_scale.repeat_interleave(layer.head_dim))
                _scale_rows(layer.wk, k_scale.repeat_interleave(layer.head_dim))
            else:
                root = g.sqrt()[:, None]
                ones = torch.ones(g.numel(), layer.v_dim, device=g.device)
                q_rows = torch.cat([root.expand(-1, layer.qk_nope), g[:, None].expand(-1, layer.qk_rope)], dim=1)
                kv_rows = torch.cat([root.expand(-1, layer.qk_nope), ones], dim=1)
                _scale_rows(self._q_proj(layer, kind), q_rows.reshape(-1))
                _scale_rows(layer.wkv_b, kv_rows.reshape(-1))
            layer.max_logit.fill_(float("-inf"))


def _submesh(mesh, name: str):
    try:
        return mesh[name]
    except (KeyError, RuntimeError, ValueError):
        return None


def _scale_rows(linear: nn.Module, scale: torch.Tensor) -> None:
    """Multiply the output rows of ``linear`` (its weight's dim 0 and its bias, if any; each through
    its local shard) by their entries of the full ``scale``."""
    for t in (linear.weight, getattr(linear, "bias", None)):
        if t is None:
            continue
        local = _local(t)
        s = scale[local_indices(t, 0)].to(local.dtype)
        local.mul_(s.view(-1, *([1] * (local.dim() - 1))))
