"""Context parallel: every sequence is split over the ``cp`` ranks; attention is ring attention.

Load balancing (the "zigzag" split, as in Llama 3's context parallel and torchtitan): the sequence
is cut into ``2 * cp`` equal chunks and rank r holds chunks ``r`` and ``2*cp - 1 - r``, one from
each end. Under a causal mask the early chunks attend to little and the late ones to much, so every
rank gets the same attention work. ``ContextParallel.shard`` splits a (batch, seq) tensor this way;
the tokens, labels and the rotary positions of a rank all come from the same two chunks
(``position_ids``: the global positions of the local tokens).

Ring attention (Liu et al., "Ring Attention with Blockwise Transformers", 2023; the causal zigzag
schedule of Zhu's ring-flash-attention): the K/V block of each rank travels once around the ring
(point-to-point to the next rank, overlapped with the block computation). With local chunks
(a, b) = (r, 2cp-1-r) and the visiting block of rank j holding chunks (j, 2cp-1-j):

  j == r   causal attention of (a, b) on (a, b) (the chunks are in order, so one causal call);
  j <  r   all local queries on chunk j only (chunk j < a; chunk 2cp-1-j > b is masked);
  j >  r   queries of chunk b only, on both chunks (both < b; chunk a sees neither).

Each block is one ``titan_kernels.flash_attn`` call returning its log-sum-exp; the partial outputs
merge exactly through the LSEs (Milakov & Gimelshein 2018: out = sum_i exp(lse_i - lse) out_i,
lse = logsumexp_i lse_i). The backward sends the K/V blocks around again with their gradient
accumulators: each rank adds the gradient of the block it holds, computed by the
``titan::flash_attn_backward`` op from the final output and LSE (FlashAttention-2's backward needs
only those), and after ``cp`` hops each accumulator is back at its owner.

Communication per attention call (forward): ``cp - 1`` hops of this rank's K and V,
batch * (seq / cp) * n_kv_heads * (head_dim + head_dim_v) values each way; the backward twice that (K/V again
plus their gradients, which travel in float32). See trainer/parallel/README.md.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import titan_kernels


def zigzag_indices(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions (int64, (seq_len / cp,)) of the tokens rank ``rank`` holds: chunks ``rank``
    and ``2*cp - 1 - rank`` of ``2*cp`` equal chunks. Raises ValueError if 2*cp does not divide seq_len."""
    if seq_len % (2 * cp):
        raise ValueError(
            f"parallelism.context_parallel_degree: sequence length {seq_len} is not divisible by "
            f"2 x context_parallel_degree = {2 * cp}"
        )
    c = seq_len // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, second])


class ContextParallel:
    """This rank's part of context parallel over ``cp_mesh`` (1-D): sharding, positions, ring attention."""

    def __init__(self, cp_mesh: DeviceMesh) -> None:
        if cp_mesh.ndim != 1:
            raise ValueError(f"cp_mesh: expected a 1-D mesh, got {cp_mesh.ndim} dims")
        self.group = cp_mesh.get_group()
        self.size = cp_mesh.size()
        self.rank = cp_mesh.get_local_rank()
        ranks = dist.get_process_group_ranks(self.group)
        self.next_rank = ranks[(self.rank + 1) % self.size]
        self.prev_rank = ranks[(self.rank - 1) % self.size]

    def shard(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's load-balanced part of ``t`` along ``dim`` (the sequence): (..., seq, ...) -> (..., seq/cp, ...)."""
        idx = zigzag_indices(t.shape[dim], self.size, self.rank, t.device)
        return t.index_select(dim, idx)

    def position_ids(self, local_seq: int, device) -> torch.Tensor:
        """Rotary positions (int64, (local_seq,)) of the local tokens of a sequence of ``local_seq * cp``."""
        return zigzag_indices(local_seq * self.size, self.size, self.rank, device)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 softmax_scale: float | None = None) -> torch.Tensor:
        """Causal attention of the local queries over the whole sequence.

        q (batch, seq/cp, n_heads, head_dim), k (batch, seq/cp, n_kv_heads, head_dim), v (batch,
        seq/cp, n_kv_heads, head_dim_v), this rank's zigzag part (v's head_dim may differ from q/k's);
        ``softmax_scale`` None = 1 / sqrt(head_dim). Returns (batch, seq/cp, n_heads, head_dim_v) in
        q.dtype. Differentiable.
        """
        return _ring_apply(q, k, v, self, softmax_scale)

    def _exchange(self, send: torch.Tensor, recv: torch.Tensor) -> list:
        ops = [dist.P2POp(dist.isend, send, self.next_rank, self.group),
               dist.P2POp(dist.irecv, recv, self.prev_rank, self.group)]
        return dist.batch_isend_irecv(ops)


def _wait(works) -> None:
    for w in works:
        w.wait()


def _block(r: int, j: int, c: int) -> tuple[slice, slice, bool]:
    """(query rows, key rows, causal) of the local queries against the K/V block of rank j."""
    full = slice(None)
    if j == r:
        return full, full, True
    if j < r:
        return full, slice(0, c), False
    return slice(c, None), full, False


@torch._dynamo.disable  # point-to-point communication inside: runs eagerly between compiled regions
def _ring_apply(q, k, v, cp, softmax_scale=None):
    return _RingAttention.apply(q, k, v, cp, softmax_scale)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp: ContextParallel, softmax_scale):
        n, r = cp.size, cp.rank
        b, s, h, d = q.shape
        dk = k.shape[-1]
        c = s // 2
        scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
        out = torch.zeros(b, s, h, v.shape[-1], dtype=torch.float32, device=q.device)
        lse = torch.full((b, h, s), -math.inf, dtype=torch.float32, device=q.device)
        kv = torch.cat([k, v], -1)  # one buffer travels; v's head_dim may differ from k's (MLA)
        for step in range(n):
            works, nxt = [], None
            if step < n - 1:
                nxt = torch.empty_like(kv)
                works = cp._exchange(kv, nxt)
            rows, cols, causal = _block(r, (r - step) % n, c)
            o_blk, l_blk = titan_kernels.flash_attn(
                q[:, rows], kv[:, cols, :, :dk], kv[:, cols, :, dk:], causal=causal, softmax_scale=scale,
                return_lse=True
            )
            l_old = lse[:, :, rows]
            l_new = torch.logaddexp(l_old, l_blk)
            w_old = torch.exp(l_old - l_new).transpose(1, 2).unsqueeze(-1)
            w_blk = torch.exp(l_blk - l_new).transpose(1, 2).unsqueeze(-1)
            out[:, rows] = out[:, rows] * w_old + o_blk.float() * w_blk
            lse[:, :, rows] = l_new
            _wait(works)
            if nxt is not None:
                kv = nxt
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.scale = cp, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cp, scale = ctx.cp, ctx.scale
        n, r = cp.size, cp.rank
        c = q.shape[1] // 2
        dk = k.shape[-1]
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.cat([k, v], -1)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # travels with its K/V block
        for step in range(n):
            works, nxt = [], None
            if step < n - 1:
                nxt = torch.empty_like(kv)
                works = cp._exchange(kv, nxt)
            rows, cols, causal = _block(r, (r - step) % n, c)
            dq_b, dk_b, dv_b = torch.ops.titan.flash_attn_backward(
                dout[:, rows], q[:, rows], kv[:, cols, :, :dk], kv[:, cols, :, dk:], out[:, rows], lse[:, :, rows],
                None, None, None, 0, 0, causal, scale, False, "",
            )
            dq[:, rows] += dq_b
            dkv[:, cols, :, :dk] += dk_b
            dkv[:, cols, :, dk:] += dv_b
            # The block's gradient moves on with it; after n hops each one is back at its owner.
            dkv_next = torch.empty_like(dkv)
            _wait(works + cp._exchange(dkv, dkv_next))
            dkv = dkv_next
            if nxt is not None:
                kv = nxt
        return dq.to(q.dtype), dkv[..., :dk].to(k.dtype), dkv[..., dk:].to(v.dtype), None, None


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh) -> ContextParallel:
    """Make every attention layer of ``model`` (a Transformer or a pipeline stage) context parallel
    over ``cp_mesh``; returns the ContextParallel object (its ``shard`` splits the batches)."""
    cp = ContextParallel(cp_mesh)
    for block in model.blocks() if hasattr(model, "blocks") else model.layers.values():  # also a family's MTP blocks
        block.attention.context_parallel = cp
    return cp
