"""What a family trains on and how: the family's *task* (``ModelSpec.task``), the one place where the
trainer meets what a batch is and what its loss is (DESIGN.md section 4c).

A task gives the trainer (``trainer.train.Trainer``):
  - ``build_loader(trainer, split)``: the training (``split`` "training") or validation loader;
  - ``build_loss_fn(model, config, dims) -> (fused, loss_fn)``;
  - ``setup(trainer)``: after the model is parallelized (a family's frozen encoders, caches);
  - ``tokens_per_sample(config, args)``: the tokens one sample feeds the model (throughput, FLOPs);
  - ``forward_backward(trainer, batches) -> loss``: one step's micro-batches through forward and
    backward, gradient reductions included (the returned loss is detached);
  - ``build_validator(trainer)``: an object with ``evaluate() -> dict`` (``val_loss``, ``val_tokens``,
    ``val_batches``, ``val_time_s``), or None without validation.

``LanguageModelling`` is the decoder families' task: packed token windows, the token-mean
cross-entropy (``trainer.step``), the validation loss and perplexity (``trainer.evaluate``).
"""
from __future__ import annotations

from trainer import step as numerics
from trainer.data import build_dataloader, build_validation_loader
from trainer.evaluate import Validator


class LanguageModelling:
    """Next-token prediction on packed windows of ``training.seq_len`` tokens (module docstring)."""

    def build_loader(self, trainer, split: str):
        build = build_dataloader if split == "training" else build_validation_loader
        return build(trainer.config, trainer.tokenizer, trainer.dp_rank, trainer.dims.dp_size)

    def build_loss_fn(self, model, config, dims):
        return numerics.build_loss_fn(model, config, dims)

    def setup(self, trainer) -> None:
        return None

    def tokens_per_sample(self, config, args) -> int:
        return config.training.seq_len

    def forward_backward(self, trainer, batches):
        pm = trainer.pm
        return numerics.forward_backward(
            trainer.model, trainer.loss_fn, batches, trainer.device, dp_size=pm.grad_scale, dp_group=trainer._dp_group,
            document_masking=trainer.config.training.document_masking, shard=trainer._shard,
            loss_context=trainer._loss_context, pipeline=pm.pipeline, mtp_depth=getattr(trainer.model, "mtp_depth", 0))

    def build_validator(self, trainer):
        if trainer.val_loader is None:
            return None
        v, cfg_t, pm = trainer.config.validation, trainer.config.training, trainer.pm
        model, loss_fn = trainer.model, trainer.loss_fn
        return Validator(
            trainer.val_loader, v.steps, trainer.device,
            lambda inputs, labels, pos: numerics.micro_batch_loss(model, loss_fn, inputs, labels, pos),
            dp_group=trainer._dp_group, distributed=trainer._distributed,
            document_masking=cfg_t.document_masking, shard=trainer._shard,
            loss_context=trainer._loss_context, pipeline=pm.pipeline, pipeline_batch=cfg_t.local_batch_size,
        )

