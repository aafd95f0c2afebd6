"""Context parallel: every sequence is split over the ``cp`` ranks; attention is ring attention.

Load balancing (the "zigzag" split, as in Llama 3's context parallel and torchtitan): the sequence
is cut into ``2 * cp`` equal chunks of c tokens and rank r holds chunks ``r`` and ``2*cp - 1 - r``,
one from each end. Under a causal mask the early chunks attend to little and the late ones to much,
so every rank gets the same attention work. ``ContextParallel.shard`` splits a (batch, seq) tensor
this way; the tokens, labels and the rotary positions of a rank all come from the same two chunks
(``position_ids``: the global positions of the local tokens).

Ring attention (Liu et al., "Ring Attention with Blockwise Transformers", 2023; the causal zigzag
schedule of Zhu's ring-flash-attention): at step s = 0 .. cp-1 each rank attends its queries to the
K/V block of rank r - s (mod cp), received point-to-point while the previous step computes. Each
(query chunk, key chunk) pair is one ``titan_kernels.flash_attn`` call returning its log-sum-exp,
with the layer's mask moved into the pair's frame (``trainer.parallel.cp_schedule``, torch-free, so
that the communication estimate counts the same blocks): a chunk pair at distance D = Q0 - K0 sees
key j from query i when ``D - left <= j - i <= D + right`` (window, causal = right 0), which is a
window of the call after trimming the rows and keys that see nothing. Pairs that see nothing
are skipped, and a K/V block that no pair of its receiver sees is neither sent nor computed on (a
sliding window shorter than the chunk distance, or the causal upper triangle). The partial outputs
merge exactly through the LSEs (Milakov & Gimelshein 2018: out = sum_i exp(lse_i - lse) out_i,
lse = logsumexp_i lse_i). Sinks join each row's softmax once, after the merge (the epilogue of
``titan_kernels.apply_attention_sinks``); soft-capping applies per score in every call; chunked
attention needs the attention chunk to be a multiple of c or to divide it (``cp_schedule.pair``).

The backward receives the K/V blocks again and sends each block's gradient back to its owner
(point-to-point, float32): each pair's gradients come from the ``titan::flash_attn_backward`` op
given the final output and LSE (FlashAttention-2's backward needs only those; with sinks, out' and
lse', which make it exact), and the sinks' gradient is computed once from them.

Communication per attention call (forward): at most ``cp - 1`` blocks of this rank's K and V,
batch * (seq / cp) * n_kv_heads * (head_dim + head_dim_v) values each, one per step whose receiver
sees it; the backward twice that (K/V again plus their gradients). See trainer/parallel/README.md.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import titan_kernels
from titan_kernels import (
    AttentionArgs, apply_attention_sinks, attention_sinks_grad, capture_request, check_chunk, check_softcap, check_window,
)
from trainer.parallel import cp_schedule


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


def check_cp_chunks(args, seq_len: int, cp: int, key: str = "training.seq_len") -> None:
    """Raise ValueError (naming ``key``) unless every chunked layer's attention chunk is a multiple or a
    divisor of the zigzag chunk seq_len / (2 cp) (the ring's pairs lie in one attention chunk or in
    whole ones, ``cp_schedule.pair``), so that a layout that cannot run says so before the first step."""
    if cp == 1 or seq_len % (2 * cp):
        return  # one rank, or the divisibility error of the config check
    c = seq_len // (2 * cp)
    for i in range(args.n_layers):
        _, chunk = args.attention_window(i)
        if chunk and chunk % c and c % chunk:
            raise ValueError(f"{key}: with context_parallel_degree {cp} each rank holds chunks of {seq_len} / {2 * cp} "
                             f"= {c} tokens, which the attention chunk {chunk} of layer {i} neither divides nor is a "
                             f"multiple of; choose a sequence length with that")


class ContextParallel:
    """This rank's part of context parallel over ``cp_mesh`` (1-D): sharding, positions, ring attention."""

    def __init__(self, cp_mesh: DeviceMesh) -> None:
        if cp_mesh.ndim != 1:
            raise ValueError(f"cp_mesh: expected a 1-D mesh, got {cp_mesh.ndim} dims")
        self.group = cp_mesh.get_group()
        self.size = cp_mesh.size()
        self.rank = cp_mesh.get_local_rank()
        self.ranks = dist.get_process_group_ranks(self.group)

    def shard(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's load-balanced part of ``t`` along ``dim`` (the sequence): (..., seq, ...) -> (..., seq/cp, ...)."""
        idx = zigzag_indices(t.shape[dim], self.size, self.rank, t.device)
        return t.index_select(dim, idx)

    def position_ids(self, local_seq: int, device) -> torch.Tensor:
        """Rotary positions (int64, (local_seq,)) of the local tokens of a sequence of ``local_seq * cp``."""
        return zigzag_indices(local_seq * self.size, self.size, self.rank, device)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                 softmax_scale: float | None = None, window_size=(-1, -1), sinks: torch.Tensor | None = None,
                 softcap: float = 0.0, chunk_size: int | None = None) -> torch.Tensor:
        """Attention of the local queries over the whole sequence, with ``titan_kernels.flash_attn``'s
        mask and options (positions are the global ones).

        q (batch, seq/cp, n_heads, head_dim), k (batch, seq/cp, n_kv_heads, head_dim), v (batch,
        seq/cp, n_kv_heads, head_dim_v), this rank's zigzag part (v's head_dim may differ from q/k's);
        sinks (n_heads,) or None. Returns (batch, seq/cp, n_heads, head_dim_v) in q.dtype.
        Differentiable (q, k, v, sinks). Raises ValueError for a chunk_size that is neither a multiple
        nor a divisor of the zigzag chunk (seq / (2 cp)), and as ``flash_attn`` for bad arguments.
        """
        left, right = check_window(window_size, bool(causal))
        c = q.shape[1] // 2
        chunk = check_chunk(chunk_size)
        if chunk and chunk % c and c % chunk:
            raise ValueError(f"chunk_size: context parallel needs a multiple or a divisor of the zigzag chunk "
                             f"(seq / (2 cp) = {c}), got {chunk}")
        scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
        a = AttentionArgs(scale, left, right, check_softcap(softcap), chunk)
        return _ring_apply(q, k, v, sinks, a, self)

    def _p2p(self, sends: list, recvs: list) -> list:
        """Post point-to-point sends [(tensor, group rank)] and receives [(buffer, group rank)]."""
        ops = [dist.P2POp(dist.isend, t, self.ranks[p], self.group) for t, p in sends]
        ops += [dist.P2POp(dist.irecv, t, self.ranks[p], self.group) for t, p in recvs]
        return dist.batch_isend_irecv(ops) if ops else []


def _wait(works) -> None:
    for w in works:
        w.wait()


def _calls(r: int, j: int, n: int, c: int, a: AttentionArgs) -> list:
    """The calls of rank r's queries on rank j's K/V block: [(local rows, local keys, args)]
    (``trainer.parallel.cp_schedule.calls``, with the layer's scale and soft-capping)."""
    return [(k.rows, k.keys, AttentionArgs(a.scale, k.left, k.right, a.softcap, k.chunk))
            for k in cp_schedule.calls(r, j, n, c, a.left, a.right, a.chunk)]


@torch._dynamo.disable  # point-to-point communication inside: runs eagerly between compiled regions
def _ring_apply(q, k, v, sinks, a, cp):
    return _RingAttention.apply(q, k, v, sinks, a, cp)


def _schedule(cp: ContextParallel, c: int, a: AttentionArgs) -> tuple:
    """Per step s: (source rank, calls on its block, whether this rank sends its block to r + s)."""
    return _schedule_of(cp.size, cp.rank, c, a)


@functools.lru_cache(maxsize=256)  # per (ring, rank, chunk, mask): every layer and step of a run asks again
def _schedule_of(n: int, r: int, c: int, a: AttentionArgs) -> tuple:
    return tuple(((r - s) % n, tuple(_calls(r, (r - s) % n, n, c, a)), s == 0 or bool(_calls((r + s) % n, r, n, c, a)))
                 for s in range(n))


def _exchange(cp, steps, s, kv):
    """Post step s's transfers (s >= 1): this rank's block to r + s if it needs it, the block of
    r - s if this rank needs it. Returns (works, receive buffer or None)."""
    n, r = cp.size, cp.rank
    src, calls, send = steps[s]
    buf = torch.empty_like(kv) if calls else None
    works = cp._p2p([(kv, (r + s) % n)] if send else [], [(buf, src)] if calls else [])
    return works, buf


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, a: AttentionArgs, cp: ContextParallel):
        b, s, h, _ = q.shape
        dk = k.shape[-1]
        c = s // 2
        out = torch.zeros(b, s, h, v.shape[-1], dtype=torch.float32, device=q.device)
        lse = torch.full((b, h, s), -math.inf, dtype=torch.float32, device=q.device)
        kv = torch.cat([k, v], -1)  # one buffer travels; v's head_dim may differ from k's (MLA)
        steps = _schedule(cp, c, a)
        pending = _exchange(cp, steps, 1, kv) if cp.size > 1 else ([], None)
        for step in range(cp.size):
            if step == 0:
                blk = kv
            else:
                _wait(pending[0])
                blk = pending[1]
                pending = _exchange(cp, steps, step + 1, kv) if step + 1 < cp.size else ([], None)
            for rows, keys, pa in steps[step][1]:
                o_blk, l_blk = titan_kernels.flash_attn(
                    q[:, rows], blk[:, keys, :, :dk], blk[:, keys, :, dk:], causal=False, softmax_scale=pa.scale,
                    window_size=(pa.left, pa.right), softcap=pa.softcap, chunk_size=pa.chunk or None,
                    return_lse=True)
                l_old = lse[:, :, rows]
                l_new = torch.logaddexp(l_old, l_blk)
                # Rows that saw nothing yet and nothing now stay -inf (weights 0, not nan).
                safe = torch.where(torch.isinf(l_new), torch.zeros_like(l_new), l_new)
                w_old = torch.exp(l_old - safe).transpose(1, 2).unsqueeze(-1)
                w_blk = torch.exp(l_blk - safe).transpose(1, 2).unsqueeze(-1)
                out[:, rows] = out[:, rows] * w_old + o_blk.float() * w_blk
                lse[:, :, rows] = l_new
        if sinks is not None:
            out, lse = apply_attention_sinks(out, lse, sinks, False)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        # The backward runs the backend this forward's request named (the request, not the choice).
        ctx.cp, ctx.a, ctx.backend = cp, a, capture_request("flash_attn")
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        cp, a = ctx.cp, ctx.a
        n, r = cp.size, cp.rank
        c = q.shape[1] // 2
        dk = k.shape[-1]
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.cat([k, v], -1)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        steps = _schedule(cp, c, a)
        pending = _exchange(cp, steps, 1, kv) if n > 1 else ([], None)
        for step in range(n):
            if step == 0:
                blk = kv
            else:
                _wait(pending[0])
                blk = pending[1]
                pending = _exchange(cp, steps, step + 1, kv) if step + 1 < n else ([], None)
            part = dkv if step == 0 else (torch.zeros_like(dkv) if steps[step][1] else None)
            for rows, keys, pa in steps[step][1]:
                dq_b, dk_b, dv_b, _ = torch.ops.titan.flash_attn_backward(
                    dout[:, rows], q[:, rows], blk[:, keys, :, :dk], blk[:, keys, :, dk:], out[:, rows],
                    lse[:, :, rows], None, None, None, None, *pa.op_args(), ctx.backend)
                dq[:, rows] += dq_b
                part[:, keys, :, :dk] += dk_b
                part[:, keys, :, dk:] += dv_b
            if step:  # the block's gradient goes back to its owner; this rank's comes from r + step
                src, calls, send = steps[step]
                back = torch.empty_like(dkv) if send else None
                _wait(cp._p2p([(part, src)] if calls else [], [(back, (r + step) % n)] if send else []))
                if back is not None:
                    dkv += back
        dsinks = None
        if sinks is not None:
            dsinks = attention_sinks_grad(dout, out, lse, None, sinks, False)
        return dq.to(q.dtype), dkv[..., :dk].to(k.dtype), dkv[..., dk:].to(v.dtype), dsinks, None, None


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh) -> ContextParallel:
    """Make every attention layer of ``model`` (a Transformer or a pipeline stage) context parallel
    over ``cp_mesh``; returns the ContextParallel object (its ``shard`` splits the batches)."""
    cp = ContextParallel(cp_mesh)
    for block in model.blocks() if hasattr(model, "blocks") else model.layers.values():  # also a family's MTP blocks
        block.attention.context_parallel = cp
    return cp
