"""torchtitan's configuration keys that are not spelled as ours: each is an alias of one of our keys
(same meaning), or refused with the reason; and the keys that derive others (``model.converters``,
``model.hf_assets_path``).

The names are those of torchtitan 0.3.0's ``Trainer.Config`` (sections ``profiler``, ``validator``,
``dataloader``, ``debug``... and the top-level ``dump_folder``, ``hf_assets_path``) and of the earlier
``JobConfig`` a torchtitan TOML file may still use (``job.config_file``, ``model.converters``,
``model.hf_assets_path``). tests/trainer/test_torchtitan_keys.py checks every 0.3.0 key against these
tables (the list is tests/data/torchtitan_0.3.0_keys.json).

Imports only :mod:`trainer.config.sections` of the package; :mod:`trainer.config.cli` uses it.
"""
from __future__ import annotations

from typing import Any

from trainer.errors import ConfigError

# The command-line key naming the TOML file (ours: --config).
CONFIG_FILE_KEY = "job.config_file"

# The model converters of --model.converters: name -> what it turns on.
CONVERTERS: dict[str, str] = {"float8": "float8.enable"}

# torchtitan key -> our key of the same meaning.
ALIASES: dict[str, str] = {
    "dump_folder": "job.dump_folder",
    "hf_assets_path": "model.hf_assets_path",
    "debug.seed": "training.seed",
    "debug.deterministic": "training.deterministic",
    "debug.print_config": "job.print_config",
    "dataloader.dataset": "training.dataset",
    "dataloader.dataset_path": "training.dataset_path",
    "validator.enable": "validation.enable",
    "validator.freq": "validation.freq",
    "validator.steps": "validation.steps",
    "validator.dataloader.dataset": "validation.dataset",
    "validator.dataloader.dataset_path": "validation.dataset_path",
    "checkpoint.last_save_model_only": "checkpoint.model_weights_only",
    "float8.recipe_name": "float8.recipe",
    "compile.enable_async_tensor_parallel": "parallelism.enable_async_tensor_parallel",
    "profiler.enable_profiling": "profiling.enable_profiling",
    "profiler.profile_freq": "profiling.profile_freq",
    "profiler.profiler_warmup": "profiling.profiler_warmup",
    "profiler.profiler_active": "profiling.profiler_active",
    "profiler.save_traces_folder": "profiling.save_traces_folder",
    "profiler.enable_memory_snapshot": "profiling.enable_memory_snapshot",
    "profiler.save_memory_snapshot_folder": "profiling.save_memory_snapshot_folder",
}

# torchtitan boolean key -> our boolean key of the opposite meaning.
NEGATED: dict[str, str] = {"metrics.disable_color_printing": "metrics.enable_color"}

# Names of earlier torchtitan versions (or near them) that are not options here, and the option of
# the same meaning that "did you mean" names instead of the nearest spelling.
NEAR: dict[str, str] = {
    "metrics.enable_color_printing": "metrics.enable_color",
    "training.compile": "compile.enable",
    "training.enable_float8_linear": "float8.enable",
    "float8.enable_float8_linear": "float8.enable",
    "model.quantize": "model.converters",
    "comm.timeout": "comm.train_timeout_seconds",
    "training.dataset_name": "training.dataset",
    "training.batch_size": "training.local_batch_size",
    "training.warmup_steps": "lr_scheduler.warmup_steps",
}

_SPLIT = "pipeline stages are set by --parallelism.pipeline_parallel_split_points"
_PROFILER = "the profiler's schedule here is profile_freq, profiler_warmup and profiler_active"
_AC = "activation checkpointing here is --activation_checkpoint.mode and selective_ac_option"
_CP = "ring attention always uses the zigzag (head-tail) split of each sequence"
_FR = "the NCCL flight recorder is not configured by the trainer (set TORCH_NCCL_TRACE_BUFFER_SIZE)"

# torchtitan key -> why it has no meaning here (the error says "not applicable here: <reason>").
REFUSED: dict[str, str] = {
    "activation_checkpoint.debug": _AC,
    "activation_checkpoint.determinism_check": _AC,
    "activation_checkpoint.force_recompute_mm_shapes_by_fqns": _AC,
    "activation_checkpoint.preserve_rng_state": _AC,
    "checkpoint.enable_first_step_checkpoint": "the first save is at step --checkpoint.interval",
    "checkpoint.exclude_from_loading": "a resume loads the whole training state (use "
                                       "--checkpoint.initial_load_path with initial_load_model_only for weights only)",
    "checkpoint.initial_load_in_hf_quantized": "Hugging Face folders are read in full precision only",
    "checkpoint.load_only": "every run with --checkpoint.enable saves; leave it off to only load "
                            "--checkpoint.initial_load_path",
    "comm.mode": "the process group is always a real one (gloo on CPU, NCCL on GPU)",
    "comm.trace_buf_size": _FR,
    "comm.save_traces_folder": _FR,
    "comm.save_traces_file_prefix": _FR,
    "debug.batch_invariant": "there is no batch-invariant kernel mode",
    "debug.detect_anomaly": "autograd anomaly detection is not wired (the run stops on a non-finite loss)",
    "debug.deterministic_warn_only": "--debug.deterministic (training.deterministic) always errors on a "
                                     "non-deterministic op",
    "debug.enable_structured_logging": "there is no structured trace logger; metrics go to metrics.jsonl",
    "debug.moe_force_load_balance": "MoE balancing is --model.moe_load_balance",
    "debug.save_config_file": "--job.print_config prints the resolved configuration as TOML",
    "debug.spmd_typechecking": "there is no SPMD type checker",
    "lr_scheduler.total_steps": "the schedule spans --training.steps",
    "metrics.save_for_all_ranks": "metrics are written by rank 0 only",
    "optimizer.param_groups": "per-group settings are --optimizer.groups",
    "optimizer.optimizer_factory_kwargs_by_name": "the optimizer is --optimizer.name with its own keys "
                                                  "(--optimizer.lr, beta1, beta2, eps, weight_decay, muon_*)",
    "override.imports": "kernels are chosen by --kernels.backend, not by imported overrides",
    "parallelism.context_parallel_load_balancer": _CP,
    "parallelism.context_parallel_ptrr_mask_key": _CP,
    "parallelism.enable_fsdp_symm_mem": "FSDP2 uses the process group's collectives",
    "parallelism.enable_sequence_parallel": "tensor parallel always shards the sequence between blocks",
    "parallelism.module_fqns_per_model_part": _SPLIT,
    "parallelism.pipeline_parallel_first_stage_less_layers": _SPLIT,
    "parallelism.pipeline_parallel_last_stage_less_layers": _SPLIT,
    "parallelism.pipeline_parallel_layers_per_stage": _SPLIT,
    "parallelism.pipeline_parallel_schedule_csv": "the schedule is one of --parallelism.pipeline_parallel_schedule",
    "parallelism.spmd_backend": "tensor parallel uses DTensor for the model-parallel axes only",
    "profiler.memory_snapshot_freq": "memory snapshots are taken every --profiling.profile_freq steps",
    "profiler.memory_snapshot_max_entries": "the snapshot keeps torch's default number of allocations",
    "profiler.profiler_repeat": _PROFILER,
    "profiler.profiler_skip_first": _PROFILER,
    "profiler.profiler_skip_first_wait": _PROFILER,
    "training.disable_cuda_graphs": "the step is never captured as a CUDA graph",
    "training.enable_cpu_offload": "FSDP2 CPU offload is not supported",
    "training.gc_debug": "garbage collection runs every --training.gc_freq steps",
}


def lookup(name: str) -> tuple[str, bool] | None:
    """Our key for the torchtitan key ``name`` and whether a boolean value is negated, or None when
    ``name`` is not one of torchtitan's.

    Raises:
        ConfigError: ``name`` is a torchtitan key refused here; one line with the reason.
    """
    if name in ALIASES:
        return ALIASES[name], False
    if name in NEGATED:
        return NEGATED[name], True
    if name in REFUSED:
        raise ConfigError(f"--{name}: not applicable here: {REFUSED[name]}")
    return None


def alias_names() -> list[str]:
    """Every torchtitan name that is accepted or refused here (for the did-you-mean suggestion)."""
    return [*ALIASES, *NEGATED, *REFUSED, CONFIG_FILE_KEY]


def suggestion_target(name: str) -> str:
    """What to suggest for a matched candidate ``name``: an alias's our key, else ``name`` itself."""
    return ALIASES.get(name) or NEGATED.get(name) or name


def apply_model_keys(config: Any) -> None:
    """Derive our keys from ``model.converters`` and ``model.hf_assets_path`` (a :class:`JobConfig`,
    changed in place), as torchtitan reads them.

    - ``float8`` in ``model.converters`` turns on ``float8.enable``;
    - ``model.hf_assets_path`` (a Hugging Face folder) gives the tokenizer when ``model.tokenizer_path``
      is empty, and the weights and config.json when ``checkpoint.initial_load_in_hf`` is set without a
      ``checkpoint.initial_load_path``.

    Raises:
        ConfigError: an unknown converter name (with the list of known ones).
    """
    for name in config.model.converters:
        if name not in CONVERTERS:
            raise ConfigError(f"--model.converters: unknown converter {name!r}; known: {', '.join(CONVERTERS)}")
        section, _, key = CONVERTERS[name].partition(".")
        setattr(getattr(config, section), key, True)
    folder = config.model.hf_assets_path
    if folder:
        if not config.model.tokenizer_path:
            config.model.tokenizer_path = folder
        if config.checkpoint.initial_load_in_hf and not config.checkpoint.initial_load_path:
            config.checkpoint.initial_load_path = folder
