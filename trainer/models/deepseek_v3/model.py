"""The DeepSeek-V3 model: the shared decoder with MLA blocks (``trainer.models.deepseek_v3.attention``),
DeepSeekMoE feed-forwards (the shared ``MoE`` with sigmoid, group-limited routing and shared experts,
``trainer.models.common.moe_args``) and multi-token prediction.

Multi-token prediction (DeepSeek-V3 sec. 2.2, Gloeckle et al. 2024): MTP module k (1..D) takes the
hidden state h^{k-1} (h^0: the main model's last block output, before the final norm) and the
embedding of token t + k, and computes h^k = block_k(eh_proj([enorm(emb(t + k)); hnorm(h^{k-1})]));
``post_norm(h^k)`` through the shared output head predicts token t + k + 1. The embedding and the
head are the main model's. Its loss, the mean over the D modules of their token cross-entropies,
trains with weight ``mtp_loss_weight`` (lambda, ``--training.mtp_loss_weight``) beside the main
loss, which alone is what the run reports as ``loss`` (``mtp_loss`` is logged apart).

The targets come with the labels: ``future_labels(labels, D)`` (``trainer.models.common.losses``) stacks
(batch, seq, 1 + D), where slice 0
is the main labels (token t + 1) and slice k token t + k + 1; module k reads token t + k from slice
k - 1. The stack is built before a context-parallel split, so each rank's shard holds the right
future tokens. A position whose future token lies past the sequence has target ``ignore_index``.
"""
from __future__ import annotations

import torch
from torch import nn

from titan_kernels.nn import RMSNorm, RotaryEmbedding
from trainer.models.common.decoder import Transformer, TransformerBlock
from trainer.models.deepseek_v3.attention import MLA
from trainer.models.common.losses import linear_cross_entropy_loss


class _AddToLoss(torch.autograd.Function):
    """Identity on ``loss``; the backward also sends ``loss``'s gradient to ``extra``: ``extra`` trains as
    if added to the loss, and the reported value stays the main loss."""

    @staticmethod
    def forward(ctx, loss, extra):
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad


class DeepSeekV3Block(TransformerBlock):
    """A decoder block with multi-head latent attention (the feed-forward: dense or MoE as the args say)."""

    def make_attention(self, layer_id: int, args) -> nn.Module:
        return MLA(args, layer_id)


class MTPModule(nn.Module):
    """One multi-token prediction module (module docstring): enorm, hnorm, eh_proj, a block, post_norm."""

    def __init__(self, layer_id: int, args) -> None:
        super().__init__()
        self.enorm = RMSNorm(args.dim, eps=args.norm_eps)
        self.hnorm = RMSNorm(args.dim, eps=args.norm_eps)
        self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.block = DeepSeekV3Block(layer_id, args)
        self.post_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, h: torch.Tensor, emb: torch.Tensor, rope: RotaryEmbedding,
                position_ids: torch.Tensor | None, cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """h (batch, seq, dim) the previous depth's hidden state, emb the embedding of the tokens one
        further ahead -> (this depth's hidden state, its post-norm output for the head)."""
        h = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))
        h = self.block(h, rope, position_ids, cu_seqlens)
        return h, self.post_norm(h)


class DeepSeekV3(Transformer):
    """The decoder with MLA blocks and, with ``num_mtp_layers``, MTP modules (``mtp.0``...). In training
    with ``return_hidden`` and labels stacked by ``future_labels``, ``token_loss`` adds the MTP loss;
    otherwise (evaluation, plain labels, logits) the model is the main model alone."""

    block_cls = DeepSeekV3Block

    def __init__(self, args) -> None:
        super().__init__(args)
        # MTP module k is numbered after the main layers (layer_id n_layers + k), as the published checkpoint.
        self.mtp = nn.ModuleDict({str(k): MTPModule(args.n_layers + k, args) for k in range(args.num_mtp_layers)}) \
            if args.num_mtp_layers else None
        self.mtp_loss_weight = 0.3  # lambda; the trainer sets --training.mtp_loss_weight
        self._last = None  # the main model's last block output, for the MTP modules
        self.register_buffer("mtp_loss_sum", torch.zeros(2, dtype=torch.float32), persistent=False)  # (loss, tokens)

    @staticmethod
    def make_rope(args) -> RotaryEmbedding:
        # Only the decoupled rotary dims rotate (qk_rope_head_dim), shared by q and the one rotary key.
        return RotaryEmbedding(args.qk_rope_head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling,
                               interleaved=True)

    @property
    def mtp_depth(self) -> int:
        mtp = getattr(self, "mtp", None)  # a pipeline stage (trainer.parallel.pipeline) holds none
        return 0 if mtp is None else len(mtp)

    def extra_blocks(self) -> list[nn.Module]:
        return [m.block for m in self.mtp.values()] if self.mtp_depth else []

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        self._position_ids = position_ids
        return super().forward(tokens, position_ids)

    def before_final_norm(self, h: torch.Tensor) -> None:
        """Keep the last block's output for the MTP modules (called by ``Transformer.forward``)."""
        self._last = h if self.mtp_depth and self.training else None

    def token_loss(self, hidden: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """The summed main token loss of ``hidden`` (the final-norm states); with labels stacked by
        ``future_labels`` (3-D) in training, the MTP modules' loss trains alongside, weighted by
        ``mtp_loss_weight`` / depth, and its sum and token count accumulate in ``mtp_loss_sum``."""
        if labels.dim() == 2:
            return linear_cross_entropy_loss(self, hidden, labels, ignore_index)
        loss = linear_cross_entropy_loss(self, hidden, labels[..., 0].contiguous(), ignore_index)
        h = getattr(self, "_last", None)
        if h is None or not self.mtp_depth:
            return loss
        self._last = None
        from trainer.models.common.attention import document_cu_seqlens

        pos = self._position_ids
        cu = document_cu_seqlens(pos) if pos is not None else None
        total = None
        for k, module in enumerate(self.mtp.values(), start=1):
            # token t + k, read from the labels of depth k - 1 (ignored ones embed as token 0: their
            # targets are ignored too, and attention is causal, so nothing valid sees them)
            ahead = labels[..., k - 1].clamp_min(0)
            h, out = module(h, self.tok_embeddings(ahead), self.rope, pos, cu)
            target = labels[..., k].contiguous()
            part = linear_cross_entropy_loss(self, out, target, ignore_index)
            total = part if total is None else total + part
            with torch.no_grad():
                value = part.full_tensor() if hasattr(part, "full_tensor") else part
                self.mtp_loss_sum += torch.stack([value.detach().float(),
                                                  (target != ignore_index).sum().to(torch.float32)])
        return _AddToLoss.apply(loss, total * (self.mtp_loss_weight / len(self.mtp)))

    def reset_buffers(self) -> None:
        """Zero the MTP loss accumulator (``init_weights`` calls it; ``to_empty`` leaves it undefined)."""
        acc = getattr(self, "mtp_loss_sum", None)  # a pipeline stage (trainer.parallel.pipeline) has none
        if acc is not None:
            with torch.no_grad():
                acc.zero_()

    def take_mtp_loss(self) -> torch.Tensor:
        """(summed MTP loss, its target count) since the last call, on the device; resets them."""
        out = self.mtp_loss_sum.clone()
        self.mtp_loss_sum.zero_()
        return out

    def tp_finish(self, tp_mesh) -> None:
        """The MTP modules under tensor parallel: their blocks as the main ones, eh_proj colwise."""
        if self.mtp is None:
            return
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel, parallelize_module

        from trainer.parallel.tensor_parallel import block_plan, finish_block

        for module in self.mtp.values():
            plan = {"enorm": SequenceParallel(), "hnorm": SequenceParallel(), "post_norm": SequenceParallel(),
                    "eh_proj": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(1))}
            plan.update({f"block.{k}": v for k, v in block_plan(module.block).items()})
            parallelize_module(module, tp_mesh, plan)
            finish_block(module.block, tp_mesh)
