"""The training run: :class:`Trainer` (``setup``, ``train_step``, ``train``, ``close``) and
``main(config) -> exit code``, which ``python -m trainer`` calls.

Order of work (DESIGN.md section 4), as :meth:`Trainer.setup` reads top to bottom: device and
parallel layout from the torchrun environment -> tokenizer -> memory check of the flavor for this
machine -> process group (gloo on CPU, NCCL on GPUs) and device mesh -> data loaders (a bad source
fails here, before a model is built) -> model on the meta device -> float8 Linear layers -> the
parallelisms in their order (``trainer.parallel.parallelize``: TP/SP, EP, activation checkpointing,
compile per block, FSDP2, also on one GPU for bf16 mixed precision, pipeline stages), which
materialize and initialize the weights -> AdamW and the LR schedule -> resume from the newest
complete checkpoint (or the initial one) -> metrics, validation, profiler.
Then :meth:`Trainer.train` runs the loop (:meth:`Trainer.train_step`, validation, checkpoint,
profiler, garbage collection) and ends with the final checkpoint, the summary and the plot. The
numerics of one step (the exact token-mean scaling over micro-batches and ranks, the clip, the
non-finite flag) are in ``trainer/step.py``; its setup log lines, the plot and the one-line errors of
a failing data source in ``trainer/observe/outputs.py``; validation in ``trainer/evaluate.py``.

Non-finite values: a device-side flag records the first bad step without a host sync per step; it
is read at every log step and before every checkpoint save, before that step's update, so a
non-finite update never reaches a checkpoint (``trainer/step.py``, ``NonFiniteWatch``).

Exit codes: 0 done; 1 the run cannot proceed, with a one-line (or, for memory, a short) message and
no traceback; 75 preempted after a checkpoint; 124, 130: see ``trainer/run/guard.py``, which holds
the run's protections (dump folder lock, signals, hang watchdog, fault hooks).

As a library (one process, or one rank under torchrun)::

    trainer = Trainer(parse_args(["--training.steps", "10"]))
    try:
        if trainer.setup():      # False: nothing to train (seed checkpoint written, or resumed at the end)
            trainer.train()
    finally:
        trainer.close()
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import sys
import time
from pathlib import Path

# First: it sets the OpenMP wait policy before torch loads (trainer/environment.py says why).
from trainer.environment import (
    DTYPES,
    check_backend_environment,
    destroy_distributed,
    env_int,
    init_distributed,
    rank_zero_warnings,
    resolve_compute_dtype,
    setup_logging,
)

import torch
import torch.distributed as dist

import titan_kernels
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.folder import CheckpointError, complete_steps
from trainer.run.guard import Preempted, RunGuard, report_exit
from trainer.config import ConfigError, JobConfig
from trainer.data import build_tokenizer
from trainer.evaluate import Validator
from trainer.run.fault_tolerance import ReplicaGroups
from trainer.estimate.fit import fit_message
from trainer.estimate.offload import run_layer_modes
from trainer.observe.metrics import MetricsLogger
from trainer.models.common.moe import load_metrics, moe_modules, update_load_balance
from trainer.registry import build_model, model_args, spec_of
from trainer.optim import build_lr_scheduler, build_optimizer, lr_schedule
from trainer.observe.outputs import data_error, dataset_key, log_model, log_outputs, save_plot
from trainer.parallel.parallel_dims import ParallelDims
from trainer.parallel.parallelize import parallelize_decoder, reduce_partial_grads
from trainer.parallel.pipeline import pp_norm_group
from trainer.run.preflight import preflight
from trainer.observe.profiling import Profiler
from trainer import step as numerics  # one step's numerics (trainer/step.py), called through their module
from trainer.run.history import settle_previous_outputs
from trainer.step import NonFiniteWatch, TrainingError
from trainer.errors import ModelTooLargeError  # noqa: F401  (defined on the ground floor)

logger = logging.getLogger("trainer")


class Trainer:
    """One training run of ``config``: :meth:`setup`, then :meth:`train` (or :meth:`train_step` one
    step at a time), then :meth:`close` (always, also after an error).

    Args:
        config: a validated :class:`trainer.config.JobConfig`.
        world_size, rank, local_rank: this process's place among the ranks; None = from the torchrun
            environment (WORLD_SIZE, RANK, LOCAL_RANK), one process without it.

    After :meth:`setup`: ``device``, ``dims`` (the :class:`ParallelDims`), ``mesh``, ``model``,
    ``optimizer``, ``scheduler``, ``loader``, ``checkpointer``, ``metrics`` and ``validator`` (None
    without validation). ``step`` is the last finished optimizer step (the resumed one after a
    resume) and ``tokens_seen`` the tokens trained on over all ranks.

    Raises:
        TrainingError: an environment variable that is not an integer.
    """

    def __init__(self, config: JobConfig, *, world_size: int | None = None, rank: int | None = None,
                 local_rank: int | None = None) -> None:
        if config.fault_tolerance.enable:  # each replica group writes into a folder of its own
            config = dataclasses.replace(config, job=dataclasses.replace(
                config.job, dump_folder=str(Path(config.job.dump_folder) / f"replica_{config.fault_tolerance.replica_id}")))
        self.config = config
        self.world_size = env_int("WORLD_SIZE", 1) if world_size is None else world_size
        self.rank = env_int("RANK", 0) if rank is None else rank
        self.local_rank = env_int("LOCAL_RANK", 0) if local_rank is None else local_rank
        self.step = 0
        self.tokens_seen = 0
        self.device: torch.device | None = None
        self.dims: ParallelDims | None = None
        self.mesh = None
        self.model: torch.nn.Module | None = None
        self.optimizer = self.scheduler = None
        self.loader = self.val_loader = None
        self.checkpointer: Checkpointer | None = None
        self.metrics: MetricsLogger | None = None
        self.validator: Validator | None = None
        self._t_start = time.perf_counter()
        self._backend = contextlib.ExitStack()  # titan_kernels.use_backend, from the model's build to close()
        self._owns_process_group = False
        self._ready = False  # setup() returned True
        self._started = False  # the first step ran: data iterator, gc off, metrics clock, profiler
        self._stopped = False  # the loop's outputs are closed
        self._gc_was_enabled = False
        self._guard = RunGuard(config, self.rank, self.world_size)
        self._loaded = None  # (first step after a load, what was loaded): for the non-finite message
        self._ft = None  # trainer.run.fault_tolerance.ReplicaGroups with --fault_tolerance.enable

    # -- setup ---------------------------------------------------------------------------------------

    def setup(self) -> bool:
        """Build the run in the order of the module docstring: device, layout, tokenizer, memory
        check, process group and mesh, data, model, parallelisms, optimizer and schedule,
        checkpointer (and resume), metrics, validation, profiler.

        Returns True when there are steps to train; False when the run is complete already: the seed
        checkpoint (``--checkpoint.create_seed_checkpoint``) is written, or the resumed checkpoint
        holds step ``training.steps`` or later.

        Raises:
            ConfigError: a layout or batch size that does not fit the world size or the model.
            ModelTooLargeError: the flavor does not fit this machine (the message is the memory report).
            TrainingError: an unusable tokenizer, data source or checkpoint, or a missing optional package.
        """
        config, cfg_ckpt = self.config, self.config.checkpoint
        seed_only = cfg_ckpt.create_seed_checkpoint
        self._t_start = time.perf_counter()
        self._setup_device_and_layout()
        self._setup_tokenizer()
        preflight(config, self.args)  # the checks that need the model's args or the environment, before the build
        self.task = spec_of(self.args).load(spec_of(self.args).task)()  # batches, loss, validation (trainer/task.py)
        if not seed_only:  # before anything large is allocated: can this machine hold the run at all?
            message = fit_message(config, self.args, self.dims, self.compute_dtype)
            if message is not None:
                raise ModelTooLargeError(message)
        self._guard.before_process_group(self.device.type)
        self._setup_mesh()
        self._guard.claim_folder()  # a read-only, file or busy dump folder stops here, before data and model
        if not seed_only:
            self._setup_data()
            self._guard.warn_repeats(self.loader, self.grad_accum * config.training.local_batch_size * self.dims.dp_size,
                                     config.training.seq_len, config.training.steps)
        if config.kernels.backend != "auto":
            self._backend.enter_context(titan_kernels.use_backend(config.kernels.backend))
        self._build_model()
        if seed_only:
            self._save_seed_checkpoint()
            return False
        self._parallelize()
        self.task.setup(self)
        self.optimizer = build_optimizer(self.model, config.optimizer, mesh=self.mesh, seed=config.training.seed,
                                         cpu_offload=config.training.enable_cpu_offload, overlap=not self.dims.pp_enabled)
        self.scheduler = build_lr_scheduler(self.optimizer, lr_schedule(config.lr_scheduler, config.training.steps))
        self._setup_checkpoint()
        if config.fault_tolerance.enable:  # replica groups through a torchft Lighthouse
            self._ft = ReplicaGroups(self)
        if self.step >= config.training.steps:
            logger.info("checkpoint step %d >= training.steps %d: nothing to train", self.step,
                        config.training.steps)
            return False
        if self.rank == 0:  # an earlier run's records never mix with this one's (trainer/run/history.py)
            settle_previous_outputs(config.job.dump_folder, self.step, self._ckpt_folder, config.metrics.save_tb_folder)
        self._setup_metrics()
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        self._moe_mods = moe_modules(self.model)
        dp_group = self.dims.dp_group(self.mesh)
        self._distributed = dist.is_initialized() and self.world_size > 1
        # The ranks whose token losses add up to the global loss; False / None: one process.
        self._dp_group = dp_group if self._distributed else False
        self._moe_group = dp_group if self._distributed else None
        self._setup_validation()
        log_outputs(config)
        self._profiler = Profiler(config.profiling, config.job.dump_folder, self.rank, self.device, self.step)
        self._watch = NonFiniteWatch(self.device)
        self._guard.start()
        self._ready = True
        return True

    def _setup_device_and_layout(self) -> None:
        """The device, the parallel dimensions, micro-batches per step, compute dtype; seeds."""
        config, p, cfg_t = self.config, self.config.parallelism, self.config.training
        if torch.cuda.is_available():
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        try:
            self.dims = ParallelDims(p.data_parallel_replicate_degree, p.data_parallel_shard_degree, self.world_size,
                                     tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
                                     cp=p.context_parallel_degree, ep=p.expert_parallel_degree)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.grad_accum = config.grad_accum_steps(self.dims.dp_size)
        self.compute_dtype = resolve_compute_dtype(config, self.device)
        if config.checkpoint.create_seed_checkpoint and self.world_size != 1:
            raise ConfigError("--checkpoint.create_seed_checkpoint: run it on one process, got a world size of "
                              f"{self.world_size}")
        torch.manual_seed(cfg_t.seed)
        if cfg_t.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.benchmark = False

    def _setup_tokenizer(self) -> None:
        """The tokenizer and the model's arguments (the flavor with the tokenizer's vocabulary)."""
        config = self.config
        try:
            self.tokenizer = build_tokenizer(config.model.tokenizer_path or None)
        except (ValueError, OSError) as exc:  # missing, or not a tokenizer
            raise data_error(exc, "model.tokenizer_path") from None
        try:
            if config.model.flavor == "custom":  # the model a Hugging Face folder describes
                from trainer.hf import custom_model_args

                self.args = custom_model_args(config.checkpoint.initial_load_path, config.model.name,
                                              self.tokenizer.vocab_size, config.training.seq_len, config.model)
            else:
                self.args = model_args(config.model.name, config.model.flavor, self.tokenizer.vocab_size,
                                       config.training.seq_len, config.model)
        except ValueError as exc:  # e.g. a tokenizer larger than the flavor's embedding
            raise TrainingError(str(exc) if config.model.flavor == "custom" else f"--model.tokenizer_path: {exc}") \
                from None

    def _setup_mesh(self) -> None:
        """The process group (also one of one process for FSDP2's mixed precision) and the device mesh."""
        self.mixed_precision = self.compute_dtype != torch.float32
        self.use_fsdp = self.dims.fsdp_enabled or self.mixed_precision or self.config.training.enable_cpu_offload
        if self.config.parallelism.enable_async_tensor_parallel and self.device.type != "cuda":
            raise ConfigError("--parallelism.enable_async_tensor_parallel: needs CUDA devices (symmetric memory), "
                              f"got {self.device.type}")
        self._owns_process_group = init_distributed(self.world_size, self.rank, self.device,
                                                     single_process_group=self.use_fsdp,
                                                     timeout_seconds=self.config.comm.init_timeout_seconds)
        self.mesh = self.dims.build_mesh(self.device.type, single_process=self.use_fsdp)
        self.dp_rank = self.dims.dp_rank(self.mesh)

    def _setup_data(self) -> None:
        """The training loader (and the validation one); an empty or binary source fails now, in one line."""
        config, dp_size = self.config, self.dims.dp_size
        try:
            self.loader = self.task.build_loader(self, "training")
            self.loader.check()
        except (ValueError, RuntimeError, OSError) as exc:
            raise data_error(exc, dataset_key(config, "training")) from None
        if config.validation.enable:
            try:
                self.val_loader = self.task.build_loader(self, "validation")
                self.val_loader.check()
            except (ValueError, RuntimeError, OSError) as exc:
                raise data_error(exc, dataset_key(config, "validation")) from None

    def _build_model(self) -> None:
        """The model on the meta device (no memory yet); logs its size and the shape of a step."""
        self.model = build_model(self.args, device="meta")
        log_model(self.config, self.args, self.device, self.dims, self.compute_dtype, self.grad_accum)

    def _save_seed_checkpoint(self) -> None:
        """``--checkpoint.create_seed_checkpoint``: the initial weights as step 0, on the CPU."""
        config = self.config
        self.model.to_empty(device="cpu")
        self.model.init_weights(config.training.seed)
        folder = Path(config.job.dump_folder) / config.checkpoint.folder
        path = Checkpointer(folder, self.model, model_args=self.args, flavor=config.model.flavor).save_seed()
        logger.info("seed checkpoint written to %s", path)

    def _parallelize(self) -> None:
        """float8, the loss function, then every parallelism (trainer.parallel.parallelize), which
        materializes and initializes the weights."""
        config, dims, model = self.config, self.dims, self.model
        p, cfg_t = config.parallelism, config.training
        if config.float8.enable:
            from trainer.float8 import convert_model_to_float8

            try:
                convert_model_to_float8(model, config.float8)
            except RuntimeError as exc:  # --float8.impl torchao without torchao
                raise TrainingError(str(exc)) from None
        fused_loss, loss_fn = self.task.build_loss_fn(model, config, dims)
        spec = spec_of(self.args)
        parallelize = spec.load(spec.parallelize) if spec.parallelize else parallelize_decoder
        try:
            pm = parallelize(
                model, config, dims, self.mesh, self.device, use_fsdp=self.use_fsdp,
                param_dtype=self.compute_dtype if self.mixed_precision else None,
                reduce_dtype=DTYPES[cfg_t.mixed_precision_reduce] if self.mixed_precision else None, loss_fn=loss_fn,
                layer_modes=run_layer_modes(config, self.args, dims.tp, dims.cp, self.compute_dtype.itemsize if self.mixed_precision else 4,
                                            torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else ""))
        except ValueError as exc:  # the model does not fit the layout
            raise ConfigError(str(exc)) from None
        self.pm = pm
        self.model = pm.model
        self.loss_fn = loss_fn
        self._loss_context = contextlib.nullcontext if fused_loss else pm.loss_context
        self._shard = pm.shard if pm.cp is not None else None

    def _setup_checkpoint(self) -> None:
        """The checkpointer; resumes from the newest complete checkpoint, else the initial one if given."""
        config, c = self.config, self.config.checkpoint
        self._ckpt_folder = Path(config.job.dump_folder) / c.folder
        self.checkpointer = Checkpointer(
            self._ckpt_folder, self.model, self.optimizer, self.scheduler, self.loader, self.dp_rank,
            enable=c.enable, interval=c.interval, keep_latest_k=c.keep_latest_k, async_mode=c.async_mode,
            load_step=c.load_step, model_weights_only=c.model_weights_only, export_dtype=c.export_dtype,
            model_args=self.args, flavor=config.model.flavor, last_save_in_hf=c.last_save_in_hf,
            tokenizer_path=config.model.tokenizer_path, strict_verify=c.strict_verify, on_save_error=c.on_save_error,
        )
        try:
            # A run to resume wins; the initial checkpoint only starts a fresh one.
            if c.enable and self.checkpointer.resolve_load_step() is not None:
                self.step, self.tokens_seen = self.checkpointer.load()
            elif c.initial_load_path:
                self.step, self.tokens_seen = self.checkpointer.initial_load(
                    c.initial_load_path, c.initial_load_model_only, c.initial_load_in_hf)
        except CheckpointError as exc:
            raise TrainingError(str(exc)) from None
        if self.checkpointer.loaded_from is not None:
            self._loaded = (self.step + 1, self.checkpointer.loaded_from)

    def _setup_metrics(self) -> None:
        """The metrics logger (console, metrics.jsonl, TensorBoard, Weights & Biases) on rank 0."""
        config, m, cfg_t, c = self.config, self.config.metrics, self.config.training, self.config.checkpoint
        wandb_logger = None
        if m.enable_wandb and self.rank == 0:
            from trainer.observe.wandb_log import WandbLogger

            try:
                wandb_logger = WandbLogger(Path(config.job.dump_folder) / m.save_wandb_folder, m.wandb_project,
                                           config.to_dict(), name=config.job.description or None)
            except RuntimeError as exc:
                raise TrainingError(str(exc)) from None
        self.metrics = MetricsLogger(
            config.job.dump_folder, m.log_freq, self.device,
            self.args.flops_per_token(self.task.tokens_per_sample(config, self.args)),
            cfg_t.steps, enabled=self.rank == 0, enable_tensorboard=m.enable_tensorboard,
            tb_folder=m.save_tb_folder, enable_color=m.enable_color, wandb=wandb_logger, phases={
                "validation": config.validation.freq if config.validation.enable else 0,
                "checkpoint": c.interval if c.enable else (None if c.last_save_in_hf else 0)})
        logger.info(
            "data: %s, tokenizer %s (vocab %d); training steps %d..%d; setup took %.1fs",
            self.loader.source.name, self.tokenizer.name, self.tokenizer.vocab_size, self.step + 1, cfg_t.steps,
            time.perf_counter() - self._t_start)

    def _setup_validation(self) -> None:
        """The validator of the family's task (the training forward under no_grad on the validation loader)."""
        if self.val_loader is None:
            return
        try:  # Flux's reads the sample captions (and their images) now
            self.validator = self.task.build_validator(self)
        except (ValueError, RuntimeError, OSError) as exc:
            raise data_error(exc, dataset_key(self.config, "validation")) from None
        v = self.config.validation
        logger.info("validation: %s, %s every %d steps and at the end", self.val_loader.source.name,
                    "the whole split" if v.steps == -1 else f"{v.steps} batches", v.freq)

    # -- training ------------------------------------------------------------------------------------

    def train_step(self) -> torch.Tensor:
        """Run optimizer step ``self.step + 1``: this rank's micro-batches through forward and backward,
        gradient reductions, clip, the non-finite check (on log and checkpoint steps), the optimizer
        and LR schedule steps, the MoE routing bias, and the step's metrics.

        :meth:`train` also validates, checkpoints, profiles and collects garbage after each step.

        Returns the step's mean token loss over all ranks and micro-batches: a float32 scalar on the
        device, detached (reading it waits for the device).

        Raises:
            RuntimeError: before a :meth:`setup` that returned True, after the last step, or after the
                run was stopped (the end of :meth:`train`, or :meth:`close`).
            NonFiniteLossError: at a log or checkpoint step, if this step or an earlier one was not
                finite; raised before this step's update, ``step`` stays at the previous step.
            TrainingError: the data source failed.
        """
        self._check_running("train_step")
        cfg_t, dims = self.config.training, self.dims
        if self.step >= cfg_t.steps:
            raise RuntimeError(f"Trainer.train_step: all {cfg_t.steps} training.steps are done")
        self._start()
        if self._ft is None:
            step = self.step + 1
            loss, data_wait = self._forward_backward()
        else:  # replica groups: the step repeats until the quorum commits it (trainer/run/fault_tolerance.py)
            step, loss, data_wait = self._ft.run_step(self, self._forward_backward)
        grad_norm = numerics.clip_grad_norm_(self._params, cfg_t.max_norm, pp_group=pp_norm_group(self.mesh and self.mesh["pp"]))
        self._guard.faults.mid_step(step)  # test-only fault hooks (trainer/run/fault_injection.py)
        self._watch.update(step, loss, grad_norm)
        if self.checkpointer.should_save(step, cfg_t.steps) or self.metrics.should_log(step):
            self._watch.check(step, self._kept, self._loaded)  # the only host syncs of a step (module docstring)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        # MoE: the step's tokens per expert (over the data-parallel ranks) move the routing bias.
        moe_load = update_load_balance(self._moe_mods, self._moe_group)
        n_step_tokens = self.grad_accum * cfg_t.local_batch_size * self.task.tokens_per_sample(self.config, self.args)
        self.tokens_seen += n_step_tokens * dims.dp_size * (self._ft.participants if self._ft else 1)
        self.step = step
        # Per device: the tp, cp and pp ranks of one data-parallel rank share its tokens.
        logged = self.metrics.should_log(step)  # then on every rank (reductions inside): MTP loss, QK-clip's activity
        extra = numerics.step_metrics(self.model, self.optimizer, self._dp_group) if logged else {}
        self.metrics.step(step, n_step_tokens / (dims.tp * dims.cp * dims.pp), data_wait, loss=loss,
                          grad_norm=grad_norm, lr=lr,
                          extra=(lambda: {**load_metrics(self._moe_mods, moe_load), **extra})
                          if self._moe_mods or extra else None)
        return loss

    def _forward_backward(self) -> tuple[torch.Tensor, float]:
        """This rank's micro-batches of the next step through forward and backward, gradient reductions
        included; returns the mean token loss and the seconds spent waiting for data."""
        batches, data_wait = self._next_batches()
        loss = self.task.forward_backward(self, batches)
        reduce_partial_grads(self.pm.partial_grads)
        self.pm.scale_expert_grads()
        return loss, data_wait

    def train(self) -> None:
        """Train the steps after ``self.step`` up to ``training.steps``. After each step: validation
        (every ``validation.freq`` steps and at the last), a checkpoint (every ``checkpoint.interval``
        steps, at the last, and where the ranks agree to stop after a preemption signal), the
        profiler's window, garbage collection (every ``training.gc_freq``). At the end (also on an
        error): the profiler stops, the last checkpoint write completes and the metrics files close;
        then (rank 0) the summary and ``metrics.png``.

        Raises:
            RuntimeError: before a :meth:`setup` that returned True, or when the run was stopped already.
            NonFiniteLossError: at the first check that finds a non-finite step (module docstring).
            TrainingError, CheckpointError, Preempted: data failed; a save failed; preempted (saved).
        """
        cfg_t, v = self.config.training, self.config.validation
        self._check_running("train")
        self._start()
        try:
            while self.step < cfg_t.steps:
                self.train_step()
                step = self.step
                self._guard.step_done(step)
                if self.validator is not None and (step % v.freq == 0 or step == cfg_t.steps):
                    self._guard.long_phase()
                    with self._profiler.validation():
                        result = self.validator.evaluate()
                    self.metrics.exclude(result["val_time_s"])
                    self.metrics.log_validation(step, result)
                if v.sample_prompts and (step == cfg_t.steps or (self.validator is not None and step % v.freq == 0)):
                    self.metrics.log_samples(step, self._samples())  # trainer/generate/samples.py
                self.checkpointer.poll()
                stop = self._guard.should_stop()  # a preemption signal: every rank stops after this step
                if self.checkpointer.should_save(step, cfg_t.steps) or (stop and self.config.checkpoint.enable):
                    self._guard.long_phase()
                    t_save = time.perf_counter()
                    self.checkpointer.save(step, self.tokens_seen, last=step == cfg_t.steps)
                    self.metrics.phase("checkpoint", time.perf_counter() - t_save)
                self._profiler.step(step)
                if stop and step < cfg_t.steps:
                    self.checkpointer.wait()  # an async write is published before the exit
                    raise self._guard.stopped(step)
                if step % cfg_t.gc_freq == 0:
                    gc.collect(1)
        except BaseException as exc:
            self._guard.failed(exc)
            raise
        finally:
            self._stop(*sys.exc_info())
        self.metrics.print_summary()
        if self.rank == 0 and self.config.metrics.save_plot:
            save_plot(self.config.job.dump_folder)
        logger.info("done in %.1fs", time.perf_counter() - self._t_start)

    def _samples(self) -> list[tuple[str, str]]:
        """(prompt, greedy completion) of each ``validation.sample_prompts``, the time excluded from tokens/s."""
        from trainer.generate.samples import sample_completions

        t0 = time.perf_counter()
        v = self.config.validation
        out = sample_completions(self.model, self.tokenizer, v.sample_prompts, v.sample_max_new_tokens)
        self.metrics.exclude(time.perf_counter() - t0)
        return out

    def _check_running(self, name: str) -> None:
        if not self._ready:
            raise RuntimeError(f"Trainer.{name}: call setup() first (and only when it returned True)")
        if self._stopped:
            raise RuntimeError(f"Trainer.{name}: the run is over (train() ended or close() was called)")

    def _start(self) -> None:
        """Before the first step: the data iterator, gc by hand, the metrics clock, the profiler."""
        if self._started:
            return
        self._started = True
        self._data_iter = iter(self.loader)
        self._gc_was_enabled = gc.isenabled()
        gc.disable()  # collected every gc_freq steps instead, at the same point on every rank
        gc.collect()
        self.metrics.start()
        self._profiler.__enter__()

    def _next_batches(self) -> tuple[list[dict[str, torch.Tensor]], float]:
        """This rank's ``grad_accum`` micro-batches of the next step and the seconds spent waiting for them."""
        return numerics.next_batches(self._data_iter, self.grad_accum, self.device.type == "cuda",
                                     dataset_key(self.config, "training"))

    def _kept(self) -> str:
        """Which checkpoint is good, for the non-finite message."""
        done = complete_steps(self._ckpt_folder) if self.config.checkpoint.enable else []
        return f"the last good checkpoint is step-{done[-1]} in {self._ckpt_folder}" if done else "no checkpoint was written"

    # -- the end -------------------------------------------------------------------------------------

    def _stop(self, exc_type=None, exc=None, tb=None) -> None:
        """The loop's outputs end: profiler (an out-of-memory error leaves a CUDA memory snapshot),
        checkpointer (an async write completes), metrics files and Weights & Biases run."""
        if self._stopped:
            return
        self._stopped = True
        getattr(self.optimizer, "synchronize", lambda: None)()  # CPU offload: the last update, in the background
        if self._started:
            self._profiler.__exit__(exc_type, exc, tb)
        if self.checkpointer is not None:
            self.checkpointer.close()
        if self.metrics is not None:
            self.metrics.close()

    def close(self) -> None:
        """Release the run: what :meth:`train` did not close, the guard (lock, signal handlers, watchdog),
        the kernel backend choice, gc back on if it was, the process group if the trainer started it.
        Safe after a failed or partial setup and when called twice."""
        self._stop()
        self._ft = self._ft and self._ft.close()  # the torchft Manager (None after)
        self._guard.close()
        self._backend.close()
        if self._gc_was_enabled:
            gc.enable()
            self._gc_was_enabled = False
        if self._owns_process_group:
            destroy_distributed(self.mesh)
        self._owns_process_group = False


# ------------------------------------------------------------------------------------------------
# main


def main(config: JobConfig) -> int:
    """Run the training job described by ``config``; returns the process exit code.

    Reads RANK, WORLD_SIZE and LOCAL_RANK (set by torchrun); without them, one process.
    Raises ConfigError for a layout or batch size that does not fit the world size (``__main__``
    reports it); every other expected failure is reported here and gives exit code 1.
    """
    world_size = env_int("WORLD_SIZE", 1)
    rank = env_int("RANK", 0)
    local_rank = env_int("LOCAL_RANK", 0)
    check_backend_environment()
    setup_logging(rank)
    trainer = Trainer(config, world_size=world_size, rank=rank, local_rank=local_rank)
    try:
        with rank_zero_warnings(rank):
            if trainer.setup():
                trainer.train()
        return 0
    except (TrainingError, CheckpointError, Preempted) as exc:  # one line (memory: a short report), exit code
        return report_exit(exc, rank, world_size, same_on_all_ranks=isinstance(exc, ModelTooLargeError))
    finally:
        with rank_zero_warnings(rank):
            trainer.close()
        destroy_distributed(trainer.mesh)
