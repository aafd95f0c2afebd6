"""The decoder shared by the model families: the pre-norm block, the model, its layout-independent
initialisation, and the tensor-parallel plan of a block.

Parameter names are the same for every family that uses it (``layers.{i}.attention.wq.weight``,
...), so tensor parallel, activation checkpointing, FSDP2, pipeline stages and checkpoints treat them
alike. A family changes a block's parts by subclassing: ``TransformerBlock.make_attention`` /
``make_feed_forward`` build them (the shared GQA ``Attention``; a ``FeedForward``, or a
``trainer.models.common.moe.MoE`` where ``args.moe_layer(i)``), and ``Transformer.block_cls`` names the block.
What the modules read of the args is the typed interface of ``trainer.models.common.args.ModelArgs``.
"""
from __future__ import annotations

import math
import re
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from titan_kernels.nn import AddRMSNorm, RMSNorm, RotaryEmbedding
from trainer.models.common.attention import Attention, document_cu_seqlens
from trainer.models.common.feed_forward import FeedForward
from trainer.models.common.losses import linear_cross_entropy_loss


class TransformerBlock(nn.Module):
    """Pre-norm block; the residual add before the feed-forward norm is one fused titan op."""

    def __init__(self, layer_id: int, args) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = self.make_attention(layer_id, args)
        self.ffn_norm = AddRMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = self.make_feed_forward(layer_id, args)

    def make_attention(self, layer_id: int, args) -> nn.Module:
        return Attention(args, layer_id)

    def make_feed_forward(self, layer_id: int, args) -> nn.Module:
        """A mixture of experts where the args say so, else the dense SwiGLU."""
        if args.moe_layer(layer_id):
            from trainer.models.common.moe import MoE

            return MoE(args.dim, args.moe)
        return FeedForward(args.dim, args.ffn_hidden_dim)

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
    """The decoder. ``forward(tokens (batch, seq) int64, position_ids=None) -> logits (batch, seq, vocab_size)``.

    Logits come in the parameters' (compute) dtype; compute the loss in float32 (``cross_entropy_loss``).
    With ``return_hidden = True`` (the trainer's default) the forward stops after the final norm and
    returns its hidden states (batch, seq, dim): the loss applies the output projection itself
    (``linear_cross_entropy_loss`` with ``output_weight()``), so the logits are never materialized.
    Layers live in a ModuleDict keyed "0".."n-1" so that parameter names stay the same when a
    pipeline stage drops some of them. A pipeline stage without ``tok_embeddings`` takes the hidden
    states (batch, seq, dim) of the stage before; one without ``norm`` and ``output`` returns its
    hidden states.
    """

    block_cls = TransformerBlock

    def __init__(self, args) -> None:
        super().__init__()
        args._need_vocab()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): self.block_cls(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        # Tied (Llama 3.2): the output projection is tok_embeddings.weight itself, so there is one
        # parameter whatever happens to the module (to_empty, FSDP) and nothing to re-tie.
        self.output = None if args.tie_word_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        # One table for all blocks, passed to them as a module (not as tensors, which FSDP2's
        # mixed precision would cast to bf16). Its cos/sin buffers are not in the state dict.
        self.rope = self.make_rope(args)
        # The last stage returns the final-norm hidden states instead of the logits (class docstring).
        self.return_hidden = False

    def before_final_norm(self, h: torch.Tensor) -> None:
        """A family's hook on the last block's output (DeepSeek-V3's multi-token prediction keeps it)."""

    def extra_blocks(self) -> list[nn.Module]:
        """Transformer blocks outside ``layers`` (DeepSeek-V3's MTP blocks), which activation
        checkpointing, compile and FSDP2 treat as they treat the layers."""
        return []

    def blocks(self) -> list[nn.Module]:
        """Every transformer block: the layers, then ``extra_blocks``."""
        return [*self.layers.values(), *self.extra_blocks()]

    def token_loss(self, hidden: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """The summed token loss of the final-norm ``hidden`` states against ``labels`` (the fused output
        projection + cross-entropy, ``trainer.models.common.losses.linear_cross_entropy_loss``); a family
        may add its own terms (DeepSeek-V3's multi-token prediction)."""
        return linear_cross_entropy_loss(self, hidden, labels, ignore_index)

    @staticmethod
    def make_rope(args) -> RotaryEmbedding:
        return RotaryEmbedding(args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling, interleaved=True)

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
        # One token per row (a decode step) is one document per row: attention needs no boundaries.
        cu_seqlens = document_cu_seqlens(position_ids) if position_ids is not None and tokens.shape[1] > 1 else None
        for layer in self.layers.values():
            h = layer(h, self.rope, position_ids, cu_seqlens)
        if self.norm is None:  # not the last pipeline stage
            return h
        self.before_final_norm(h)
        h = self.norm(h)
        if self.return_hidden:
            return h
        if self.output is None:
            return F.linear(h, self.tok_embeddings.weight)
        return self.output(h)

    # -- initialization --

    def param_init_std(self, name: str) -> float | None:
        """Init standard deviation of parameter ``name``; None for norm weights (ones), 0.0 for biases
        (zeros)."""
        if name.endswith("norm.weight"):
            return None
        if name.endswith("bias"):
            return 0.0
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

        Weights: normal(0, std) truncated at +-3 std (``param_init_std``); norm weights: ones; biases:
        zeros. Each
        parameter is drawn whole on its device from a generator seeded by (seed, name), then each rank
        keeps its own shard (DTensor parameters, e.g. under FSDP2). Costs one full parameter of
        temporary memory at a time. The rotary tables are recomputed where they are.

        Raises RuntimeError if the model is still on the meta device (call ``to_empty`` first).
        """
        init_parameters(self, seed)
        self.rope.reset_parameters()
        for module in self.modules():  # buffers of other modules, e.g. the MoE load-balancing bias
            if hasattr(module, "reset_buffers"):
                module.reset_buffers()


def init_parameters(model: nn.Module, seed: int) -> None:
    """Fill every parameter of ``model`` by its ``param_init_std(name)`` (None: ones, 0: zeros, else a
    truncated normal of that std drawn whole from a generator seeded by (seed, name)), the same for any
    sharding: a DTensor parameter keeps its shard of the full draw. Raises RuntimeError on meta."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if any(t.device.type == "meta" for t in (*model.parameters(), *model.buffers())):
        raise RuntimeError("init_weights: the model is still on the meta device; call to_empty(device=...) first")
    for name, param in model.named_parameters():
        is_dt = isinstance(param, DTensor)
        local = param.to_local() if is_dt else param
        full = torch.empty(param.shape, dtype=param.dtype, device=local.device)
        std = model.param_init_std(name)
        if std is None:
            full.fill_(1.0)
        elif std == 0.0:
            full.zero_()
        else:
            gen = torch.Generator(device=local.device)
            gen.manual_seed(_param_seed(seed, name))
            _trunc_normal_(full, std, gen)
        if is_dt:
            full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.copy_(full)


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
