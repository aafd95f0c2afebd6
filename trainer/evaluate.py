"""Evaluation of the model being trained: the validation loss and perplexity on held-out text, every
``validation.freq`` steps (the ``[validation]`` section; checking a configuration is
``trainer.config.validate``).

What is measured. ``val_loss`` is the summed token cross-entropy over every validation token of the
evaluation (all batches, all data-parallel and context-parallel ranks) divided by the number of
those tokens: a mean over tokens, not over batches, so neither batch sizes, padding nor gradient
accumulation (whose ``dp / global_tokens`` scale belongs to training only) can enter it.
``val_perplexity = exp(val_loss)``. Every evaluation reads the same batches (the loader is rewound),
so successive values are comparable.

Data (``trainer.data.loader.build_validation_loader``). ``validation.dataset`` /
``validation.dataset_path`` name a source of its own; without one, the held-out part of the
training source (``trainer.data.splits``: 1 document in
``validation.split_every``, never trained on). The loader reads one pass (``one_epoch``): the last
window is padded with ignored labels, and ``validation.steps = -1`` evaluates the whole split; with
``steps = M`` it stops after M batches or at the end of the split, whichever comes first. The ranks
agree on when the split is over (one small all-reduce per batch), so every rank runs the same number
of forwards, as FSDP2, tensor and pipeline parallel need.

Layouts. The forward is the training one without the backward (under ``torch.no_grad``): FSDP2
gathers the weights as in training, tensor parallel computes the vocab-parallel loss under loss
parallel, context parallel evaluates each rank's part of every sequence, and pipeline parallel runs
the schedule's forward-only ``eval`` (each validation batch cut into pieces of
``training.local_batch_size`` sequences, the micro-batch count the schedule was built with).
"""
from __future__ import annotations

import contextlib
import math
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainer.data.loader import IGNORE_INDEX



class Validator:
    """Evaluates the validation loss of the model being trained.

    Args:
        loader: a one-pass ``DataLoader`` (``trainer.data.build_validation_loader``); rewound for every
            evaluation.
        steps: batches per evaluation, -1 = the whole split.
        device: where the model runs.
        micro_batch_loss: ``(inputs, labels, position_ids) -> summed token loss`` of one batch through
            the model, the forward of a training micro-batch (unused under pipeline parallel).
        dp_group: False for one process; else the group over which token losses add up (data and
            context parallel; None = the default group), as in ``trainer.train.forward_backward``.
        distributed: True when there are several processes (they agree on the number of batches).
        document_masking: pass the packing's position_ids to the model.
        shard: this rank's part of each (batch, seq) tensor (context parallel), or None.
        loss_context: the context of the forward and the loss (loss parallel).
        pipeline: the ``PipelineRunner`` (its forward-only schedule runs the batches), or None.
        pipeline_batch: sequences per schedule run under pipeline parallel (training.local_batch_size).
    """

    def __init__(self, loader, steps: int, device: torch.device, micro_batch_loss, *, dp_group=False,
                 distributed: bool = False, document_masking: bool = False, shard=None,
                 loss_context=contextlib.nullcontext, pipeline=None, pipeline_batch: int | None = None) -> None:
        if steps != -1 and steps < 1:
            raise ValueError(f"validation.steps: expected -1 or an integer >= 1, got {steps!r}")
        if pipeline is not None and (pipeline_batch is None or loader.local_batch_size % pipeline_batch):
            raise ValueError(
                f"validation.local_batch_size: {loader.local_batch_size} is not a multiple of the pipeline's "
                f"batch of {pipeline_batch} sequences"
            )
        self.loader, self.steps, self.device = loader, steps, device
        self.micro_batch_loss = micro_batch_loss
        self.dp_group, self.distributed = dp_group, distributed
        self.document_masking, self.shard, self.loss_context = document_masking, shard, loss_context
        self.pipeline, self.pipeline_batch = pipeline, pipeline_batch

    def _any_rank_has_tokens(self, has_tokens: bool) -> bool:
        if not self.distributed:
            return has_tokens
        flag = torch.tensor([1.0 if has_tokens else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank of the world: all run the same forwards
        return bool(flag.item())

    def _batch_loss_sum(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The summed token loss of one validation batch on this rank (float32 scalar, detached)."""
        inputs = batch["input_ids"].to(self.device, non_blocking=True)
        labels = batch["labels"].to(self.device, non_blocking=True)
        if self.pipeline is not None:
            total = torch.zeros((), device=self.device)
            with self.loss_context():
                for lo in range(0, inputs.shape[0], self.pipeline_batch):
                    hi = lo + self.pipeline_batch
                    total += self.pipeline.eval_loss_sum(inputs[lo:hi], labels[lo:hi])
            return total
        pos = batch["position_ids"].to(self.device, non_blocking=True) if self.document_masking else None
        with self.loss_context():
            loss_sum = self.micro_batch_loss(inputs, labels, pos)
        loss_sum = loss_sum.detach()
        if isinstance(loss_sum, DTensor):  # loss parallel
            loss_sum = loss_sum.full_tensor()
        return loss_sum.float()

    @torch.no_grad()
    def evaluate(self) -> dict:
        """One evaluation. Returns ``{"val_loss", "val_perplexity", "val_tokens", "val_batches",
        "val_time_s"}`` (the same on every rank). Raises ValueError if the split has no token."""
        t0 = time.perf_counter()
        self.loader.rewind()
        loss_sum = torch.zeros((), device=self.device)
        n_local = 0
        batches = 0
        while self.steps == -1 or batches < self.steps:
            batch = next(self.loader)
            if self.shard is not None:
                batch = {k: self.shard(v) for k, v in batch.items()}
            n = int((batch["labels"] != IGNORE_INDEX).sum())
            # Past the end of the split on every rank: done. A rank that ends first runs padding
            # (no token counted) while the others finish, so the collectives inside the forward match.
            if not self._any_rank_has_tokens(n > 0):
                break
            loss_sum += self._batch_loss_sum(batch)
            n_local += n
            batches += 1
        totals = torch.stack([loss_sum, torch.tensor(float(n_local), device=self.device)])
        if self.dp_group is not False and self.distributed:
            dist.all_reduce(totals, group=self.dp_group)
        loss_total, n_tokens = totals.tolist()
        if n_tokens == 0:
            raise ValueError("validation: the validation split has no token to evaluate")
        val_loss = loss_total / n_tokens
        return {
            "val_loss": val_loss,
            "val_perplexity": math.exp(val_loss) if val_loss < 700 else math.inf,
            "val_tokens": int(n_tokens),
            "val_batches": batches,
            "val_time_s": time.perf_counter() - t0,
        }
