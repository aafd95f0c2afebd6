"""The KV cache of multi-head latent attention (DeepSeek-V2 sec. 2.1.2, "low-rank key-value joint
compression"; DeepSeek-V3): per token it keeps the normed joint latent c (``kv_lora_rank``) and the
rotated rotary key k_r (``qk_rope_head_dim``, one head shared by all), ``kv_lora_rank + qk_rope``
numbers against ``2 * heads * head_dim`` for a plain KV cache (576 against 40,960 for V3).

Prefill runs the module's own attention (the up-projected keys and values through
``flash_attn_varlen``: all tokens attend there anyway, so the up-projection is paid once per token).

Decode, one query per sequence over L cached tokens, has two exact ways:
  absorbed (the default)  the key up-projection W_uk folds into the query and W_uv into the output:
      score = (q_nope W_uk) . c + q_rope . k_r,   out = (sum_j p_j c_j) W_uv^T,
      an attention of ``heads`` queries over ONE key/value head of ``kv_lora_rank + qk_rope`` /
      ``kv_lora_rank`` dims (multi-query), reading the cache as it is. Per step and layer it costs
      about 2 L H (r + d_r) + 2 L H r + 2 H r (d_nope + d_v) multiply-adds and reads L (r + d_r) numbers.
  up-projected            k_nope, v = W_ukv c for every cached token, then ordinary attention:
      2 L r H (d_nope + d_v) multiply-adds more per step, and L H (d_nope + d_v + d_r) numbers
      written and read.
Per cached token the absorbed path reads r + d_r numbers and does about 2 H (2 r + d_r) multiply-adds;
the up-projected one does 2 r H (d_nope + d_v) more and moves H (d_nope + d_v + d_r) numbers, so the
absorbed path is cheaper once the cache holds more than a few tokens, at every DeepSeek shape; decode
uses it. ``absorb = False`` selects the other (the tests check both against the full forward;
``bench/bench_generate.py`` times both: absorbed 1.2x to 2.1x faster at 1,024 cached tokens on the
debug model, 2 shared CPU cores, 2026-12-07).

The latent attention's head dims (V3: 576 and 512) exceed what the flash kernels take (256); such
shapes run the same math in plain PyTorch matmuls (float32 softmax), which is what a decode step of
one query is anyway.
"""
from __future__ import annotations

import torch

from trainer.generate.cache import KVCache, attend_cached
from trainer.models.common.attention import attend

MAX_FLASH_HEAD_DIM = 256


def _local(w: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (tensor parallel) weight."""
    return w.to_local() if hasattr(w, "to_local") else w


class MLACache(KVCache):
    """The latent cache of one MLA layer: ``self.k`` holds [c, k_r] (batch, capacity, 1, r + d_r)."""

    absorb = True

    def attend_latent(self, module, q, k, v, latent, k_rope, position_ids, cu_seqlens):
        """The attention of MLA ``module`` on its q (batch, seq, heads, d_nope + d_r) (rotated), k/v (the
        up-projected ones, used by the prefill), the normed ``latent`` (batch, seq, r) and the rotated
        ``k_rope`` (batch, seq, 1, d_r); keeps [latent, k_rope]. Returns (batch, seq, heads, d_v)."""
        joint = torch.cat([latent.unsqueeze(2), k_rope], dim=-1)
        st = self.state
        if st.phase == "prefill":
            if self.k is None:
                self.k = joint.new_zeros((st.batch, st.capacity, *joint.shape[2:]))
            self._store_prefill((joint, self.k))
            return attend(q, k, v, position_ids, cu_seqlens, module.mask, softmax_scale=module.softmax_scale)
        self._store_decode((joint, self.k))
        plan = st.decode_plan(self.kind_key(), self.visible)
        r = module.kv_lora_rank
        w = _local(module.wkv_b.weight).view(-1, module.qk_nope + module.v_dim, r)  # (heads, d_nope + d_v, r)
        w_uk, w_uv = w[:, :module.qk_nope], w[:, module.qk_nope:]
        q_nope, q_rope = q.split([module.qk_nope, module.qk_rope], dim=-1)
        if not self.absorb:
            cache_kv = torch.einsum("bsc,hkc->bshk", self.k[:, :, 0, :r], w)
            k_nope, v_all = cache_kv.split([module.qk_nope, module.v_dim], dim=-1)
            k_all = torch.cat([k_nope, self.k[:, :, :, r:].expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
            return attend_cached(q, k_all, v_all, plan, module.softmax_scale)
        q_lat = torch.cat([torch.einsum("bshn,hnc->bshc", q_nope, w_uk), q_rope], dim=-1)
        if q_lat.shape[-1] <= MAX_FLASH_HEAD_DIM:
            out_lat = attend_cached(q_lat, self.k, self.k[..., :r], plan, module.softmax_scale)
        else:
            out_lat = _latent_attention(q_lat, self.k, r, st.lengths_host, self.visible, module.softmax_scale)
        return torch.einsum("bshc,hvc->bshv", out_lat, w_uv)


def _latent_attention(q: torch.Tensor, cache: torch.Tensor, r: int, positions: list[int], visible, scale: float):
    """One query per row q (batch, 1, heads, r + d_r) over the latent cache (batch, slots, 1, r + d_r):
    row b reads its first ``visible(positions[b])`` slots; values are the first r dims. Returns
    (batch, 1, heads, r). Softmax in float32."""
    keys = cache[:, :, 0]
    scores = torch.einsum("bhc,bnc->bhn", q[:, 0].float(), keys.float()) * scale
    counts = torch.tensor([visible(p) for p in positions], device=q.device)
    hidden = torch.arange(keys.shape[1], device=q.device)[None, :] >= counts[:, None]
    scores = scores.masked_fill(hidden[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bhn,bnc->bhc", probs, keys[..., :r].float()).to(q.dtype)[:, None]
