"""The decoder shared by the model families (Llama 3, Qwen3 dense and MoE): attention, feed-forward,
the pre-norm block, the model, its layout-independent initialisation and the token losses.

The families agree on everything here; what differs is read from their args
(``trainer.models.llama_args.ModelArgs``, ``trainer.models.qwen3_args.Qwen3Args``):

  head_dim             Llama: dim / n_heads; Qwen3: its own (128), so wq is (n_heads * head_dim, dim)
  qk_norm              Qwen3: ``attention.q_norm`` / ``k_norm``, RMSNorm(head_dim) on every head of q
                       and k before the rotary (absent for Llama: same state dict as before)
  moe_layer(i), moe    Qwen3 MoE: block i's ``feed_forward`` is a ``trainer.models.moe.MoE``
  rope_theta/scaling, norm_eps, tie_word_embeddings, vocab_size

Parameter names are the same for every family (``layers.{i}.attention.wq.weight``, ...), so tensor
parallel, activation checkpointing, FSDP2, pipeline stages and checkpoints treat them alike.
``trainer.models.llama`` and ``trainer.models.qwen3`` re-export these and add their flavors and
Hugging Face layouts.
"""
from __future__ import annotations

import math
import re
import zlib

import torch
import torch.nn.functional as F
from torch import nn

import titan_kernels
from titan_kernels.nn import AddRMSNorm, RMSNorm, RotaryEmbedding

class Attention(nn.Module):
    """Grouped-query attention (Ainslie et al. 2023) with rotary on q and k.

    Shapes: x (batch, seq, dim); rope: the model's RotaryEmbedding (interleaved layout); position_ids
    (batch, seq) int64 or None. With position_ids, tokens attend only inside their document (a
    document starts where position_ids is 0), and rotary uses those positions. The attention is
    ``titan_kernels.flash_attn`` (causal), or ``flash_attn_varlen`` over the documents with
    ``cu_seqlens`` from ``document_cu_seqlens(position_ids)`` (computed here when not given).
    """

    def __init__(self, args) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)
        # QK-norm (Qwen3, ``args.qk_norm``): one RMSNorm over head_dim, shared by the heads, on q and k
        # before the rotary. None for Llama (no parameters, same state dict).
        qk_norm = getattr(args, "qk_norm", False)
        self.q_norm = RMSNorm(self.head_dim, eps=args.norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps=args.norm_eps) if qk_norm else None
        # Set by trainer.parallel.context_parallel: this rank holds part of every sequence; it gives
        # the rotary positions of the local tokens and runs causal attention over the whole sequence.
        self.context_parallel = None

    def forward(
        self,
        x: torch.Tensor,
        rope: RotaryEmbedding,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # -1 heads: under tensor parallel each rank holds n_heads / tp of them.
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.context_parallel is not None:
            q, k = rope(q, k, self.context_parallel.position_ids(seq, q.device))
            return self.wo(self.context_parallel(q, k, v).reshape(bsz, seq, -1))
        q, k = rope(q, k, position_ids)
        if position_ids is None:
            out = titan_kernels.flash_attn(q, k, v, causal=True)
        else:
            if cu_seqlens is None:
                cu_seqlens = document_cu_seqlens(position_ids)
            # No document is longer than a row, so seq bounds max_seqlen without reading cu_seqlens.
            out = titan_kernels.flash_attn_varlen(
                q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_seqlens, cu_seqlens, seq, seq, causal=True
            )
        return self.wo(out.reshape(bsz, seq, -1))


def document_cu_seqlens(position_ids: torch.Tensor) -> torch.Tensor:
    """Document boundaries of a packed batch for ``flash_attn_varlen``: int32 (n_docs + 1,) offsets
    into the batch flattened row by row. A document starts where position_ids is 0 (the loader's
    packing restarts positions there) and at every row start (rows never share a document)."""
    starts = position_ids == 0
    starts[:, 0] = True
    first = starts.flatten().nonzero().flatten()
    total = first.new_full((1,), position_ids.numel())
    return torch.cat([first, total]).to(torch.int32)


class FeedForward(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): ``w2(silu(w1 x) * w3 x)``; x (..., dim) -> (..., dim).

    ``silu(.) * .`` is one fused titan op (forward and backward one kernel each). w1 and w3 stay two
    matmuls: one fused (2·hidden, dim) matmul measured no faster at the debugmodel's shape on the
    CPU (bench/bench_swiglu.py, ``ffn_variants``), and separate w1/w3 keep the checkpoint names and
    the tensor-parallel plan.
    """

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(titan_kernels.swiglu(self.w1(x), self.w3(x)))


class TransformerBlock(nn.Module):
    """Pre-norm block; the residual add before the feed-forward norm is one fused titan op."""

    def __init__(self, layer_id: int, args) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = AddRMSNorm(args.dim, eps=args.norm_eps)
        # Shared by the families: a mixture of experts where the args say so (Qwen3 MoE), same call.
        moe_layer = getattr(args, "moe_layer", None)
        if moe_layer is not None and moe_layer(layer_id):
            from trainer.models.moe import MoE

            self.feed_forward = MoE(args.dim, args.moe)
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)

    def forward(
        self,
        x: torch.Tensor,
        rope: RotaryEmbedding,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        attn = self.attention(self.attention_norm(x), rope, position_ids, cu_seqlens)
        ffn_in, h = self.ffn_norm(attn, x)
        return h + self.feed_forward(ffn_in)


class Transformer(nn.Module):
    """The decoder (Llama 3, Qwen3). ``forward(tokens (batch, seq) int64, position_ids=None) -> logits (batch, seq, vocab_size)``.

    Logits come in the parameters' (compute) dtype; compute the loss in float32 (``cross_entropy_loss``).
    With ``return_hidden = True`` (the trainer's default) the forward stops after the final norm and
    returns its hidden states (batch, seq, dim): the loss applies the output projection itself
    (``linear_cross_entropy_loss`` with ``output_weight()``), so the logits are never materialized.
    Layers live in a ModuleDict keyed "0".."n-1" so that parameter names stay the same when a
    pipeline stage drops some of them. A pipeline stage without ``tok_embeddings`` takes the hidden
    states (batch, seq, dim) of the stage before; one without ``norm`` and ``output`` returns its
    hidden states.
    """

    def __init__(self, args) -> None:
        super().__init__()
        args._need_vocab()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        # Tied (Llama 3.2): the output projection is tok_embeddings.weight itself, so there is one
        # parameter whatever happens to the module (to_empty, FSDP) and nothing to re-tie.
        self.output = None if args.tie_word_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        # One table for all blocks, passed to them as a module (not as tensors, which FSDP2's
        # mixed precision would cast to bf16). Its cos/sin buffers are not in the state dict.
        self.rope = RotaryEmbedding(
            args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling, interleaved=True
        )
        # The last stage returns the final-norm hidden states instead of the logits (class docstring).
        self.return_hidden = False

    def output_weight(self) -> torch.Tensor:
        """The output projection's weight (vocab_size, dim): ``output.weight``, or the embedding when tied."""
        return self.output.weight if self.output is not None else self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if self.tok_embeddings is None:  # a later pipeline stage: hidden states in
            if tokens.dim() != 3:
                raise ValueError(f"tokens: a pipeline stage expects hidden states (batch, seq, dim), got {tuple(tokens.shape)}")
        elif tokens.dim() != 2:
            raise ValueError(f"tokens: expected shape (batch, seq), got {tuple(tokens.shape)}")
        if tokens.shape[1] > self.args.max_seq_len:
            raise ValueError(f"tokens: sequence length {tokens.shape[1]} exceeds max_seq_len={self.args.max_seq_len}")
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        # Document boundaries once per batch, outside the (compiled) blocks: their count is data-dependent.
        cu_seqlens = document_cu_seqlens(position_ids) if position_ids is not None else None
        for layer in self.layers.values():
            h = layer(h, self.rope, position_ids, cu_seqlens)
        if self.norm is None:  # not the last pipeline stage
            return h
        h = self.norm(h)
        if self.return_hidden:
            return h
        if self.output is None:
            return F.linear(h, self.tok_embeddings.weight)
        return self.output(h)

    # -- initialization --

    def param_init_std(self, name: str) -> float | None:
        """Init standard deviation of parameter ``name``; None for norm weights (ones)."""
        if name.endswith("norm.weight"):
            return None
        # Residual output projections: attention.wo, the FFN's (or MoE shared experts') w2, the routed experts' w2.
        m = re.match(r"layers\.(\d+)\.(attention\.wo\.weight|feed_forward\.(shared_experts\.)?w2\.weight|"
                     r"feed_forward\.experts\.w2)$", name)
        if m:
            depth = 2 * (int(m.group(1)) + 1) if self.args.depth_init else 2 * self.args.n_layers
            return self.args.init_std / math.sqrt(depth)
        return self.args.init_std

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill every parameter and buffer; the result is the same for any sharding of the parameters.

        Weights: normal(0, std) truncated at +-3 std (``param_init_std``); norm weights: ones. Each
        parameter is drawn whole on its device from a generator seeded by (seed, name), then each rank
        keeps its own shard (DTensor parameters, e.g. under FSDP2). Costs one full parameter of
        temporary memory at a time. The rotary tables are recomputed where they are.

        Raises RuntimeError if the model is still on the meta device (call ``to_empty`` first).
        """
        from torch.distributed.tensor import DTensor, distribute_tensor

        if any(t.device.type == "meta" for t in (*self.parameters(), *self.buffers())):
            raise RuntimeError("init_weights: the model is still on the meta device; call to_empty(device=...) first")
        for name, param in self.named_parameters():
            is_dt = isinstance(param, DTensor)
            local = param.to_local() if is_dt else param
            full = torch.empty(param.shape, dtype=param.dtype, device=local.device)
            std = self.param_init_std(name)
            if std is None:
                full.fill_(1.0)
            else:
                gen = torch.Generator(device=local.device)
                gen.manual_seed(_param_seed(seed, name))
                _trunc_normal_(full, std, gen)
            if is_dt:
                full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.copy_(full)
        self.rope.reset_parameters()
        for module in self.modules():  # buffers of other modules, e.g. the MoE load-balancing bias
            if hasattr(module, "reset_buffers"):
                module.reset_buffers()


def _trunc_normal_(t: torch.Tensor, std: float, gen: torch.Generator) -> None:
    """Normal(0, std) truncated to +-3 std, by redrawing the ~0.3% of values outside (exact, and
    several times faster on CPU than the inverse-CDF method of nn.init.trunc_normal_)."""
    t.normal_(0.0, std, generator=gen)
    flat = t.view(-1)
    while True:
        out = (flat.abs() > 3 * std).nonzero().squeeze(1)
        if out.numel() == 0:
            return
        flat[out] = torch.empty(out.numel(), dtype=t.dtype, device=t.device).normal_(0.0, std, generator=gen)


def _param_seed(seed: int, name: str) -> int:
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def build_model(args, device: torch.device | str = "meta") -> Transformer:
    """A Transformer for ``args`` on ``device`` (default meta: no memory; call to_empty + init_weights)."""
    with torch.device(device):
        return Transformer(args)


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Sum of token cross-entropies in float32.

    logits (batch, seq, vocab) any float dtype; labels (batch, seq) int64, ``ignore_index`` skipped.
    Returns a float32 scalar: the SUM over tokens (the caller divides by the global token count so
    that gradient accumulation and data parallelism give the gradient of one big batch).
    """
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=ignore_index, reduction="sum"
    )


def linear_cross_entropy_loss(
    model: Transformer, hidden: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """``cross_entropy_loss`` of the logits ``model.output_weight()`` would give, without making them.

    hidden (batch, seq, dim): the final-norm hidden states of ``model`` (or of its last pipeline
    stage) with ``return_hidden``; labels (batch, seq) int64, ``ignore_index`` skipped. Read right
    after that forward, while the output weight is gathered (FSDP2 keeps the root's parameters from
    forward to backward). Returns the float32 SUM over tokens, computed chunk by chunk by
    ``titan_kernels.linear_cross_entropy``; under tensor parallel (the output weight split on the
    vocabulary) its vocab-parallel loss, a replicated DTensor.
    """
    return titan_kernels.linear_cross_entropy(
        hidden, model.output_weight(), labels, ignore_index=ignore_index, reduction="sum"
    )
