"""Pipeline parallel: the layers split into stages on the ``pp`` ranks, run by a schedule of
``torch.distributed.pipelining``.

Stages. The ``n_layers`` blocks are split into ``num_stages`` consecutive stages: evenly (the first
stages take one more when it does not divide), or at ``pipeline_parallel_split_points``: the first
layer of each stage after the first, e.g. ``["layers.3"]``. The first stage also holds the token
embedding, the last the final norm and the output projection. A stage is a ``Transformer`` holding
only its layers (their names unchanged, so checkpoints are layout-free); it takes token ids (first
stage) or the hidden states of the stage before, and returns hidden states: on the last stage
those after the final norm when the model has ``return_hidden`` (the trainer's default), and the
loss (``loss_fn``, the fused ``linear_cross_entropy_loss``) applies the output weight itself, or
else the logits.

Schedules (``pipeline_parallel_schedule``):
  GPipe, 1F1B                 one stage per rank;
  Interleaved1F1B,            two stages per rank (or ``len(split_points) + 1`` stages, a multiple of
  InterleavedZeroBubble       pp), looped: rank r holds stages r, r + pp, ...;
  ZBVZeroBubble, DualPipeV    two stages per rank in a V: rank r holds stages r and 2*pp - 1 - r.
                              DualPipeV (DeepSeek-V3 sec. 3.2.1, torch's ``ScheduleDualPipeV``) also
                              overlaps one micro-batch's forward with another's backward.
The zero-bubble schedules split each backward into the input gradient (on the critical path) and
the weight gradient (filling the bubbles) (Qi et al., "Zero Bubble Pipeline Parallelism", 2024).

Micro-batches: the local batch (``training.local_batch_size`` sequences) is split into
``local_batch_size / pipeline_parallel_microbatch_size`` micro-batches per schedule step; with
gradient accumulation each accumulation step is one schedule step. The loss of each micro-batch is
its summed token loss times ``grad_scale / global tokens`` (the same scaling as without pipeline
parallel), and the schedule is told not to rescale the gradients (``scale_grads=False``), so the
gradient is that of the mean token loss of the global batch, once. Only the last stage has the loss:
``PipelineRunner.forward_backward`` sums it over the data-parallel ranks and hands it to every pp rank.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import ScheduleDualPipeV

SCHEDULES = {
    "GPipe": ScheduleGPipe,
    "1F1B": Schedule1F1B,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
    "ZBVZeroBubble": ScheduleZBVZeroBubble,
    "DualPipeV": ScheduleDualPipeV,
}
SINGLE_STAGE = ("GPipe", "1F1B")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")

_SPLIT_RE = re.compile(r"^layers\.(\d+)$")


@dataclass(frozen=True)
class StagePlan:
    """Which layers each stage holds and which stages this pp rank runs."""

    num_stages: int
    layers: tuple[tuple[int, ...], ...]  # per stage, layer ids
    local_stages: tuple[int, ...]  # stage ids on this rank, in the order the schedule wants them


def stage_ids(pp_rank: int, pp: int, num_stages: int, schedule: str) -> tuple[int, ...]:
    """Stages run by ``pp_rank``: looped (r, r + pp, ...) or, for V schedules, (r, 2*pp - 1 - r)."""
    per_rank = num_stages // pp
    if schedule in V_SCHEDULES:
        return (pp_rank, num_stages - 1 - pp_rank)
    return tuple(pp_rank + i * pp for i in range(per_rank))


def plan_stages(n_layers: int, pp: int, pp_rank: int, schedule: str, split_points: list[str] | None = None) -> StagePlan:
    """Split ``n_layers`` into stages for ``schedule`` on ``pp`` ranks (module docstring).

    Raises ValueError, naming the config key, for an unknown schedule, too few layers for the stages,
    split points that are malformed, out of order or out of range, or a stage count the schedule
    cannot take.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"parallelism.pipeline_parallel_schedule: expected one of {', '.join(SCHEDULES)}, got {schedule!r}")
    per_rank = 1 if schedule in SINGLE_STAGE else 2
    if split_points:
        num_stages = len(split_points) + 1
        if schedule in SINGLE_STAGE and num_stages != pp:
            raise ValueError(
                f"parallelism.pipeline_parallel_split_points: {len(split_points)} split points make {num_stages} "
                f"stages, but schedule {schedule} runs one stage per rank: expected {pp - 1} split points"
            )
        if schedule in V_SCHEDULES and num_stages != 2 * pp:
            raise ValueError(
                f"parallelism.pipeline_parallel_split_points: {len(split_points)} split points make {num_stages} "
                f"stages, but {schedule} runs two per rank: expected {2 * pp - 1} split points"
            )
        if schedule not in SINGLE_STAGE and (num_stages % pp or num_stages < 2 * pp):
            raise ValueError(
                f"parallelism.pipeline_parallel_split_points: {len(split_points)} split points make {num_stages} "
                f"stages; schedule {schedule} needs a multiple of pipeline_parallel_degree = {pp}, at least {2 * pp}"
            )
        starts = []
        for point in split_points:
            m = _SPLIT_RE.match(point)
            if not m:
                raise ValueError(
                    f"parallelism.pipeline_parallel_split_points: expected names like 'layers.3', got {point!r}"
                )
            starts.append(int(m.group(1)))
        if starts != sorted(set(starts)) or starts[0] < 1 or starts[-1] >= n_layers:
            raise ValueError(
                f"parallelism.pipeline_parallel_split_points: expected increasing layers in layers.1..layers."
                f"{n_layers - 1} (every stage holds at least one layer), got {split_points}"
            )
        bounds = [0, *starts, n_layers]
    else:
        num_stages = pp * per_rank
        if n_layers < num_stages:
            raise ValueError(
                f"parallelism.pipeline_parallel_degree: {n_layers} layers are too few for {num_stages} stages "
                f"(pipeline_parallel_degree {pp} x {per_rank} stage(s) per rank with schedule {schedule})"
            )
        base, extra = divmod(n_layers, num_stages)
        bounds = [0]
        for s in range(num_stages):
            bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    layers = tuple(tuple(range(bounds[s], bounds[s + 1])) for s in range(num_stages))
    return StagePlan(num_stages, layers, stage_ids(pp_rank, pp, num_stages, schedule))


def split_model(model: nn.Module, plan: StagePlan) -> tuple[nn.Module, list[nn.Module]]:
    """Cut ``model`` (a Transformer, normally still on the meta device) into this rank's stages.

    Returns ``(local_model, stages)``: ``stages[i]`` is the Transformer of stage
    ``plan.local_stages[i]``; ``local_model`` is ``model`` reduced to what this rank holds (the union
    of its stages, sharing their modules), for the optimizer and the checkpoint. Raises ValueError
    for tied embeddings (the output would live on the first stage).
    """
    if model.args.tie_word_embeddings:
        raise ValueError(
            "parallelism.pipeline_parallel_degree: tied embeddings (1B/3B flavors) are not supported with "
            "pipeline parallel (the output projection is the first stage's embedding)"
        )
    mine = {i for s in plan.local_stages for i in plan.layers[s]}
    for key in list(model.layers.keys()):
        if int(key) not in mine:
            del model.layers[key]
    last = plan.num_stages - 1
    if 0 not in plan.local_stages:
        model.tok_embeddings = None
    if last not in plan.local_stages:
        model.norm = None
        model.output = None
    stages = []
    for s in plan.local_stages:
        # A Transformer sharing this stage's modules, with its own hooks (FSDP2 wraps each stage).
        stage = type(model).__new__(type(model))
        nn.Module.__init__(stage)
        stage.args = model.args
        stage.tok_embeddings = model.tok_embeddings if s == 0 else None
        stage.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in plan.layers[s]})
        stage.norm = model.norm if s == last else None
        stage.output = model.output if s == last else None
        stage.rope = model.rope
        stage.return_hidden = model.return_hidden
        stages.append(stage)
    return model, stages


def _no_counting_in_metadata_forward(stage: PipelineStage) -> None:
    """The schedule's first step runs each stage's forward once more to learn the shapes (torch's
    private ``_forward_metadata_inference``, on real or empty tensors): that forward must not count
    towards the MoE load balance (``trainer.models.common.moe``). A torch without it needs nothing."""
    infer = getattr(stage, "_forward_metadata_inference", None)
    if infer is None:
        return
    from trainer.models.common.moe import no_expert_counting

    def wrapped(*args, **kwargs):
        with no_expert_counting():
            return infer(*args, **kwargs)

    stage._forward_metadata_inference = wrapped


class PipelineRunner:
    """The schedule of this rank's stages and one training step through it.

    Args:
        stages: this rank's stage modules (parallelized and materialized), in ``plan.local_stages`` order.
        plan: the StagePlan they come from.
        pp_mesh: the 1-D ``pp`` mesh.
        schedule: a name in ``SCHEDULES``.
        n_microbatches: micro-batches per schedule step (local_batch_size / microbatch size).
        loss_fn: ``loss_fn(output, labels, ignore_index) -> summed token loss`` of the last stage's
            output (the hidden states with ``return_hidden``, else the logits).
        device: where the stages run.

    Raises ValueError (naming ``parallelism.pipeline_parallel_microbatch_size``) for a micro-batch
    count the schedule cannot take.
    """

    def __init__(self, stages, plan: StagePlan, pp_mesh: DeviceMesh, schedule: str, n_microbatches: int,
                 loss_fn, device: torch.device, ignore_index: int = -100) -> None:
        self.plan, self.stages = plan, stages
        self.group = pp_mesh.get_group()
        self.has_first = 0 in plan.local_stages
        self.has_last = plan.num_stages - 1 in plan.local_stages
        self._loss_fn, self._ignore_index = loss_fn, ignore_index
        self._scale = 1.0
        self._loss_sum = torch.zeros((), device=device)
        self.pipeline_stages = [
            PipelineStage(m, s, plan.num_stages, device, group=self.group) for m, s in zip(stages, plan.local_stages)
        ]
        for stage in self.pipeline_stages:
            _no_counting_in_metadata_forward(stage)
        cls = SCHEDULES[schedule]
        arg = self.pipeline_stages[0] if schedule in SINGLE_STAGE else self.pipeline_stages
        try:
            self.schedule = cls(arg, n_microbatches=n_microbatches, loss_fn=self._scaled_loss, scale_grads=False)
        except ValueError as exc:
            raise ValueError(
                f"parallelism.pipeline_parallel_microbatch_size: {n_microbatches} micro-batch(es) per step do not "
                f"fit schedule {schedule}: {exc}"
            ) from None

    def _scaled_loss(self, logits, labels):
        return self._loss_fn(logits, labels, self._ignore_index) * self._scale

    def step(self, inputs: torch.Tensor, labels: torch.Tensor, scale: float) -> None:
        """One schedule step (forward and backward of all micro-batches of ``inputs``); gradients
        accumulate into ``.grad``. ``scale`` multiplies every micro-batch's summed token loss."""
        self._scale = scale
        losses: list[torch.Tensor] = []  # the last stage's loss_fn outputs, one per micro-batch
        kwargs = {"target": labels, "losses": losses, "return_outputs": False}
        if self.has_first:
            self.schedule.step(inputs, **kwargs)
        else:
            self.schedule.step(**kwargs)
        for value in losses:
            value = value.detach()
            if hasattr(value, "full_tensor"):  # a DTensor under loss parallel
                value = value.full_tensor()
            self._loss_sum += value / scale

    def eval_loss_sum(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The summed token loss of ``inputs`` through the stages, forward only (the schedule's
        ``eval``; no gradient), on every pp rank. ``inputs``/``labels`` have the batch size the
        schedule was built for (its micro-batch count is fixed)."""
        self._scale = 1.0
        losses: list[torch.Tensor] = []
        kwargs = {"target": labels, "losses": losses, "return_outputs": False}
        if self.has_first:
            self.schedule.eval(inputs, **kwargs)
        else:
            self.schedule.eval(**kwargs)
        total = torch.zeros((), device=self._loss_sum.device)
        for value in losses:
            value = value.detach()
            if hasattr(value, "full_tensor"):  # a DTensor under loss parallel
                value = value.full_tensor()
            total += value
        dist.all_reduce(total, group=self.group)
        return total

    def take_loss_sum(self) -> torch.Tensor:
        """The summed token loss of the steps since the last call, on every pp rank (0 contributed
        by stages without the loss)."""
        total = self._loss_sum.clone()
        dist.all_reduce(total, group=self.group)
        self._loss_sum.zero_()
        return total


def pp_norm_group(pp_mesh: DeviceMesh | None):
    """The group over which squared gradient norms add up (None without pipeline parallel)."""
    return None if pp_mesh is None or pp_mesh.size() == 1 else pp_mesh.get_group()
