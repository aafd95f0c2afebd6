"""Grouped-query attention of the shared decoder (Llama 3, Qwen3, ...), the document boundaries of a
packed batch, and its tensor-parallel plan.

``Attention(args, layer_id)``: wq/wk/wv/wo projections (``args.head_dim`` per head, which need not be
dim / n_heads), optional QK-norm (Qwen3: one RMSNorm over head_dim shared by the heads, on q and k
before the rotary), rotary from the model's table, and ``titan_kernels.flash_attn`` with the layer's
mask (``args.attention_window(layer_id)``: causal, a sliding window or a chunk).
"""
from __future__ import annotations

import torch
from torch import nn

import titan_kernels
from titan_kernels.nn import RMSNorm, RotaryEmbedding


def document_cu_seqlens(position_ids: torch.Tensor) -> torch.Tensor:
    """Document boundaries of a packed batch for ``flash_attn_varlen``: int32 (n_docs + 1,) offsets
    into the batch flattened row by row. A document starts where position_ids is 0 (the loader's
    packing restarts positions there) and at every row start (rows never share a document)."""
    starts = position_ids == 0
    starts[:, 0] = True
    first = starts.flatten().nonzero().flatten()
    total = first.new_full((1,), position_ids.numel())
    return torch.cat([first, total]).to(torch.int32)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position_ids: torch.Tensor | None,
           cu_seqlens: torch.Tensor | None, mask: dict, softmax_scale: float | None = None,
           sinks: torch.Tensor | None = None, max_logit: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of q (batch, seq, heads, qk_head_dim) over k/v (batch, seq, kv_heads, .) with
    the layer's ``mask`` (flash_attn's window_size / chunk_size keywords, empty for plain causal) and
    its ``sinks`` (heads,) if any: dense, or over the documents of a packed batch when
    ``position_ids`` are given (``cu_seqlens`` from ``document_cu_seqlens``, computed here when not
    given). Returns (batch, seq, heads, v_head_dim).

    ``max_logit`` (QK-clip, ``trainer.optim.qk_clip``): a (heads,) float32 buffer updated in place with
    the running max over the rows of each head's log-sum-exp, an upper bound of its max logit."""
    if sinks is not None:
        mask = {**mask, "sinks": sinks}
    lse = max_logit is not None
    if position_ids is None:
        out = titan_kernels.flash_attn(q, k, v, causal=True, softmax_scale=softmax_scale, return_lse=lse, **mask)
    else:
        bsz, seq = q.shape[:2]
        if cu_seqlens is None:
            cu_seqlens = document_cu_seqlens(position_ids)
        # No document is longer than a row, so seq bounds max_seqlen without reading cu_seqlens.
        out = titan_kernels.flash_attn_varlen(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_seqlens,
                                              cu_seqlens, seq, seq, causal=True, softmax_scale=softmax_scale,
                                              return_lse=lse, **mask)
    if lse:
        out, lse = out  # (batch, heads, seq), or (heads, tokens) over the documents
        rows = lse.detach().transpose(0, 1).flatten(1) if position_ids is None else lse.detach()
        max_logit.copy_(torch.maximum(max_logit, rows.amax(dim=1)))
    return out if position_ids is None else out.view(bsz, seq, *out.shape[1:])


def layer_mask(args, layer_id: int) -> dict:
    """flash_attn's mask keywords for layer ``layer_id`` (empty for plain causal, so that the call is
    today's fast path)."""
    (left, right), chunk = args.attention_window(layer_id)
    mask = {}
    if left >= 0:
        mask["window_size"] = (left, right)
    if chunk:
        mask["chunk_size"] = chunk
    return mask


class Attention(nn.Module):
    """Grouped-query attention (Ainslie et al. 2023) with rotary on q and k.

    Shapes: x (batch, seq, dim); rope: the model's RotaryEmbedding (interleaved layout); position_ids
    (batch, seq) int64 or None. With position_ids, tokens attend only inside their document (a
    document starts where position_ids is 0), and rotary uses those positions. The attention is
    ``titan_kernels.flash_attn`` (causal, with the layer's window or chunk), or ``flash_attn_varlen``
    over the documents with ``cu_seqlens`` from ``document_cu_seqlens(position_ids)``. With
    ``args.attention_bias`` the projections have biases; with ``args.attention_sinks`` each head has a
    learned sink logit ``sinks`` (n_heads,) in its softmax (GPT-OSS).
    """

    def __init__(self, args, layer_id: int = 0) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.kv_heads, args.head_dim
        bias = args.attention_bias
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps=args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps=args.norm_eps) if args.qk_norm else None
        self.sinks = nn.Parameter(torch.empty(self.n_heads, dtype=torch.float32)) if args.attention_sinks else None
        self.mask = layer_mask(args, layer_id)
        # Set by trainer.parallel.context_parallel: this rank holds part of every sequence; it gives
        # the rotary positions of the local tokens and runs attention over the whole sequence.
        self.context_parallel = None
        # Set by QK-clip (trainer.optim.qk_clip): (local heads,) float32 max-logit bounds (``attend``).
        self.register_buffer("max_logit", None, persistent=False)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, position_ids: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # -1 heads: under tensor parallel each rank holds n_heads / tp of them.
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        sinks = self.local_sinks()
        if self.context_parallel is not None:
            q, k = rope(q, k, self.context_parallel.position_ids(seq, q.device))
            extra = {"sinks": sinks} if sinks is not None else {}
            return self.wo(self.context_parallel(q, k, v, **self.mask, **extra).reshape(bsz, seq, -1))
        q, k = rope(q, k, position_ids)
        out = attend(q, k, v, position_ids, cu_seqlens, self.mask, sinks=sinks, max_logit=self.max_logit)
        return self.wo(out.reshape(bsz, seq, -1))

    def local_sinks(self) -> torch.Tensor | None:
        """The sink logits of this rank's heads (float32): under tensor parallel a head-sharded DTensor's
        local part, whose gradient stays this rank's."""
        s = self.sinks
        if s is None:
            return None
        return (s.to_local() if hasattr(s, "to_local") else s).float()

    def tp_plan(self) -> dict:
        """Tensor + sequence parallel (Megatron's split): the input all-gathered on the sequence, wq/wk/
        wv colwise (this rank's heads), wo rowwise with its output reduce-scattered onto the
        sequence; the QK-norms run on this rank's heads (dim 2 sharded, weight replicated)."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            RowwiseParallel,
            SequenceParallel,
        )

        plan = {
            "": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                   desired_input_layouts=(Replicate(), None, None, None)),
            "wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(),
            "wo": RowwiseParallel(output_layouts=Shard(1)),
        }
        if self.q_norm is not None:
            plan["q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan["k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        return plan

    def tp_finish(self, tp_mesh) -> None:
        """The sinks split on the heads like wq's rows (``Shard(0)``); the forward uses the local part."""
        if self.sinks is not None:
            from torch.distributed.tensor import Shard, distribute_tensor

            s = self.sinks
            self.sinks = nn.Parameter(distribute_tensor(s.data, tp_mesh, [Shard(0)], src_data_rank=None),
                                      requires_grad=s.requires_grad)
