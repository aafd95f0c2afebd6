"""One optimizer step's numerics, apart from the run around them (trainer.train's ``Trainer``):
the loss of a micro-batch, forward and backward over a step's micro-batches with the exact
token-mean scaling, the global gradient-norm clip, and the device-side watch for non-finite values.

Scaling. One optimizer step takes ``grad_accum = global_batch_size / (local_batch_size * dp)``
micro-batches per rank. Each micro-batch's summed token loss is scaled by ``dp / global_tokens`` (all
tokens of the step over all ranks); FSDP2 averages gradients over the ``dp`` ranks, so the gradient
is exactly that of the mean token loss over the whole global batch, for any split into ranks and
micro-batches. The reported loss is that mean token loss.

Also :class:`TrainingError`, the error of a run that cannot proceed (the step raises it for a
non-finite value); ``trainer.train`` reports it in one line and exits with 1. Nothing here reads a
tensor on the host except the label counts of the (CPU) batches and :meth:`NonFiniteWatch.check`.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainer.data.loader import IGNORE_INDEX
from trainer.models.common.losses import future_labels
from trainer.errors import TrainingError, NonFiniteLossError  # noqa: F401  (defined on the ground floor)


def clip_grad_norm_(parameters: list[torch.nn.Parameter], max_norm: float, pp_group=None) -> torch.Tensor:
    """Clip gradients to a global L2 norm of ``max_norm``; returns the norm before clipping (a plain tensor).

    With FSDP2 / tensor parallel the gradients are DTensor shards: the per-shard norms combine into
    the norm of the full gradient (``full_tensor`` of the Partial norm), which then scales every
    shard alike. With pipeline parallel (``pp_group``) each rank holds other layers: the squared
    norms of the stages add up over the group.
    """
    # Gradients on different meshes (expert parallel: experts on the ep mesh, the rest on the data-
    # parallel one) cannot meet in one foreach call: one norm per mesh, combined as squares.
    groups: dict = {}
    for prm in parameters:
        if prm.grad is not None:
            key = prm.grad.device_mesh if isinstance(prm.grad, DTensor) else None
            groups.setdefault(key, []).append(prm)
    total = None
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([q.grad for q in group], norm_type=2.0, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total = norm if len(groups) == 1 else (norm**2 if total is None else total + norm**2)
    if total is None:  # no gradient on this rank (e.g. a pipeline stage without trainable weights)
        total = torch.zeros((), device=parameters[0].device if parameters else None)
    elif len(groups) > 1:
        total = total.sqrt()
    if pp_group is not None:
        total = total**2
        dist.all_reduce(total, group=pp_group)
        total = total.sqrt()
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total


def micro_batch_loss(model: torch.nn.Module, loss_fn, inputs: torch.Tensor, labels: torch.Tensor,
                     position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The summed token loss of one micro-batch through ``model`` (training's forward; validation
    runs the same under no_grad): ``loss_fn(model(inputs, position_ids), labels, IGNORE_INDEX)``."""
    return loss_fn(model(inputs, position_ids), labels, IGNORE_INDEX)


def forward_backward(
    model: torch.nn.Module,
    loss_fn,
    batches: list[dict[str, torch.Tensor]],
    device: torch.device,
    *,
    dp_size: int = 1,
    dp_group=False,
    document_masking: bool = False,
    shard=None,
    loss_context=contextlib.nullcontext,
    pipeline=None,
    mtp_depth: int = 0,
) -> torch.Tensor:
    """Accumulate into ``.grad`` the gradient of the mean token loss over ``batches`` on all dp ranks.

    ``batches``: this rank's micro-batches (``input_ids``, ``labels`` (batch, seq) int64, labels
    ``IGNORE_INDEX`` skipped; ``position_ids`` used when ``document_masking``). ``loss_fn(logits,
    labels, ignore_index)`` returns the summed token loss. ``dp_group``: False for a single process,
    else the group of ranks whose token losses add up to the global loss (data and context
    parallel; None = default group); the gradients are expected to be averaged over ``dp_size``
    ranks afterwards (FSDP2 does). ``shard``: this rank's part of each (batch, seq) tensor (context
    parallel). ``loss_context``: a context for the forward, loss and backward (loss parallel).
    ``pipeline``: a ``trainer.parallel.pipeline.PipelineRunner`` that runs the batches through the
    stages instead of ``model``. ``mtp_depth``: the model's multi-token prediction modules; their
    future labels are stacked behind the labels (``future_labels``), before any sequence split.
    Returns the mean token loss over all ranks and micro-batches (float32 scalar, detached; the main
    loss, without the MTP terms). Raises ValueError if there is no token to learn.
    """
    distributed = dp_group is not False
    if mtp_depth:
        batches = [{**b, "labels": future_labels(b["labels"], mtp_depth, IGNORE_INDEX)} for b in batches]
    if shard is not None:
        batches = [{k: shard(v) for k, v in b.items()} for b in batches]
    # on the host: labels are CPU tensors; the main labels only (slice 0 when stacked for MTP)
    n_local = sum(int(((b["labels"][..., 0] if mtp_depth else b["labels"]) != IGNORE_INDEX).sum()) for b in batches)
    n_tokens = torch.tensor(float(n_local), device=device)
    if distributed:
        dist.all_reduce(n_tokens, group=dp_group)
    # Reading the global count waits for the device; only a rank without tokens of its own pays that
    # (then every rank without tokens reads it, and they all raise when no rank has any).
    if n_local == 0 and n_tokens.item() == 0:
        raise ValueError("batches: every label is ignore_index; there is no token to compute a loss on")
    scale = dp_size / n_tokens
    loss_sum = torch.zeros((), device=device)
    for b in batches:
        inputs = b["input_ids"].to(device, non_blocking=True)
        labels = b["labels"].to(device, non_blocking=True)
        pos = b["position_ids"].to(device, non_blocking=True) if document_masking else None
        with loss_context():
            if pipeline is not None:
                pipeline.step(inputs, labels, scale)
                continue
            token_loss_sum = micro_batch_loss(model, loss_fn, inputs, labels, pos)
            (token_loss_sum * scale).backward()
        token_loss_sum = token_loss_sum.detach()
        if isinstance(token_loss_sum, DTensor):  # loss parallel
            token_loss_sum = token_loss_sum.full_tensor()
        loss_sum += token_loss_sum
    if pipeline is not None:
        loss_sum = pipeline.take_loss_sum()
    if distributed:
        dist.all_reduce(loss_sum, group=dp_group)
    return loss_sum / n_tokens


def build_loss_fn(model: torch.nn.Module, config, dims) -> tuple[bool, object]:
    """``(fused, loss_fn)`` of a run: ``loss_fn(output, labels, ignore_index) -> summed token loss``.

    The loss is the model's ``token_loss``: the fused output projection + cross-entropy (vocab-parallel
    under TP), so the last stage returns hidden states (``return_hidden``), the logits are never
    materialized and the loss needs no loss_parallel() context; it is one op, so there is nothing for
    compile to fuse; a family may add terms (multi-token prediction). The logits path (``fused``
    False) stays for ``--parallelism.disable_loss_parallel`` under TP and a float8 output layer.
    Raises ConfigError (trainer.config) for multi-token prediction with pipeline parallel or the logits path.
    """
    from trainer.errors import ConfigError
    from trainer.models.common.losses import cross_entropy_loss
    from trainer.parallel.compile import compile_loss

    p = config.parallelism
    fused = not (dims.tp_enabled and p.disable_loss_parallel) and type(model.output) in (torch.nn.Linear, type(None))
    refusal = model.args.pipeline_refusal()
    if refusal and dims.pp_enabled:
        raise ConfigError(f"--parallelism.pipeline_parallel_degree: {refusal}")
    if getattr(model, "mtp_depth", 0):
        if not fused:
            raise ConfigError("--model.mtp_layers: multi-token prediction needs the fused loss (not with "
                              "--parallelism.disable_loss_parallel or a float8 output layer); use --model.mtp_layers 0")
        model.mtp_loss_weight = config.training.mtp_loss_weight
    if fused:
        model.return_hidden = True
        return True, model.token_loss
    if config.compile.enable and "loss" in config.compile.components:
        return False, compile_loss(cross_entropy_loss, config.compile.backend)
    return False, cross_entropy_loss


def mtp_metrics(model: torch.nn.Module, dp_group=False) -> dict[str, float]:
    """``{"mtp_loss": the mean token loss of the multi-token prediction modules}`` since the last call,
    over the ``dp_group`` ranks (False: one process; every rank must call it: an all-reduce)."""
    total = model.take_mtp_loss()
    if dp_group is not False:
        dist.all_reduce(total, group=dp_group)
    loss, tokens = total.tolist()
    return {"mtp_loss": loss / tokens} if tokens else {}


class NonFiniteWatch:
    """The first step whose loss or gradient norm is not finite, kept on the device (no host sync per
    step); ``check`` reads it (``trainer.train``'s docstring: when the loop checks).

    Args:
        device: the training device, where the flag lives.
    """

    def __init__(self, device: torch.device) -> None:
        self._first_bad = torch.zeros((), dtype=torch.int64, device=device)  # 0 = none yet
        self._values = torch.zeros(2, dtype=torch.float32, device=device)  # its loss and gradient norm

    def update(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Record ``step`` if it is the first whose ``loss`` or ``grad_norm`` (device scalars) is not finite."""
        new = (self._first_bad == 0) & ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        self._first_bad = torch.where(new, step, self._first_bad)
        self._values = torch.where(new, torch.stack([loss.float(), grad_norm.float()]), self._values)

    def check(self, step: int, kept, loaded=None) -> None:
        """Raise NonFiniteLossError if a step up to ``step`` was not finite (reads the flag: a host sync).

        ``kept()`` returns the words saying which checkpoint is good, for the message. ``loaded``:
        ``(first_step, source)`` when the weights were loaded (a checkpoint, a Hugging Face import)
        just before step ``first_step``; if that step is the first bad one, the message blames the
        loaded weights, not the learning rate (no update has happened since the load).
        """
        first = int(self._first_bad)
        if first == 0:
            return
        loss, norm = self._values.tolist()
        where = f"step {first}" if first == step else f"step {first} (found at the check of step {step})"
        if loaded is not None and loaded[0] == first:
            advice = (f"The weights were just loaded from {loaded[1]} and no update ran since: they hold non-finite "
                      f"or huge values (a damaged or incompatible checkpoint), not a learning rate problem")
        else:
            advice = "Try a lower --optimizer.lr or a longer --lr_scheduler.warmup_steps"
        raise NonFiniteLossError(
            f"{where}: non-finite loss or gradient (loss {loss}, gradient norm {norm}); stopping before "
            f"the optimizer step of step {step}; {kept()}. {advice}"
        )

