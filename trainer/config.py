"""The trainer's configuration: dataclass sections, TOML files and ``--section.key value`` overrides.

A run's configuration is built in layers, each overriding the one before:

1. the dataclass defaults below;
2. a TOML file: ``--config FILE.toml`` if given, otherwise the flavor's own file
   ``trainer/configs/<flavor>.toml`` (the flavor is ``--flavor``/``--model.flavor`` or ``debugmodel``);
3. command-line overrides ``--section.key value`` (also ``--section.key=value``).

Keys follow torchtitan's names where the meaning is the same (``--training.steps``,
``--lr_scheduler.warmup_steps``, ``--parallelism.data_parallel_shard_degree``...). ``--flavor`` is
short for ``--model.flavor``. A boolean key works as a bare flag (``--checkpoint.enable``) or with a
value (``--checkpoint.enable false``). ``--help`` lists every key with its default and meaning.

Every error (unknown key, wrong type, bad value) is a :class:`ConfigError` whose message is one line
naming the key; for a misspelled key it suggests the closest existing one.

This module imports neither torch nor the rest of the trainer, so ``--help`` and config errors are fast.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import pathlib
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

CONFIG_DIR = pathlib.Path(__file__).resolve().parent / "configs"


class ConfigError(ValueError):
    """A bad configuration: unknown key, wrong type or invalid value. The message is one line."""


def _opt(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A config field with its help text (and, for strings, the allowed values)."""
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Job:
    """Where the run writes its outputs."""

    dump_folder: str = _opt("./outputs", "Folder for metrics.jsonl, TensorBoard logs and checkpoints.")
    description: str = _opt("", "Free-text description of the run, printed at start.")
    print_config: bool = _opt(False, "Print the resolved configuration (as TOML) before training.")


@dataclass
class Model:
    """Which model to build."""

    name: str = _opt("llama3", "Model family: llama3, or qwen3 (dense and mixture-of-experts).",
                     choices=("llama3", "qwen3"))
    flavor: str = _opt(
        "debugmodel",
        "Model size: debugmodel, 1B, 3B (Llama 3.2), 8B, 70B, 405B (Llama 3.1); for qwen3: debugmodel, "
        "debugmodel_moe, 0.6B, 1.7B, 4B, 8B, 14B, 32B, 30B-A3B, 235B-A22B (trainer/configs/qwen3_<flavor>.toml). "
        "Also --flavor.",
    )
    tokenizer_path: str = _opt(
        "",
        "Tokenizer file: a Hugging Face tokenizer.json, a tiktoken BPE file (Llama 3's tokenizer.model) "
        "or a SentencePiece .model, detected from the file. Empty = the built-in byte-level tokenizer.",
    )
    moe_load_balance: str = _opt(
        "bias",
        "MoE flavors: expert load balancing. bias = auxiliary-loss-free (per-expert routing bias moved after "
        "each step from the token counts); aux_loss = sequence-wise auxiliary loss; none.",
        choices=("bias", "aux_loss", "none"),
    )
    moe_bias_update_rate: float = _opt(1e-3, "MoE flavors, load_balance bias: the bias step per optimizer step.")
    moe_aux_loss_coeff: float = _opt(1e-3, "MoE flavors, load_balance aux_loss: the weight of the loss.")


@dataclass
class Training:
    """Batch shape, data and the length of the run."""

    steps: int = _opt(300, "Number of optimizer steps.")
    local_batch_size: int = _opt(8, "Sequences per micro-batch on each data-parallel rank.")
    global_batch_size: int = _opt(
        -1,
        "Sequences per optimizer step over all ranks; -1 = local_batch_size x data-parallel degree. "
        "A multiple of that gives gradient accumulation.",
    )
    seq_len: int = _opt(256, "Tokens per training sequence.")
    max_norm: float = _opt(1.0, "Clip the global gradient norm to this value.")
    dataset: str = _opt(
        "pydoc",
        "Dataset name: 'pydoc' = the embedded English corpus shipped with Python (offline); "
        "'c4' or another Hugging Face dataset name (needs the network and the 'datasets' package).",
    )
    dataset_path: str = _opt(
        "", "A local .txt, .jsonl ('text' field) or .parquet ('text' column) file or folder; overrides dataset."
    )
    seed: int = _opt(42, "Random seed for weights and data order.")
    deterministic: bool = _opt(False, "Use deterministic algorithms only (slower on GPU).")
    dtype: str = _opt(
        "auto",
        "Training precision: auto = float32 on CPU, bfloat16 parameters (FSDP2 mixed precision) on GPU.",
        choices=("auto", "float32", "bfloat16"),
    )
    mixed_precision_param: str = _opt(
        "bfloat16", "Parameter dtype for compute under FSDP2 mixed precision.", choices=("bfloat16", "float32")
    )
    mixed_precision_reduce: str = _opt(
        "float32", "Gradient reduce dtype under FSDP2 mixed precision.", choices=("float32", "bfloat16")
    )
    document_masking: bool = _opt(False, "Mask attention across document boundaries inside a packed sequence.")
    gc_freq: int = _opt(50, "Run Python garbage collection every this many steps.")


@dataclass
class Optimizer:
    """AdamW settings."""

    name: str = _opt("AdamW", "Optimizer.", choices=("AdamW",))
    lr: float = _opt(8e-4, "Peak learning rate.")
    beta1: float = _opt(0.9, "Adam beta1.")
    beta2: float = _opt(0.95, "Adam beta2.")
    eps: float = _opt(1e-8, "Adam epsilon.")
    weight_decay: float = _opt(0.1, "Decoupled weight decay.")
    implementation: str = _opt(
        "auto",
        "Optimizer implementation: auto = fused where available, else foreach.",
        choices=("auto", "fused", "foreach", "for-loop"),
    )


@dataclass
class LRScheduler:
    """Linear warmup, then decay."""

    warmup_steps: int = _opt(30, "Steps of linear warmup; the first step's LR is already > 0.")
    decay_ratio: Optional[float] = _opt(
        None,
        "Fraction of steps that decay (wsd: warmup-stable-decay). none = decay over all steps after warmup.",
    )
    decay_type: str = _opt("linear", "Decay shape after warmup.", choices=("linear", "cosine", "wsd"))
    min_lr_factor: float = _opt(0.1, "Final LR as a fraction of optimizer.lr.")


@dataclass
class Parallelism:
    """Parallel layout: data (FSDP2/HSDP), tensor + sequence, pipeline and context parallel (trainer/parallel/README.md)."""

    data_parallel_replicate_degree: int = _opt(1, "Replicas (HSDP outer dimension; 1 = plain FSDP).")
    data_parallel_shard_degree: int = _opt(-1, "FSDP shard degree; -1 = the rest of the world size.")
    tensor_parallel_degree: int = _opt(1, "Tensor + sequence parallel degree (heads, FFN and vocab split).")
    enable_async_tensor_parallel: bool = _opt(
        False, "Overlap TP communication with the matmuls (CUDA symmetric memory; needs compile.enable)."
    )
    disable_loss_parallel: bool = _opt(
        False, "Under TP, gather the logits before the loss instead of a cross-entropy on vocab-sharded logits."
    )
    pipeline_parallel_degree: int = _opt(1, "Pipeline parallel degree (ranks holding successive stages).")
    pipeline_parallel_schedule: str = _opt(
        "1F1B", "Pipeline schedule (torch.distributed.pipelining); Interleaved*/ZBV hold 2 stages per rank.",
        choices=("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"),
    )
    pipeline_parallel_split_points: list[str] = _opt(
        [], "Stage boundaries as the first layer of each later stage, e.g. layers.3 (comma-separated); "
        "empty = layers split evenly.",
    )
    pipeline_parallel_microbatch_size: int = _opt(
        1, "Sequences per pipeline micro-batch; local_batch_size must be a multiple of it."
    )
    context_parallel_degree: int = _opt(
        1, "Context parallel degree: every sequence is split over this many ranks (ring attention)."
    )
    expert_parallel_degree: int = _opt(
        1, "Expert parallel degree (MoE flavors): the experts split over this many data-parallel ranks, tokens "
        "sent to them by all-to-all; must divide data_parallel_shard_degree.",
    )


@dataclass
class Checkpoint:
    """Saving and resuming."""

    enable: bool = _opt(False, "Save checkpoints and resume from the newest complete one.")
    folder: str = _opt("checkpoint", "Checkpoint folder, relative to job.dump_folder.")
    interval: int = _opt(500, "Save every this many steps (and at the end).")
    keep_latest_k: int = _opt(0, "Keep only the newest k checkpoints; 0 = keep all.")
    async_mode: str = _opt("disabled", "Write checkpoints in the background.", choices=("disabled", "async"))
    load_step: int = _opt(-1, "Resume from this step's checkpoint; -1 = the newest.")
    model_weights_only: bool = _opt(False, "Final save holds only the model weights (an export).")
    export_dtype: str = _opt(
        "float32", "Weight dtype of a model-weights-only export.", choices=("float32", "bfloat16")
    )
    create_seed_checkpoint: bool = _opt(
        False, "Write the initial weights as step 0 on one process, then exit."
    )
    initial_load_path: str = _opt(
        "", "Start from this checkpoint when the checkpoint folder has none to resume: a DCP checkpoint or "
        "step folder, or a Hugging Face Llama folder (with initial_load_in_hf)."
    )
    initial_load_model_only: bool = _opt(
        True, "From initial_load_path take the model weights only (start at step 0); false = the whole "
        "training state (DCP only)."
    )
    initial_load_in_hf: bool = _opt(
        False, "initial_load_path is a Hugging Face Llama folder (safetensors + config.json)."
    )
    last_save_in_hf: bool = _opt(
        False, "The final save is a Hugging Face Llama folder hf-step-<N> (in export_dtype) that "
        "transformers' LlamaForCausalLM.from_pretrained loads."
    )


@dataclass
class Metrics:
    """Logging."""

    log_freq: int = _opt(10, "Log metrics every this many steps.")
    enable_tensorboard: bool = _opt(False, "Also write TensorBoard logs.")
    save_tb_folder: str = _opt("tb", "TensorBoard folder, relative to job.dump_folder.")
    enable_wandb: bool = _opt(
        False, "Also log to Weights & Biases (the wandb package; offline unless WANDB_MODE=online)."
    )
    wandb_project: str = _opt("titan-kernels", "Weights & Biases project (WANDB_PROJECT overrides).")
    save_wandb_folder: str = _opt("wandb", "Weights & Biases run folder, relative to job.dump_folder.")
    enable_color: bool = _opt(True, "Colored console output.")
    save_plot: bool = _opt(
        True, "At the end, draw metrics.jsonl (loss, validation loss, LR, tokens/s, memory) to dump_folder/metrics.png."
    )


@dataclass
class Validation:
    """Validation loss: the mean token loss on held-out text, every freq steps and at the end."""

    enable: bool = _opt(False, "Evaluate the validation loss and perplexity during training.")
    freq: int = _opt(100, "Evaluate every this many steps (and at the last step).")
    steps: int = _opt(-1, "Batches per evaluation; -1 = the whole validation split (one pass).")
    dataset: str = _opt(
        "", "Validation dataset name, as training.dataset; empty (and no dataset_path) = a held-out part of the "
        "training source (see split_every)."
    )
    dataset_path: str = _opt("", "A local validation file or folder, as training.dataset_path; overrides dataset.")
    local_batch_size: int = _opt(-1, "Sequences per validation batch on each data-parallel rank; -1 = training's.")
    seq_len: int = _opt(-1, "Tokens per validation sequence; -1 = training.seq_len (it may not be longer).")
    split_every: int = _opt(
        50, "Without a validation dataset: every N-th document of the training source is held out for "
        "validation and never trained on (1 in 50 = 2%)."
    )


@dataclass
class Profiling:
    """torch.profiler traces and CUDA memory snapshots."""

    enable_profiling: bool = _opt(False, "Record a torch.profiler trace every profile_freq steps.")
    profile_freq: int = _opt(10, "Profile the last profiler_active of every this many steps.")
    profiler_warmup: int = _opt(3, "Steps the profiler warms up (runs, records nothing) before the active ones.")
    profiler_active: int = _opt(1, "Steps recorded in each trace.")
    save_traces_folder: str = _opt(
        "profile_trace", "Trace folder, relative to job.dump_folder: iteration_<step>/rank<r>_trace.json (Chrome "
        "trace: chrome://tracing or Perfetto)."
    )
    enable_memory_snapshot: bool = _opt(
        False, "Record CUDA allocations and write a memory snapshot every profile_freq steps (and on out-of-memory)."
    )
    save_memory_snapshot_folder: str = _opt(
        "memory_snapshot", "Snapshot folder, relative to job.dump_folder: iteration_<step>/rank<r>_memory_snapshot.pickle "
        "(open with pytorch.org/memory_viz)."
    )


@dataclass
class ActivationCheckpoint:
    """Recompute activations in the backward pass to save memory."""

    mode: str = _opt("none", "Activation checkpointing mode.", choices=("none", "full", "selective"))
    selective_ac_option: str = _opt(
        "2", "For selective: an integer N = every N-th layer; 'op' = per op, keeping matmul outputs."
    )


@dataclass
class Compile:
    """torch.compile."""

    enable: bool = _opt(False, "Compile the components below with torch.compile.")
    components: list[str] = _opt(["model", "loss"], "What to compile: model, loss (comma-separated).")
    backend: str = _opt(
        "inductor", "torch.compile backend; aot_eager traces the same graphs without generating code.",
        choices=("inductor", "aot_eager", "eager"),
    )


@dataclass
class Kernels:
    """Which titan_kernels implementation runs."""

    backend: str = _opt(
        "auto",
        "Kernel backend passed to titan_kernels.use_backend.",
        choices=("auto", "reference", "triton", "cpu", "cuda"),
    )


@dataclass
class Float8:
    """Float8 training of the Linear layers (float8 GEMMs run at twice the bf16 rate on H100/H200)."""

    enable: bool = _opt(False, "Train the Linear layers with float8 GEMMs (forward, grad_input, grad_weight).")
    recipe: str = _opt(
        "tensorwise",
        "Scaling recipe (torchao's meanings): tensorwise (fastest), rowwise, rowwise_with_gw_hp "
        "(grad_weight in high precision).",
        choices=("tensorwise", "rowwise", "rowwise_with_gw_hp"),
    )
    impl: str = _opt(
        "titan", "Float8Linear implementation: titan (ours) or torchao (needs torchao installed).",
        choices=("titan", "torchao"),
    )
    filter_fqns: list[str] = _opt(
        ["output"], "Keep Linear layers whose name contains one of these in high precision (comma-separated)."
    )
    auto_filter_small_kgemms: bool = _opt(
        True, "Also keep in high precision the layers too small to gain from float8 (see trainer/float8.py)."
    )
    enable_fsdp_float8_all_gather: bool = _opt(
        False, "FSDP2 all-gathers weights in float8 (1 byte per element); tensorwise recipe only."
    )


_COMPILE_COMPONENTS = ("model", "loss")


@dataclass
class JobConfig:
    """The whole configuration of a training run."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)
    profiling: Profiling = field(default_factory=Profiling)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    kernels: Kernels = field(default_factory=Kernels)
    float8: Float8 = field(default_factory=Float8)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The configuration as ``{section: {key: value}}`` of plain Python values."""
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        """The configuration as TOML text that :func:`parse_args` ``--config`` reads back."""
        lines: list[str] = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            for key, value in values.items():
                if value is None:
                    lines.append(f"# {key} = none")
                else:
                    lines.append(f"{key} = {_toml_value(value)}")
            lines.append("")
        return "\n".join(lines)

    def grad_accum_steps(self, dp_degree: int) -> int:
        """Micro-batches per optimizer step: ``global_batch_size / (local_batch_size * dp_degree)``.

        Raises ConfigError if global_batch_size is not a positive multiple of that product.
        """
        t = self.training
        per_step = t.local_batch_size * dp_degree
        if t.global_batch_size == -1:
            return 1
        if t.global_batch_size % per_step:
            raise ConfigError(
                f"--training.global_batch_size: {t.global_batch_size} is not a multiple of "
                f"local_batch_size x data-parallel degree = {t.local_batch_size} x {dp_degree} = {per_step}"
            )
        return t.global_batch_size // per_step

    def validate(self) -> None:
        """Check every value and the relations between them; raise ConfigError naming the key."""
        for section, key, hint, value in _iter_fields(self):
            # Types first: a config built in code (not parsed) may hold e.g. a str where an int belongs.
            _check_toml_value(f"{section}.{key}", value, hint, "--")
            choices = _field_of(section, key).metadata.get("choices")
            if choices is not None and value not in choices:
                raise ConfigError(_choice_message(f"{section}.{key}", value, choices))

        def need(ok: bool, key: str, value: Any, expected: str) -> None:
            if not ok:
                raise ConfigError(f"--{key}: expected {expected}, got {value!r}")

        t, o, s, p, c = self.training, self.optimizer, self.lr_scheduler, self.parallelism, self.checkpoint
        flavors = available_flavors(self.model.name)
        if flavors and self.model.flavor not in flavors:
            raise ConfigError(_choice_message("model.flavor", self.model.flavor, flavors))
        need(t.steps >= 1, "training.steps", t.steps, "an integer >= 1")
        need(t.local_batch_size >= 1, "training.local_batch_size", t.local_batch_size, "an integer >= 1")
        need(
            t.global_batch_size == -1 or t.global_batch_size >= 1,
            "training.global_batch_size", t.global_batch_size, "-1 or an integer >= 1",
        )
        if t.global_batch_size != -1 and t.global_batch_size % t.local_batch_size:
            raise ConfigError(
                f"--training.global_batch_size: expected a multiple of training.local_batch_size "
                f"({t.local_batch_size}), got {t.global_batch_size}"
            )
        need(t.seq_len >= 1, "training.seq_len", t.seq_len, "an integer >= 1")
        need(math.isfinite(t.max_norm) and t.max_norm > 0, "training.max_norm", t.max_norm, "a finite value > 0")
        need(t.seed >= 0, "training.seed", t.seed, "an integer >= 0")
        need(t.gc_freq >= 1, "training.gc_freq", t.gc_freq, "an integer >= 1")
        need(bool(t.dataset or t.dataset_path), "training.dataset", t.dataset, "a dataset name or a dataset_path")
        for key, path in (("training.dataset_path", t.dataset_path), ("model.tokenizer_path", self.model.tokenizer_path)):
            if path and not pathlib.Path(path).expanduser().exists():
                raise ConfigError(f"--{key}: no such file or folder: {path!r}")
        need(math.isfinite(o.lr) and o.lr > 0, "optimizer.lr", o.lr, "a finite value > 0")
        need(0 <= o.beta1 < 1, "optimizer.beta1", o.beta1, "a value in [0, 1)")
        need(0 <= o.beta2 < 1, "optimizer.beta2", o.beta2, "a value in [0, 1)")
        need(math.isfinite(o.eps) and o.eps > 0, "optimizer.eps", o.eps, "a finite value > 0")
        need(math.isfinite(o.weight_decay) and o.weight_decay >= 0, "optimizer.weight_decay", o.weight_decay,
             "a finite value >= 0")
        need(s.warmup_steps >= 0, "lr_scheduler.warmup_steps", s.warmup_steps, "an integer >= 0")
        need(s.decay_ratio is None or 0 <= s.decay_ratio <= 1, "lr_scheduler.decay_ratio", s.decay_ratio,
             "none or a value in [0, 1]")
        need(0 <= s.min_lr_factor <= 1, "lr_scheduler.min_lr_factor", s.min_lr_factor, "a value in [0, 1]")
        need(p.data_parallel_replicate_degree >= 1, "parallelism.data_parallel_replicate_degree",
             p.data_parallel_replicate_degree, "an integer >= 1")
        need(p.data_parallel_shard_degree == -1 or p.data_parallel_shard_degree >= 1,
             "parallelism.data_parallel_shard_degree", p.data_parallel_shard_degree, "-1 or an integer >= 1")
        _validate_parallelism(p, t)
        need(c.interval >= 1, "checkpoint.interval", c.interval, "an integer >= 1")
        need(c.keep_latest_k >= 0, "checkpoint.keep_latest_k", c.keep_latest_k, "an integer >= 0 (0 = keep all)")
        need(c.load_step >= -1, "checkpoint.load_step", c.load_step, "-1 (newest) or a step >= 0")
        need(bool(c.folder), "checkpoint.folder", c.folder, "a folder name")
        if c.initial_load_path and not pathlib.Path(c.initial_load_path).expanduser().is_dir():
            raise ConfigError(f"--checkpoint.initial_load_path: no such folder: {c.initial_load_path!r}")
        if self.model.name != "llama3" and (c.initial_load_in_hf or c.last_save_in_hf):
            # trainer.models.qwen3 has the state-dict conversion; the folder reader/writer is Llama's.
            key = "checkpoint.initial_load_in_hf" if c.initial_load_in_hf else "checkpoint.last_save_in_hf"
            raise ConfigError(f"--{key}: Hugging Face folders are supported for model.name llama3 only so far, "
                              f"got {self.model.name!r}")
        need(not c.initial_load_in_hf or bool(c.initial_load_path), "checkpoint.initial_load_in_hf",
             c.initial_load_in_hf, "false without --checkpoint.initial_load_path")
        need(not c.initial_load_in_hf or c.initial_load_model_only, "checkpoint.initial_load_model_only",
             c.initial_load_model_only, "true with --checkpoint.initial_load_in_hf (a Hugging Face folder holds "
             "weights only)")
        need(self.metrics.log_freq >= 1, "metrics.log_freq", self.metrics.log_freq, "an integer >= 1")
        _validate_validation(self.validation, t, p)
        _validate_profiling(self.profiling)
        ac = self.activation_checkpoint.selective_ac_option
        need(ac == "op" or (ac.isdigit() and int(ac) >= 1), "activation_checkpoint.selective_ac_option", ac,
             "'op' or an integer >= 1")
        for comp in self.compile.components:
            if comp not in _COMPILE_COMPONENTS:
                raise ConfigError(_choice_message("compile.components", comp, _COMPILE_COMPONENTS))
        f8 = self.float8
        need(not f8.enable_fsdp_float8_all_gather or f8.recipe == "tensorwise",
             "float8.enable_fsdp_float8_all_gather", f8.enable_fsdp_float8_all_gather,
             f"false with --float8.recipe {f8.recipe} (the float8 all-gather needs tensorwise)")


def _validate_validation(v: Validation, t: Training, p: Parallelism) -> None:
    def need(ok: bool, key: str, value: Any, expected: str) -> None:
        if not ok:
            raise ConfigError(f"--validation.{key}: expected {expected}, got {value!r}")

    need(v.freq >= 1, "freq", v.freq, "an integer >= 1")
    need(v.steps == -1 or v.steps >= 1, "steps", v.steps, "-1 (the whole split) or an integer >= 1")
    need(v.local_batch_size == -1 or v.local_batch_size >= 1, "local_batch_size", v.local_batch_size,
         "-1 (training's) or an integer >= 1")
    need(v.seq_len == -1 or 1 <= v.seq_len <= t.seq_len, "seq_len", v.seq_len,
         f"-1 (training's) or an integer in [1, training.seq_len = {t.seq_len}] (the rotary table is sized for "
         f"training)")
    need(v.split_every >= 2, "split_every", v.split_every, "an integer >= 2")
    if v.dataset_path and not pathlib.Path(v.dataset_path).expanduser().exists():
        raise ConfigError(f"--validation.dataset_path: no such file or folder: {v.dataset_path!r}")
    if not v.enable:
        return
    seq = t.seq_len if v.seq_len == -1 else v.seq_len
    lbs = t.local_batch_size if v.local_batch_size == -1 else v.local_batch_size
    cp, tp = p.context_parallel_degree, p.tensor_parallel_degree
    if cp > 1 and seq % (2 * cp):
        raise ConfigError(f"--validation.seq_len: {seq} is not divisible by 2 x context_parallel_degree = {2 * cp}")
    if tp > 1 and (seq // cp) % tp:
        raise ConfigError(
            f"--validation.seq_len: the sequence part of a rank, {seq} / context_parallel_degree {cp}, is not "
            f"divisible by tensor_parallel_degree {tp} (sequence parallel)"
        )
    if p.pipeline_parallel_degree > 1 and lbs % t.local_batch_size:
        raise ConfigError(
            f"--validation.local_batch_size: {lbs} is not a multiple of training.local_batch_size "
            f"{t.local_batch_size} (under pipeline parallel the schedule's micro-batch count is fixed)"
        )


def _validate_profiling(pr: Profiling) -> None:
    def need(ok: bool, key: str, value: Any, expected: str) -> None:
        if not ok:
            raise ConfigError(f"--profiling.{key}: expected {expected}, got {value!r}")

    need(pr.profiler_warmup >= 0, "profiler_warmup", pr.profiler_warmup, "an integer >= 0")
    need(pr.profiler_active >= 1, "profiler_active", pr.profiler_active, "an integer >= 1")
    need(pr.profile_freq >= 1, "profile_freq", pr.profile_freq, "an integer >= 1")
    need(not pr.enable_profiling or pr.profile_freq >= pr.profiler_warmup + pr.profiler_active, "profile_freq",
         pr.profile_freq, f"an integer >= profiler_warmup + profiler_active = {pr.profiler_warmup + pr.profiler_active}")
    need(bool(pr.save_traces_folder), "save_traces_folder", pr.save_traces_folder, "a folder name")
    need(bool(pr.save_memory_snapshot_folder), "save_memory_snapshot_folder", pr.save_memory_snapshot_folder,
         "a folder name")


def _validate_parallelism(p: Parallelism, t: Training) -> None:
    """The layout checks that need no model or world size (those are in trainer.parallel)."""
    for key in ("tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree",
                "pipeline_parallel_microbatch_size", "expert_parallel_degree"):
        value = getattr(p, key)
        if value < 1:
            raise ConfigError(f"--parallelism.{key}: expected an integer >= 1, got {value!r}")
    cp, tp = p.context_parallel_degree, p.tensor_parallel_degree
    if cp > 1 and t.seq_len % (2 * cp):
        raise ConfigError(
            f"--parallelism.context_parallel_degree: training.seq_len {t.seq_len} is not divisible by "
            f"2 x context_parallel_degree = {2 * cp} (each rank holds one chunk from each end of the sequence)"
        )
    if tp > 1 and (t.seq_len // cp) % tp:
        raise ConfigError(
            f"--parallelism.tensor_parallel_degree: the sequence part of a rank, training.seq_len / "
            f"context_parallel_degree = {t.seq_len} / {cp} = {t.seq_len // cp}, is not divisible by {tp} "
            f"(sequence parallel splits it further)"
        )
    if p.pipeline_parallel_degree > 1:
        mbs = p.pipeline_parallel_microbatch_size
        if t.local_batch_size % mbs:
            raise ConfigError(
                f"--parallelism.pipeline_parallel_microbatch_size: training.local_batch_size {t.local_batch_size} "
                f"is not divisible into micro-batches of {mbs}"
            )
        if t.document_masking:
            raise ConfigError(
                "--parallelism.pipeline_parallel_degree: training.document_masking is not supported with "
                "pipeline parallel (the stages do not receive the position_ids)"
            )
    elif p.pipeline_parallel_split_points:
        raise ConfigError(
            f"--parallelism.pipeline_parallel_split_points: {p.pipeline_parallel_split_points} given but "
            f"pipeline_parallel_degree is 1"
        )
    if cp > 1 and t.document_masking:
        raise ConfigError(
            "--parallelism.context_parallel_degree: training.document_masking is not supported with context "
            "parallel (ring attention is dense causal)"
        )
    if p.expert_parallel_degree > 1 and (cp > 1 or p.data_parallel_replicate_degree > 1):
        raise ConfigError(
            "--parallelism.expert_parallel_degree: not supported with context_parallel_degree > 1 or "
            "data_parallel_replicate_degree > 1 yet (expert parallel borrows data_parallel_shard ranks only)"
        )


def available_flavors(model_name: str = "llama3") -> tuple[str, ...]:
    """Flavor names of ``model_name`` that have a TOML file in ``trainer/configs/``: ``<flavor>.toml``
    for llama3, ``<family>_<flavor>.toml`` for the other families (qwen3)."""
    prefixes = tuple(f"{n}_" for n in _FAMILIES if n != "llama3")
    if model_name == "llama3":
        stems = [p.stem for p in CONFIG_DIR.glob("*.toml") if not p.stem.startswith(prefixes)]
    else:
        stems = [p.stem[len(model_name) + 1:] for p in CONFIG_DIR.glob(f"{model_name}_*.toml")]
    return tuple(sorted(stems, key=_flavor_sort_key))


def _flavor_sort_key(name: str) -> tuple[float, str]:
    # debugmodel first, then by size: 1B < 3B < 8B < 70B < 405B.
    digits = name.split("-")[0][:-1]  # 30B-A3B sorts as 30B
    try:
        return (float(digits), name) if name.split("-")[0].endswith("B") else (-1.0, name)
    except ValueError:
        return (-1.0, name)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


# ----------------------------------------------------------------------------------------------
# Field introspection

_SECTIONS: dict[str, type] = typing.get_type_hints(JobConfig)
_HINTS: dict[str, dict[str, Any]] = {name: typing.get_type_hints(cls) for name, cls in _SECTIONS.items()}


def _field_of(section: str, key: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(_SECTIONS[section]) if f.name == key)


def _iter_fields(config: JobConfig):
    for section in _SECTIONS:
        obj = getattr(config, section)
        for f in dataclasses.fields(obj):
            yield section, f.name, _HINTS[section][f.name], getattr(obj, f.name)


def all_keys() -> list[str]:
    """Every ``section.key`` name, in declaration order."""
    return [f"{s}.{f.name}" for s, cls in _SECTIONS.items() for f in dataclasses.fields(cls)]


def _suggest(name: str, candidates: typing.Iterable[str]) -> str | None:
    """The closest candidate to ``name`` (also matching on the part after the dot), or None."""
    def ratio(a: str, b: str) -> float:
        return difflib.SequenceMatcher(None, a.lower(), b.lower()).ratio()

    leaf = name.split(".", 1)[-1]
    best, best_score = None, 0.0
    for cand in candidates:
        score = ratio(name, cand)
        if "." in cand:
            # '--steps' -> 'training.steps'; '--training.lr' -> 'optimizer.lr' (a little less sure)
            score = max(score, ratio(leaf, cand.split(".", 1)[1]) - (0.05 if "." in name else 0.0))
        if score > best_score:
            best, best_score = cand, score
    return best if best_score >= 0.6 else None


def _choice_message(key: str, value: Any, choices: typing.Iterable[str]) -> str:
    choices = list(choices)
    msg = f"--{key}: expected one of {', '.join(choices)}, got {value!r}"
    hint = _suggest(str(value), choices)
    return msg + (f" (did you mean {hint!r}?)" if hint else "")


def _unknown_key_message(key: str, where: str = "") -> str:
    hint = _suggest(key, all_keys() + ["config", "flavor", "help"])
    msg = f"{where}unknown option --{key}"
    return msg + (f"; did you mean --{hint}?" if hint else "; see --help for the list of options")


_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def _type_name(hint: Any) -> str:
    if hint is bool:
        return "true/false"
    if hint is int:
        return "an integer"
    if hint is float:
        return "a number"
    if hint is str:
        return "a string"
    if _is_optional(hint):
        return f"none or {_type_name(_optional_inner(hint))}"
    if typing.get_origin(hint) is list:
        return "a comma-separated list"
    return str(hint)


def _is_optional(hint: Any) -> bool:
    return typing.get_origin(hint) is typing.Union and type(None) in typing.get_args(hint)


def _optional_inner(hint: Any) -> Any:
    return next(a for a in typing.get_args(hint) if a is not type(None))


def _parse_str(key: str, text: str, hint: Any) -> Any:
    """Convert a command-line string to the field's type, or raise ConfigError naming the key."""
    bad = ConfigError(f"--{key}: expected {_type_name(hint)}, got {text!r}")
    if _is_optional(hint):
        if text.strip().lower() in ("none", "null", ""):
            return None
        try:
            return _parse_str(key, text, _optional_inner(hint))
        except ConfigError:
            raise bad from None
    if hint is bool:
        low = text.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise bad
    if hint is int:
        try:
            return int(text.strip())
        except ValueError:
            raise bad from None
    if hint is float:
        try:
            return float(text.strip())
        except ValueError:
            raise bad from None
    if hint is str:
        return text
    if typing.get_origin(hint) is list:
        return [part.strip() for part in text.split(",") if part.strip()]
    raise bad


def _check_toml_value(key: str, value: Any, hint: Any, where: str) -> Any:
    """Check a value read from TOML against the field's type; ints are accepted for floats."""
    bad = ConfigError(f"{where}{key}: expected {_type_name(hint)}, got {value!r} ({type(value).__name__})")
    if _is_optional(hint):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        try:
            return _check_toml_value(key, value, _optional_inner(hint), where)
        except ConfigError:
            raise bad from None
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise bad
    if hint is str:
        if isinstance(value, str):
            return value
        raise bad
    if typing.get_origin(hint) is list:
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
        if isinstance(value, str):
            return _parse_str(key, value, hint)
        raise bad
    raise bad


# ----------------------------------------------------------------------------------------------
# TOML files


_FAMILIES = ("llama3", "qwen3")


def flavor_config_path(flavor: str, model_name: str = "llama3") -> pathlib.Path:
    """``trainer/configs/<flavor>.toml`` (llama3) or ``trainer/configs/<model_name>_<flavor>.toml``."""
    return CONFIG_DIR / (f"{flavor}.toml" if model_name == "llama3" else f"{model_name}_{flavor}.toml")


def apply_toml(config: JobConfig, path: str | pathlib.Path) -> JobConfig:
    """Override ``config`` in place with the values of a TOML file; raise ConfigError on bad content."""
    path = pathlib.Path(path)
    where = f"{path.name}: "
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"--config: file not found: {str(path)!r}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}not valid TOML: {str(exc).splitlines()[0]}") from None
    for section, values in data.items():
        if section not in _SECTIONS:
            hint = _suggest(section, _SECTIONS)
            raise ConfigError(
                f"{where}unknown section [{section}]" + (f"; did you mean [{hint}]?" if hint else "")
            )
        if not isinstance(values, dict):
            raise ConfigError(f"{where}{section}: expected a [{section}] table, got {values!r}")
        obj = getattr(config, section)
        for key, value in values.items():
            full = f"{section}.{key}"
            if key not in _HINTS[section]:
                raise ConfigError(_unknown_key_message(full, where))
            setattr(obj, key, _check_toml_value(full, value, _HINTS[section][key], where))
    return config


# ----------------------------------------------------------------------------------------------
# Command line


def _split_argv(argv: list[str]) -> tuple[str | None, str | None, list[tuple[str, str | None]]]:
    """Split argv into (config file, flavor, [(section.key, raw value or None for a bare flag)])."""
    config_file: str | None = None
    flavor: str | None = None
    items: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"unexpected argument {arg!r}; options look like --section.key value")
        name, eq, inline = arg[2:].partition("=")
        name = name.replace("-", "_")  # --training.local-batch-size works too
        value: str | None = inline if eq else None
        if name in ("config", "flavor", "model.flavor"):
            if value is None:
                if i >= len(argv):
                    raise ConfigError(f"--{name}: missing value (expected a string)")
                value = argv[i]
                i += 1
            if name == "config":
                config_file = value
            else:
                flavor = value
            continue
        section, dot, key = name.partition(".")
        if not dot or section not in _HINTS or key not in _HINTS[section]:
            raise ConfigError(_unknown_key_message(name))
        hint = _HINTS[section][key]
        if value is None:
            nxt = argv[i] if i < len(argv) else None
            if hint is bool:
                # A bare flag means true; a following non-option word is its value.
                if nxt is not None and not nxt.startswith("--"):
                    value = nxt
                    i += 1
            elif nxt is None or (nxt.startswith("--") and not _is_number(nxt)):
                raise ConfigError(f"--{name}: missing value (expected {_type_name(hint)})")
            else:
                value = nxt
                i += 1
        items.append((name, value))
    return config_file, flavor, items


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def parse_args(argv: list[str] | None = None) -> JobConfig:
    """Build and validate a :class:`JobConfig` from command-line arguments.

    Args:
        argv: the arguments without the program name; ``None`` means ``sys.argv[1:]``.

    Layers: defaults < ``--config FILE.toml`` (or, without it, ``trainer/configs/<flavor>.toml``)
    < ``--section.key value`` overrides. ``--help`` prints every key and raises ``SystemExit(0)``.

    Raises:
        ConfigError: an unknown key (with a did-you-mean suggestion), a value of the wrong type,
            a missing value, an unreadable TOML file or a value that fails :meth:`JobConfig.validate`.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    wants_help = any(a in ("--help", "-h") for a in argv)
    if wants_help:
        argv = [a for a in argv if a not in ("--help", "-h")]
    config_file, flavor, items = _split_argv(argv)
    # The family picks the flavor's file (qwen3_<flavor>.toml), so it is read before the TOML layer.
    name = next((raw for key, raw in items if key == "model.name" and raw is not None), None)
    config = _base_config(config_file, flavor, name)
    if wants_help:
        print(help_text(config))
        raise SystemExit(0)
    for name, raw in items:
        section, _, key = name.partition(".")
        hint = _HINTS[section][key]
        value = True if raw is None else _parse_str(name, raw, hint)
        setattr(getattr(config, section), key, value)
    config.validate()
    return config


def _base_config(config_file: str | None, flavor: str | None, model_name: str | None = None) -> JobConfig:
    """Defaults overridden by the TOML layer: ``config_file``, else the flavor's own file (of the
    family ``model_name``, default llama3)."""
    config = JobConfig()
    if config_file is not None:
        apply_toml(config, config_file)
    else:
        path = flavor_config_path(flavor or config.model.flavor, model_name or config.model.name)
        if path.is_file():
            apply_toml(config, path)
        # A flavor without a file is reported by validate() with the list of known flavors.
    if flavor is not None:
        config.model.flavor = flavor
    return config


def help_text(defaults: JobConfig | None = None) -> str:
    """Every option with its default (taken from ``defaults``, e.g. a flavor's TOML) and meaning."""
    lines = [
        "usage: python -m trainer [--config FILE.toml] [--flavor NAME] [--section.key value ...]",
        "",
        "Pre-trains Llama 3. Values come from the defaults below, then the TOML file (--config, or",
        "trainer/configs/<flavor>.toml), then the command line. Boolean keys also work as bare flags.",
        "",
        "  --config FILE.toml   read this TOML file instead of the flavor's",
        f"  --flavor NAME        short for --model.flavor ({', '.join(available_flavors())})",
        "  --help               show this list and exit",
    ]
    if defaults is None:
        defaults = _base_config(None, None)
    lines.insert(5, f"Defaults shown are those of flavor {defaults.model.flavor!r}.")
    lines.insert(6, "")
    for section, cls in _SECTIONS.items():
        lines += ["", f"[{section}] {(cls.__doc__ or '').strip()}"]
        for f in dataclasses.fields(cls):
            default = getattr(getattr(defaults, section), f.name)
            shown = "none" if default is None else _toml_value(default)
            if isinstance(default, list):
                shown = ",".join(default)
            choices = f.metadata.get("choices")
            extra = f" [{'|'.join(choices)}]" if choices else ""
            lines.append(f"  --{section}.{f.name} (default: {shown}){extra}")
            lines.append(f"      {f.metadata.get('help', '')}")
    return "\n".join(lines)
