"""``parallelize_decoder``: a meta-device model of any decoder family -> this rank's parallelized,
materialized model (a family may replace it: ``ModelSpec.parallelize``).

Order (DESIGN.md section 4): pipeline split -> per stage: tensor + sequence parallel -> context
parallel -> activation checkpointing -> compile per block -> FSDP2 -> materialize and initialize.
Tensor parallel comes first so FSDP2 shards the TP shards (2-D parameters on (dp_shard_cp, tp)),
and activation checkpointing and compile wrap the blocks before FSDP2 adds its hooks. The weights do
not depend on the layout: each parameter is drawn whole from a seed given by its name
(``Transformer.init_weights``) and every rank keeps its own piece.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from trainer.config.activation_policy import describe as describe_modes
from trainer.parallel.activation_checkpoint import apply_ac
from trainer.parallel.cpu_offload import materialize
from trainer.parallel.compile import apply_compile
from trainer.parallel.context_parallel import ContextParallel, apply_cp, check_cp_chunks
from trainer.parallel.expert_parallel import check_ep_divisibility, shard_experts
from trainer.parallel.fsdp import apply_fsdp, reshard_after_forward
from trainer.parallel.parallel_dims import ParallelDims
from trainer.parallel.pipeline import ZERO_BUBBLE, PipelineRunner, plan_stages, split_model
from trainer.parallel.tensor_parallel import apply_tp, check_tp_divisibility, loss_parallel_context
from trainer.registry import spec_of

logger = logging.getLogger("trainer")


@dataclass
class ParallelModel:
    """What the training loop needs from the layout.

    model: this rank's part of the model (all of it without pipeline parallel; else the union of
        its stages), for the optimizer and the checkpoint; parameter names as in the full model.
    stages: the modules that run (``[model]`` without pipeline parallel).
    pipeline: the PipelineRunner, or None.
    cp: the ContextParallel (its ``shard`` splits each batch's sequences), or None.
    loss_parallel: the logits are vocab-sharded DTensors; run the loss under ``loss_context()``.
    grad_scale: ranks FSDP2 averages the gradients over (1 without FSDP2).
    partial_grads: parameters whose gradients stay Partial over tp without FSDP2 (the
        sequence-parallel norm weights); ``reduce_partial_grads`` sums them before clipping.
    """

    model: nn.Module
    stages: list[nn.Module]
    pipeline: PipelineRunner | None = None
    cp: ContextParallel | None = None
    loss_parallel: bool = False
    grad_scale: int = 1
    partial_grads: list[nn.Parameter] = field(default_factory=list)
    expert_params: list[nn.Parameter] = field(default_factory=list)
    ep: int = 1

    def scale_expert_grads(self) -> None:
        """Expert parallel: divide the routed experts' gradients by ep (``trainer.parallel.expert_parallel``:
        they sum the tokens of all ep ranks, each scaled like the loss by dp / global tokens)."""
        if self.ep > 1:
            for prm in self.expert_params:
                if prm.grad is not None:
                    prm.grad.div_(self.ep)

    def loss_context(self):
        return loss_parallel_context(self.loss_parallel)

    def shard(self, t: torch.Tensor) -> torch.Tensor:
        return self.cp.shard(t) if self.cp is not None else t


def checkpoint_and_compile(module: nn.Module, config, dims: ParallelDims, device: torch.device,
                           layer_modes: list[str] | None) -> None:
    """``config``'s activation checkpointing of ``module``'s blocks (``layer_modes``: per block index,
    over ``activation_checkpoint.mode``), then its torch.compile: after TP and CP, before FSDP, in
    every model's parallelize."""
    apply_ac(module, config.activation_checkpoint.mode, config.activation_checkpoint.selective_ac_option,
             layer_modes=dict(enumerate(layer_modes or [])), device=device)
    if config.compile.enable and "model" in config.compile.components:
        # Ring attention communicates point to point: it runs eagerly between compiled regions.
        apply_compile(module, fullgraph=not dims.cp_enabled, backend=config.compile.backend)


def parallelize_decoder(
    model: nn.Module,
    config,
    dims: ParallelDims,
    mesh: DeviceMesh | None,
    device: torch.device,
    *,
    use_fsdp: bool,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    loss_fn=None,
    layer_modes: list[str] | None = None,
) -> ParallelModel:
    """Parallelize ``model`` (a meta-device ``Transformer``, float8-converted if asked) per ``config``
    (a JobConfig: parallelism, activation_checkpoint, compile, training.seed/local_batch_size) on
    ``mesh``, materialize it on ``device`` and initialize the weights.

    ``use_fsdp``: wrap with FSDP2 over ``dims.dp_mesh`` (also for one-process mixed precision);
    ``param_dtype``/``reduce_dtype``: its mixed precision. ``loss_fn``: the token-loss function the
    last pipeline stage calls (needed with pipeline parallel). ``layer_modes``: the activation mode of
    each layer (``trainer.estimate.offload.run_layer_modes``), None for ``activation_checkpoint.mode``
    alone.

    Raises ValueError naming the parallelism key when the model does not fit the layout (heads,
    FFN or vocabulary not divisible by tp, too few layers for the stages, bad split points, a
    micro-batch count the schedule cannot take, tied embeddings with TP or PP, attention chunks that
    do not fit the context-parallel split) or async TP is asked
    for off CUDA (RuntimeError).
    """
    p = config.parallelism
    args = model.args
    check_tp_divisibility(args, dims.tp)
    check_ep_divisibility(args, dims.ep, dims.tp)
    check_cp_chunks(args, config.training.seq_len, dims.cp)
    if config.validation.enable and config.validation.seq_len not in (-1, config.training.seq_len):
        check_cp_chunks(args, config.validation.seq_len, dims.cp, "validation.seq_len")
    if config.compile.enable and dims.tp_enabled:
        if device.type != "cuda":
            raise ValueError(
                "compile.enable: not supported with parallelism.tensor_parallel_degree > 1 on this device: with "
                f"torch {torch.__version__} a compiled block between tensor-parallel layers breaks DTensor's "
                "autograd around it (wrong gradients or an error in the backward, measured on the CPU)"
            )
        logger.warning("compile with tensor parallel: equality with eager is verified on the CPU only without "
                       "compile; see bench/run_gpu.sh for the GPU check")
    if config.compile.enable and dims.pp_enabled and p.pipeline_parallel_schedule in ZERO_BUBBLE:
        raise ValueError(
            f"parallelism.pipeline_parallel_schedule: {p.pipeline_parallel_schedule} splits the backward into input "
            "and weight gradients, which torch.compile'd blocks do not support; use Interleaved1F1B or 1F1B with "
            "compile.enable"
        )
    if p.enable_async_tensor_parallel and not (dims.tp_enabled and config.compile.enable):
        raise ValueError(
            "parallelism.enable_async_tensor_parallel: needs tensor_parallel_degree > 1 and compile.enable "
            f"(got tensor_parallel_degree {dims.tp}, compile.enable {config.compile.enable})"
        )

    spec = spec_of(args)
    tp_finish = spec.load(spec.tensor_parallel) if spec.tensor_parallel else None
    plan = None
    if dims.pp_enabled:
        pp_rank = mesh.get_local_rank("pp")
        plan = plan_stages(args.n_layers, dims.pp, pp_rank, p.pipeline_parallel_schedule,
                           p.pipeline_parallel_split_points)
        model, stages = split_model(model, plan)
        logger.info("pipeline: %d stages (%s), this rank runs %s with layers %s", plan.num_stages,
                    p.pipeline_parallel_schedule, list(plan.local_stages),
                    [list(plan.layers[s]) for s in plan.local_stages])
    else:
        stages = [model]

    # Per-layer activation modes (per_layer rules, mode budget; the caller's estimate chose them): the
    # same list on every stage.
    if layer_modes is not None:
        logger.info("activation modes per layer: %s", describe_modes(layer_modes))
    loss_parallel = dims.tp_enabled and not p.disable_loss_parallel
    cp = None
    expert_params: list[nn.Parameter] = []
    for stage in stages:
        if dims.tp_enabled:
            apply_tp(stage, mesh["tp"], loss_parallel=loss_parallel, async_tp=p.enable_async_tensor_parallel,
                     finish=tp_finish)
        expert_params += shard_experts(stage, mesh, dims.ep, dims.tp)
        if dims.cp_enabled:
            cp = apply_cp(stage, mesh["cp"])
        checkpoint_and_compile(stage, config, dims, device, layer_modes)
        if use_fsdp:
            apply_fsdp(stage, dims.dp_mesh(mesh), param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                       reshard_after_forward=reshard_after_forward(p.fsdp_reshard_after_forward, dims.pp_enabled),
                       expert_mesh=mesh["dp_shard_mod_ep"] if dims.ep_enabled else None, expert_params=expert_params,
                       cpu_offload=config.training.enable_cpu_offload)
    for stage in stages:
        materialize(stage, device, config.training.seed, config.training.enable_cpu_offload)
        stage.train()

    pipeline = None
    if plan is not None:
        n_micro = config.training.local_batch_size // p.pipeline_parallel_microbatch_size
        pipeline = PipelineRunner(stages, plan, mesh["pp"], p.pipeline_parallel_schedule, n_micro, loss_fn, device)
    partial = []
    if dims.tp_enabled and not use_fsdp:
        partial = [prm for name, prm in model.named_parameters() if name.endswith("norm.weight")]
    if expert_params:  # FSDP2 replaced the parameter objects: take them from the modules again
        from trainer.models.common.moe import moe_modules

        expert_params = [prm for _, moe in moe_modules(model) for prm in moe.experts.parameters()]
    return ParallelModel(model, stages, pipeline, cp, loss_parallel, dims.fsdp_size if use_fsdp else 1, partial,
                         expert_params, dims.ep)


def reduce_partial_grads(params: list[nn.Parameter]) -> None:
    """Turn Partial DTensor gradients into the parameters' own placements (a sum over the ranks)."""
    for prm in params:
        g = prm.grad
        if g is not None and g.placements != prm.placements:
            prm.grad = g.redistribute(placements=prm.placements)
