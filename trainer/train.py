"""The training loop: ``main(config) -> exit code``.

Order of work (DESIGN.md section 4): process group and device from the torchrun environment (gloo on
CPU, NCCL on GPUs) -> tokenizer -> memory check of the flavor for this machine -> model on the meta
device -> activation checkpointing -> compile per block -> FSDP2 (data parallel, HSDP; also on one
GPU for bf16 mixed precision) -> materialize and initialize (or the seed checkpoint) -> AdamW and the
LR schedule -> data loader -> resume from the newest complete checkpoint -> loop -> final checkpoint
and summary.

One optimizer step takes ``grad_accum = global_batch_size / (local_batch_size * dp)`` micro-batches
per rank; the numerics of a step (the exact token-mean scaling over micro-batches and ranks, the
clip, the non-finite flag) are in ``trainer/step.py``, the process around the run (OpenMP policy,
logging, process group) in ``trainer/environment.py``.

Non-finite values. A step does not wait for the device to check its loss and gradient norm (that
host synchronisation would stall every step): a device-side flag records the first step whose
loss or gradient norm is not finite, and the flag is read at every log step (step 1, every
``metrics.log_freq`` steps, the last step) and before every checkpoint save, before that step's
optimizer update. A flagged run stops there (exit 1) naming the first bad step and the last good
checkpoint, so a non-finite update is never written to a checkpoint and at most
``log_freq - 1`` updates follow the first bad one (they are lost with the run, which restarts from
that checkpoint).

Exit codes: 0 done; 1 the run cannot proceed (model too large for the machine, non-finite loss,
unusable checkpoint, data errors), with a one-line (or, for memory, a short) message and no traceback.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import sys
import time
from pathlib import Path

# First: it sets the OpenMP wait policy before torch loads (trainer/environment.py says why).
from trainer.environment import (
    DTYPES,
    init_distributed,
    rank_zero_warnings,
    resolve_compute_dtype,
    setup_logging,
)

import torch
import torch.distributed as dist

from trainer.config import ConfigError, JobConfig
# The step's pieces, also importable from here (the tests patch forward_backward and clip_grad_norm_
# on this module: the loop looks them up here).
from trainer.step import (  # noqa: F401
    IGNORE_INDEX,
    NonFiniteLossError,
    NonFiniteWatch,
    TrainingError,
    clip_grad_norm_,
    forward_backward,
    micro_batch_loss,
)

_rank_zero_warnings = rank_zero_warnings  # the name tests/trainer/test_train.py uses

logger = logging.getLogger("trainer")


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    try:
        return int(raw) if raw else default
    except ValueError:
        raise TrainingError(f"environment variable {name}: expected an integer, got {raw!r}") from None


def _data_error(exc: Exception, key: str) -> TrainingError:
    """A one-line error for a data source that failed, naming the key (``key`` unless the message does)."""
    msg = str(exc)
    return TrainingError(f"--{msg}" if msg.startswith(("training.", "validation.")) else f"--{key}: {msg}")


def _dataset_key(config: JobConfig, section: str) -> str:
    """The config key of the source a ``section`` reads (validation's held-out part: training's)."""
    v, t = config.validation, config.training
    if section == "validation" and (v.dataset_path or v.dataset):
        return "validation.dataset_path" if v.dataset_path else "validation.dataset"
    return "training.dataset_path" if t.dataset_path else "training.dataset"


def _fit_message(config: JobConfig, args, dims, compute_dtype: torch.dtype) -> str | None:
    from trainer.estimate import Layout, detect_devices, fit_report

    p = config.parallelism
    return fit_report(
        args, config.model.flavor, Layout(dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp, dims.cp, ep=dims.ep),
        config.training.local_batch_size, config.training.seq_len, compute_bytes=torch.finfo(compute_dtype).bits // 8,
        ac_mode=config.activation_checkpoint.mode,
        selective_ac_option=config.activation_checkpoint.selective_ac_option,
        devices=detect_devices(), pp_schedule=p.pipeline_parallel_schedule,
        microbatch_size=p.pipeline_parallel_microbatch_size, grad_accum=config.grad_accum_steps(dims.dp_size),
        fused_loss=not (dims.tp_enabled and p.disable_loss_parallel),
    )


def _build_tokenizer(config: JobConfig):
    from trainer.data import build_tokenizer

    path = config.model.tokenizer_path or None
    try:
        return build_tokenizer(path)
    except (ValueError, OSError) as exc:
        raise TrainingError(f"--model.tokenizer_path: {exc}") from None


def _schedule(config: JobConfig):
    from trainer.optim import LRSchedule

    s, steps = config.lr_scheduler, config.training.steps
    warmup = s.warmup_steps
    if warmup > steps:
        logger.warning("lr_scheduler.warmup_steps=%d > training.steps=%d: warming up over all %d steps",
                       warmup, steps, steps)
        warmup = steps
    return LRSchedule(steps=steps, warmup_steps=warmup, decay_type=s.decay_type, decay_ratio=s.decay_ratio,
                      min_lr_factor=s.min_lr_factor)


# ------------------------------------------------------------------------------------------------
# main


def main(config: JobConfig) -> int:
    """Run the training job described by ``config``; returns the process exit code.

    Reads RANK, WORLD_SIZE and LOCAL_RANK (set by torchrun); without them, one process.
    Raises ConfigError for a layout or batch size that does not fit the world size (``__main__``
    reports it); every other expected failure is reported here and gives exit code 1.
    """
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    setup_logging(rank)
    gc_was_enabled = gc.isenabled()
    try:
        with rank_zero_warnings(rank):
            return _run(config, world_size, rank, local_rank)
    except TrainingError as exc:
        where = f"[rank {rank}] " if world_size > 1 else ""
        print(f"python -m trainer: error: {where}{exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        if gc_was_enabled:
            gc.enable()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def _run(config: JobConfig, world_size: int, rank: int, local_rank: int) -> int:
    from trainer.checkpoint import CheckpointError, Checkpointer, complete_steps
    from trainer.metrics import MetricsLogger
    from trainer.models.common import build_model, format_params, model_args
    from trainer.models.llama import cross_entropy_loss, linear_cross_entropy_loss
    from trainer.models.moe import load_metrics, moe_modules, update_load_balance
    from trainer.optim import build_lr_scheduler, build_optimizer
    from trainer.parallel.compile import compile_loss
    from trainer.parallel.parallel_dims import ParallelDims
    from trainer.parallel.parallelize import parallelize_llama, reduce_partial_grads
    from trainer.parallel.pipeline import pp_norm_group

    import titan_kernels

    t_start = time.perf_counter()
    cfg_t, cfg_ckpt = config.training, config.checkpoint
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    p = config.parallelism
    try:
        dims = ParallelDims(p.data_parallel_replicate_degree, p.data_parallel_shard_degree, world_size,
                            tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree, cp=p.context_parallel_degree,
                            ep=p.expert_parallel_degree)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    grad_accum = config.grad_accum_steps(dims.dp_size)
    compute_dtype = resolve_compute_dtype(config, device)
    if cfg_ckpt.create_seed_checkpoint and world_size != 1:
        raise ConfigError(f"--checkpoint.create_seed_checkpoint: run it on one process, got a world size of {world_size}")

    torch.manual_seed(cfg_t.seed)
    if cfg_t.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False

    tokenizer = _build_tokenizer(config)
    try:
        args = model_args(config.model.name, config.model.flavor, tokenizer.vocab_size, cfg_t.seq_len, config.model)
    except ValueError as exc:  # e.g. a tokenizer larger than the flavor's embedding
        raise TrainingError(f"--model.tokenizer_path: {exc}") from None

    # Before anything large is allocated: can this machine hold the run at all?
    if not cfg_ckpt.create_seed_checkpoint:
        message = _fit_message(config, args, dims, compute_dtype)
        if message is not None:
            if rank == 0:
                print(f"python -m trainer: error: {message}", file=sys.stderr, flush=True)
            return 1

    mixed_precision = compute_dtype != torch.float32
    use_fsdp = dims.fsdp_enabled or mixed_precision
    if p.enable_async_tensor_parallel and device.type != "cuda":
        raise ConfigError("--parallelism.enable_async_tensor_parallel: needs CUDA devices (symmetric memory), "
                          f"got {device.type}")
    init_distributed(world_size, rank, device, single_process_group=use_fsdp)
    mesh = dims.build_mesh(device.type, single_process=use_fsdp)
    dp_rank = dims.dp_rank(mesh)

    # The data first: an empty or binary dataset fails now, in one line, before a model is built.
    loader = val_loader = None
    if not cfg_ckpt.create_seed_checkpoint:
        from trainer.data import build_dataloader

        try:
            loader = build_dataloader(config, tokenizer, dp_rank, dims.dp_size)
            loader.check()
        except (ValueError, RuntimeError, OSError) as exc:
            raise _data_error(exc, _dataset_key(config, "training")) from None
        if config.validation.enable:
            from trainer.validate import build_validation_loader

            try:
                val_loader = build_validation_loader(config, tokenizer, dp_rank, dims.dp_size)
                val_loader.check()
            except (ValueError, RuntimeError, OSError) as exc:
                raise _data_error(exc, _dataset_key(config, "validation")) from None

    stack = contextlib.ExitStack()
    if config.kernels.backend != "auto":
        stack.enter_context(titan_kernels.use_backend(config.kernels.backend))
    with stack:
        model = build_model(args, device="meta")
        n_params = args.num_params()
        moe = getattr(args, "moe", None)
        logger.info(
            "model %s %s: %s = %s (dim %d, %d layers, %d heads, %d kv heads, %s, vocab %d); "
            "%.3g FLOPs/token", config.model.name, config.model.flavor, f"{n_params:,}", format_params(args), args.dim,
            args.n_layers, args.n_heads, args.kv_heads,
            f"ffn {args.ffn_hidden_dim}" if moe is None else
            f"{moe.num_experts} experts of {moe.hidden_dim}, top-{moe.top_k}, balance {moe.load_balance}",
            args.vocab_size, args.flops_per_token(cfg_t.seq_len))
        logger.info(
            "device %s, %s, compute %s, %d micro-batch(es) of %d x %d tokens per step and rank",
            device, dims.describe(), str(compute_dtype).replace("torch.", ""), grad_accum, cfg_t.local_batch_size,
            cfg_t.seq_len)

        if cfg_ckpt.create_seed_checkpoint:
            model.to_empty(device="cpu")
            model.init_weights(cfg_t.seed)
            folder = Path(config.job.dump_folder) / cfg_ckpt.folder
            path = Checkpointer(folder, model, model_args=args, flavor=config.model.flavor).save_seed()
            logger.info("seed checkpoint written to %s", path)
            return 0

        if config.float8.enable:
            from trainer.float8 import convert_model_to_float8

            try:
                convert_model_to_float8(model, config.float8)
            except RuntimeError as exc:  # --float8.impl torchao without torchao
                raise TrainingError(str(exc)) from None
        # The loss is the fused output projection + cross-entropy (vocab-parallel under TP): the last
        # stage returns hidden states, the logits are never materialized, and the loss needs no
        # loss_parallel() context. It is one op, so there is nothing for compile to fuse. The logits
        # path stays for --parallelism.disable_loss_parallel under TP and a float8 output layer.
        fused_loss = not (dims.tp_enabled and p.disable_loss_parallel) and type(model.output) in (torch.nn.Linear, type(None))
        if fused_loss:
            model.return_hidden = True
            loss_fn = functools.partial(linear_cross_entropy_loss, model)
        else:
            loss_fn = cross_entropy_loss
            if config.compile.enable and "loss" in config.compile.components:
                loss_fn = compile_loss(cross_entropy_loss, config.compile.backend)
        try:
            pm = parallelize_llama(
                model, config, dims, mesh, device, use_fsdp=use_fsdp,
                param_dtype=compute_dtype if mixed_precision else None,
                reduce_dtype=DTYPES[cfg_t.mixed_precision_reduce] if mixed_precision else None, loss_fn=loss_fn,
            )
        except ValueError as exc:  # the model does not fit the layout
            raise ConfigError(str(exc)) from None
        model = pm.model
        loss_context = contextlib.nullcontext if fused_loss else pm.loss_context

        optimizer = build_optimizer(model, config.optimizer)
        scheduler = build_lr_scheduler(optimizer, _schedule(config))

        ckpt_folder = Path(config.job.dump_folder) / cfg_ckpt.folder
        checkpointer = Checkpointer(
            ckpt_folder, model, optimizer, scheduler, loader, dp_rank, enable=cfg_ckpt.enable,
            interval=cfg_ckpt.interval, keep_latest_k=cfg_ckpt.keep_latest_k, async_mode=cfg_ckpt.async_mode,
            load_step=cfg_ckpt.load_step, model_weights_only=cfg_ckpt.model_weights_only,
            export_dtype=cfg_ckpt.export_dtype, model_args=args, flavor=config.model.flavor,
            last_save_in_hf=cfg_ckpt.last_save_in_hf,
        )
        start_step, tokens_seen = 0, 0
        try:
            # A run to resume wins; the initial checkpoint only starts a fresh one.
            if cfg_ckpt.enable and checkpointer.resolve_load_step() is not None:
                start_step, tokens_seen = checkpointer.load()
            elif cfg_ckpt.initial_load_path:
                start_step, tokens_seen = checkpointer.initial_load(
                    cfg_ckpt.initial_load_path, cfg_ckpt.initial_load_model_only, cfg_ckpt.initial_load_in_hf)
        except CheckpointError as exc:
            raise TrainingError(str(exc)) from None
        if start_step >= cfg_t.steps:
            logger.info("checkpoint step %d >= training.steps %d: nothing to train", start_step, cfg_t.steps)
            checkpointer.close()
            return 0

        wandb_logger = None
        if config.metrics.enable_wandb and rank == 0:
            from trainer.wandb_log import WandbLogger

            try:
                wandb_logger = WandbLogger(Path(config.job.dump_folder) / config.metrics.save_wandb_folder,
                                           config.metrics.wandb_project, config.to_dict(),
                                           name=config.job.description or None)
            except RuntimeError as exc:
                raise TrainingError(str(exc)) from None
        metrics = MetricsLogger(
            config.job.dump_folder, config.metrics.log_freq, device, args.flops_per_token(cfg_t.seq_len),
            cfg_t.steps, enabled=rank == 0, enable_tensorboard=config.metrics.enable_tensorboard,
            tb_folder=config.metrics.save_tb_folder, enable_color=config.metrics.enable_color, wandb=wandb_logger,
        )
        logger.info(
            "data: %s, tokenizer %s (vocab %d); training steps %d..%d; setup took %.1fs",
            loader.source.name, tokenizer.name, tokenizer.vocab_size, start_step + 1, cfg_t.steps,
            time.perf_counter() - t_start)

        params = [p for p in model.parameters() if p.requires_grad]
        moe_mods = moe_modules(model)
        dp_group = dims.dp_group(mesh)
        distributed = dist.is_initialized() and world_size > 1
        validator = None
        if val_loader is not None:
            from trainer.validate import Validator

            validator = Validator(
                val_loader, config.validation.steps, device,
                lambda inputs, labels, pos: micro_batch_loss(model, loss_fn, inputs, labels, pos),
                dp_group=dp_group if distributed else False, distributed=distributed,
                document_masking=cfg_t.document_masking, shard=pm.shard if pm.cp is not None else None,
                loss_context=loss_context, pipeline=pm.pipeline, pipeline_batch=cfg_t.local_batch_size,
            )
            logger.info("validation: %s, %s every %d steps and at the end", val_loader.source.name,
                        "the whole split" if config.validation.steps == -1 else f"{config.validation.steps} batches",
                        config.validation.freq)
        _log_outputs(config)
        from trainer.profiling import Profiler

        profiler = Profiler(config.profiling, config.job.dump_folder, rank, device, start_step)
        watch = NonFiniteWatch(device)

        def kept() -> str:
            done = complete_steps(ckpt_folder) if cfg_ckpt.enable else []
            return f"the last good checkpoint is step-{done[-1]} in {ckpt_folder}" if done else "no checkpoint was written"

        data_iter = iter(loader)
        gc.disable()  # collected every gc_freq steps instead, at the same point on every rank
        gc.collect()
        metrics.start()
        profiler.__enter__()
        try:
            for step in range(start_step + 1, cfg_t.steps + 1):
                data_wait = 0.0
                batches = []
                for _ in range(grad_accum):
                    t0 = time.perf_counter()
                    try:
                        batch = next(data_iter)
                    except (ValueError, RuntimeError, OSError) as exc:  # e.g. a bad file deep in a folder
                        raise _data_error(exc, _dataset_key(config, "training")) from None
                    if device.type == "cuda":
                        # A copy from pageable memory first waits for the stream (a host sync every step);
                        # from pinned memory the non_blocking copies in forward_backward are asynchronous.
                        batch = {k: v.pin_memory() for k, v in batch.items()}
                    batches.append(batch)
                    data_wait += time.perf_counter() - t0
                loss = forward_backward(model, loss_fn, batches, device, dp_size=pm.grad_scale,
                                        dp_group=dp_group if distributed else False,
                                        document_masking=cfg_t.document_masking, shard=pm.shard if pm.cp is not None else None,
                                        loss_context=loss_context, pipeline=pm.pipeline)
                reduce_partial_grads(pm.partial_grads)
                pm.scale_expert_grads()
                grad_norm = clip_grad_norm_(params, cfg_t.max_norm, pp_group=pp_norm_group(mesh and mesh["pp"]))
                watch.update(step, loss, grad_norm)
                saving = checkpointer.should_save(step, cfg_t.steps)
                if saving or metrics.should_log(step):  # the only host syncs of a step (module docstring)
                    watch.check(step, kept)
                lr = scheduler.get_last_lr()[0]
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                # MoE: the step's tokens per expert (over the data-parallel ranks) move the routing bias.
                moe_load = update_load_balance(moe_mods, dp_group if distributed else None)
                n_step_tokens = grad_accum * cfg_t.local_batch_size * cfg_t.seq_len
                tokens_seen += n_step_tokens * dims.dp_size
                # Per device: the tp, cp and pp ranks of one data-parallel rank share its tokens.
                metrics.step(step, n_step_tokens / (dims.tp * dims.cp * dims.pp), data_wait, loss=loss,
                             grad_norm=grad_norm, lr=lr,
                             extra=(lambda: load_metrics(moe_mods, moe_load)) if moe_mods else None)
                if validator is not None and (step % config.validation.freq == 0 or step == cfg_t.steps):
                    result = validator.evaluate()
                    metrics.exclude(result["val_time_s"])
                    metrics.log_validation(step, result)
                checkpointer.poll()
                if saving:
                    checkpointer.save(step, tokens_seen, last=step == cfg_t.steps)
                profiler.step(step)
                if step % cfg_t.gc_freq == 0:
                    gc.collect(1)
        finally:
            profiler.__exit__(*sys.exc_info())
            checkpointer.close()
            metrics.close()
        metrics.print_summary()
        if rank == 0 and config.metrics.save_plot:
            _save_plot(config.job.dump_folder)
        logger.info("done in %.1fs", time.perf_counter() - t_start)
    return 0


def _log_outputs(config: JobConfig) -> None:
    """Say where the run writes: metrics, TensorBoard, checkpoints, plot, traces."""
    dump = Path(config.job.dump_folder)
    m, c, pr = config.metrics, config.checkpoint, config.profiling
    parts = [f"metrics {dump / 'metrics.jsonl'}"]
    parts.append(f"TensorBoard {dump / m.save_tb_folder}" if m.enable_tensorboard
                 else "TensorBoard off (--metrics.enable_tensorboard)")
    parts.append(f"checkpoints {dump / c.folder}" if c.enable else "checkpoints off (--checkpoint.enable)")
    if m.save_plot:
        parts.append(f"plot {dump / 'metrics.png'} at the end")
    if pr.enable_profiling:
        parts.append(f"profiler traces {dump / pr.save_traces_folder}")
    if pr.enable_memory_snapshot:
        parts.append(f"memory snapshots {dump / pr.save_memory_snapshot_folder}")
    logger.info("outputs: %s", "; ".join(parts))


def _save_plot(dump_folder: str) -> None:
    """``<dump_folder>/metrics.png`` from metrics.jsonl; a missing matplotlib is reported, not fatal."""
    from trainer.plot import plot_runs

    try:
        path = plot_runs([dump_folder], Path(dump_folder) / "metrics.png")
    except ImportError as exc:
        logger.warning("metrics.png not drawn: %s (pip install matplotlib)", exc)
        return
    logger.info("plot of the metrics written to %s", path)
