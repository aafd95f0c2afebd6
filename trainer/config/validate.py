"""Checking a configuration (not the validation loss, which is ``trainer.evaluate``): every value of
a :class:`JobConfig` and the relations between them, checked before a run starts, each failure a
one-line :class:`ConfigError` naming the key.

The checks here need neither a model nor the world size; those that do (a layout that does not
divide the model or the ranks, a batch that does not divide the data-parallel degree) are made
where the run starts (``trainer.parallel``, :meth:`JobConfig.grad_accum_steps`).

Imports :mod:`trainer.config.sections`, :mod:`~trainer.config.fields`, :mod:`~trainer.config.flavors`
and :mod:`~trainer.config.job` of the package; :func:`trainer.config.parse_args` calls
:func:`validate_config`.
"""
from __future__ import annotations

import math
import pathlib
from typing import Any

from trainer.config.activation_policy import parse_per_layer  # torch-free: the per_layer rules' syntax
from trainer.config.fields import check_value, choice_message, field_choices, iter_fields
from trainer.config.flavors import available_flavors
from trainer.config.job import JobConfig
from trainer.config.sections import ConfigError, Parallelism, Profiling, Training, Validation
from trainer.config.torchtitan_keys import CONVERTERS

COMPILE_COMPONENTS = ("model", "loss")
# [optimizer.groups]: what a rule may select and set (trainer/optim/groups.py applies them).
GROUP_KINDS = ("embedding", "output", "norm", "bias", "router", "expert", "hidden", "other")
GROUP_KEYS = ("optimizer", "lr_multiplier", "weight_decay")
# The kinds whose parameters are vectors (or scalars): never Muon's (trainer/optim/groups.py param_kind).
VECTOR_KINDS = ("norm", "bias", "other")
GROUP_OPTIMIZERS = ("adamw", "muon")


def validate_config(config: JobConfig) -> None:
    """Check every value of ``config`` and the relations between them.

    Checks the types first (a configuration built in code may hold e.g. a str where an int belongs),
    then the choices of the string keys, the ranges, the flavor, that the paths exist, and the
    relations that need no model or world size (those are checked when the run starts).

    Raises:
        ConfigError: the first bad value; the message is one line naming the key.
    """
    for section, f, hint, value in iter_fields(config):
        key = f"{section}.{f.name}"
        check_value(key, value, hint, "--")
        choices = field_choices(f)
        if choices is not None and value not in choices:
            raise ConfigError(choice_message(key, value, choices))

    def need(ok: bool, key: str, value: Any, expected: str) -> None:
        if not ok:
            raise ConfigError(f"--{key}: expected {expected}, got {value!r}")

    t, o, s, p, c = config.training, config.optimizer, config.lr_scheduler, config.parallelism, config.checkpoint
    flavors = available_flavors(config.model.name)
    if config.model.flavor == "custom":
        if not (config.checkpoint.initial_load_in_hf and config.checkpoint.initial_load_path):
            raise ConfigError("--model.flavor: custom builds the model a Hugging Face folder describes; give it with "
                              "--checkpoint.initial_load_in_hf --checkpoint.initial_load_path DIR")
    elif flavors and config.model.flavor not in flavors:
        raise ConfigError(choice_message("model.flavor", config.model.flavor, flavors))
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
    need(math.isfinite(t.mtp_loss_weight) and t.mtp_loss_weight >= 0, "training.mtp_loss_weight", t.mtp_loss_weight,
         "a finite value >= 0")
    need(config.model.mtp_layers >= -1, "model.mtp_layers", config.model.mtp_layers, "-1 (the flavor's) or an integer >= 0")
    for key in ("moe_bias_update_rate", "moe_aux_loss_coeff"):
        value = getattr(config.model, key)
        need(math.isfinite(value) and value >= 0, f"model.{key}", value, "a finite value >= 0")
    for name in config.model.converters:
        if name not in CONVERTERS:
            raise ConfigError(f"--model.converters: unknown converter {name!r}; known: {', '.join(CONVERTERS)}")
    hf = config.model.hf_assets_path
    if hf and not pathlib.Path(hf).expanduser().is_dir():
        raise ConfigError(f"--model.hf_assets_path: no such folder: {hf!r}")
    need(bool(t.dataset or t.dataset_path), "training.dataset", t.dataset, "a dataset name or a dataset_path")
    for key, path in (("training.dataset_path", t.dataset_path), ("model.tokenizer_path", config.model.tokenizer_path)):
        if path and not pathlib.Path(path).expanduser().exists():
            raise ConfigError(f"--{key}: no such file or folder: {path!r}")
    need(math.isfinite(o.lr) and o.lr > 0, "optimizer.lr", o.lr, "a finite value > 0")
    need(0 <= o.beta1 < 1, "optimizer.beta1", o.beta1, "a value in [0, 1)")
    need(0 <= o.beta2 < 1, "optimizer.beta2", o.beta2, "a value in [0, 1)")
    need(math.isfinite(o.eps) and o.eps > 0, "optimizer.eps", o.eps, "a finite value > 0")
    need(math.isfinite(o.weight_decay) and o.weight_decay >= 0, "optimizer.weight_decay", o.weight_decay,
         "a finite value >= 0")
    _validate_optimizer(o)
    need(o.qk_clip_threshold is None or p.context_parallel_degree == 1, "optimizer.qk_clip_threshold",
         o.qk_clip_threshold, "none with parallelism.context_parallel_degree > 1 (ring attention records no "
         "per-head max logit)")
    _validate_flux(config.flux, need)
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
    need(not c.model_weights_only or (c.enable and not c.last_save_in_hf), "checkpoint.model_weights_only",
         c.model_weights_only, "false without --checkpoint.enable or with --checkpoint.last_save_in_hf (the last save "
         "is then none, or the Hugging Face folder)")
    if c.initial_load_path and not pathlib.Path(c.initial_load_path).expanduser().is_dir():
        raise ConfigError(f"--checkpoint.initial_load_path: no such folder: {c.initial_load_path!r}")
    need(not c.initial_load_in_hf or bool(c.initial_load_path), "checkpoint.initial_load_in_hf",
         c.initial_load_in_hf, "false without --checkpoint.initial_load_path")
    need(not c.initial_load_in_hf or c.initial_load_model_only, "checkpoint.initial_load_model_only",
         c.initial_load_model_only, "true with --checkpoint.initial_load_in_hf (a Hugging Face folder holds "
         "weights only)")
    need(config.metrics.log_freq >= 1, "metrics.log_freq", config.metrics.log_freq, "an integer >= 1")
    _validate_validation(config.validation, t, p)
    _validate_resilience(config)
    _validate_profiling(config.profiling)
    ac = config.activation_checkpoint.selective_ac_option
    need(ac == "op" or (ac.isdigit() and int(ac) >= 1), "activation_checkpoint.selective_ac_option", ac,
         "'op' or an integer >= 1")
    for comp in config.compile.components:
        if comp not in COMPILE_COMPONENTS:
            raise ConfigError(choice_message("compile.components", comp, COMPILE_COMPONENTS))
    _validate_offload(config)
    f8 = config.float8
    need(not f8.enable_fsdp_float8_all_gather or f8.recipe == "tensorwise",
         "float8.enable_fsdp_float8_all_gather", f8.enable_fsdp_float8_all_gather,
         f"false with --float8.recipe {f8.recipe} (the float8 all-gather needs tensorwise)")
    if flavors and config.model.flavor in flavors:  # last: the values themselves are checked above
        _validate_model_options(config)



def _validate_model_options(config: JobConfig) -> None:
    """Options the flavor's model does not use (``trainer.config.model_options``) are refused, not ignored.
    A custom flavor's model is known from its config.json only: the trainer checks it then."""
    from trainer import registry
    from trainer.config.model_options import unused_option_errors

    try:
        args = registry.get(config.model.name).flavor_args(config.model.flavor).configure(config.model)
    except ValueError as exc:  # the [model] options give args the model refuses
        raise ConfigError(f"--model.flavor: {config.model.name} {config.model.flavor} with these [model] options: "
                          f"{exc}") from None
    errors = unused_option_errors(config, args)
    if errors:
        raise ConfigError(errors[0])


def _validate_offload(config: JobConfig) -> None:
    """CPU offload and activation offload: their values, and the options they cannot combine with
    (one line naming both)."""
    t, ac = config.training, config.activation_checkpoint
    if not (math.isfinite(t.pcie_bandwidth_gbps) and t.pcie_bandwidth_gbps > 0):
        raise ConfigError(f"--training.pcie_bandwidth_gbps: expected a finite value > 0 (GB/s), got "
                          f"{t.pcie_bandwidth_gbps!r}")
    if not (math.isfinite(ac.memory_budget_gib) and ac.memory_budget_gib >= 0):
        raise ConfigError(f"--activation_checkpoint.memory_budget_gib: expected a finite value >= 0, got "
                          f"{ac.memory_budget_gib!r}")
    if ac.mode == "budget" and ac.memory_budget_gib <= 0:
        raise ConfigError("--activation_checkpoint.memory_budget_gib: expected a value > 0 (GiB) with "
                          "--activation_checkpoint.mode budget, got 0")
    try:
        rules = parse_per_layer(list(ac.per_layer))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    offload = ac.mode in ("offload", "budget") or "offload" in rules.values()
    if offload and config.compile.enable and "model" in config.compile.components:
        raise ConfigError(f"--activation_checkpoint.mode {ac.mode}: activation offload does not combine with "
                          "--compile.enable (its saved-tensor hooks wrap eager blocks; compiled blocks save inside "
                          "their graph)")
    if t.enable_cpu_offload and config.float8.enable_fsdp_float8_all_gather:
        raise ConfigError("--training.enable_cpu_offload: does not combine with --float8.enable_fsdp_float8_all_gather "
                          "(the float8 all-gather casts the device copy of each shard; offloaded shards are gathered "
                          "in the parameter dtype)")
    if t.enable_cpu_offload and config.fault_tolerance.enable:
        raise ConfigError("--training.enable_cpu_offload: does not combine with --fault_tolerance.enable (a recovering "
                          "replica group copies the live state from device to device)")


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
    need(v.sample_max_new_tokens >= 1, "sample_max_new_tokens", v.sample_max_new_tokens, "an integer >= 1")
    if v.sample_prompts and max(p.tensor_parallel_degree, p.pipeline_parallel_degree, p.context_parallel_degree) > 1:
        raise ConfigError("--validation.sample_prompts: sampling during training runs with data parallel only (no "
                          "tensor, pipeline or context parallel); use python -m trainer.generate on the checkpoint")
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


# Signals a preemption may arrive as; SIGINT is Ctrl-C's own (exit 130), SIGKILL cannot be caught.
PREEMPT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT", "SIGXCPU")


def _validate_resilience(config: JobConfig) -> None:
    """[checkpoint] signals and grace, [comm] timeouts, [fault_tolerance] replica groups."""
    c, cm, ft = config.checkpoint, config.comm, config.fault_tolerance
    for name in c.preempt_signals:
        if name not in PREEMPT_SIGNALS:
            raise ConfigError(choice_message("checkpoint.preempt_signals", name, PREEMPT_SIGNALS))
    if not (math.isfinite(c.preempt_grace_seconds) and c.preempt_grace_seconds > 0):
        raise ConfigError(f"--checkpoint.preempt_grace_seconds: expected a finite value > 0, got {c.preempt_grace_seconds!r}")
    if cm.init_timeout_seconds < 1:
        raise ConfigError(f"--comm.init_timeout_seconds: expected an integer >= 1, got {cm.init_timeout_seconds!r}")
    if cm.train_timeout_seconds < 0:
        raise ConfigError(f"--comm.train_timeout_seconds: expected an integer >= 0 (0 = no watchdog), got "
                          f"{cm.train_timeout_seconds!r}")
    if not ft.enable:
        return
    if ft.group_size < 1:
        raise ConfigError(f"--fault_tolerance.group_size: expected an integer >= 1 with --fault_tolerance.enable, "
                          f"got {ft.group_size!r}")
    if not 0 <= ft.replica_id < ft.group_size:
        raise ConfigError(f"--fault_tolerance.replica_id: expected an integer in [0, group_size = {ft.group_size}), "
                          f"got {ft.replica_id!r}")
    if not 1 <= ft.min_replica_size <= ft.group_size:
        raise ConfigError(f"--fault_tolerance.min_replica_size: expected an integer in [1, group_size = "
                          f"{ft.group_size}], got {ft.min_replica_size!r}")
    if ft.process_group_timeout_ms < 1:
        raise ConfigError(f"--fault_tolerance.process_group_timeout_ms: expected an integer >= 1, got "
                          f"{ft.process_group_timeout_ms!r}")
    if not (math.isfinite(ft.lighthouse_timeout_seconds) and ft.lighthouse_timeout_seconds > 0):
        raise ConfigError(f"--fault_tolerance.lighthouse_timeout_seconds: expected a finite value > 0, got "
                          f"{ft.lighthouse_timeout_seconds!r}")
    if config.parallelism.data_parallel_replicate_degree != 1:
        raise ConfigError("--parallelism.data_parallel_replicate_degree: expected 1 with --fault_tolerance.enable "
                          "(the replica groups are the replicate dimension)")
    if config.parallelism.pipeline_parallel_degree != 1:
        raise ConfigError("--parallelism.pipeline_parallel_degree: expected 1 with --fault_tolerance.enable "
                          "(not supported with replica groups yet)")


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


def parse_group_rules(rules: list[str]) -> list[tuple[str, dict]]:
    """The ``[optimizer.groups]`` rules as ``[(selector, {key: value})]``, in order.

    A rule is ``"SELECTOR: key=value ..."``: SELECTOR is a kind of ``GROUP_KINDS`` or a glob over
    parameter names (``layers.*.attention.wq.weight``); keys ``optimizer`` (adamw or muon; AdamW is
    accepted), ``lr_multiplier`` and ``weight_decay`` (finite, >= 0).

    Raises:
        ConfigError: a rule without ':' or settings, an unknown key (with a suggestion), a bad value.
    """
    out = []
    for rule in rules:
        sel, colon, rest = rule.partition(":")
        sel = sel.strip()
        if not colon or not sel or not rest.strip():
            raise ConfigError(f"--optimizer.groups: expected 'SELECTOR: key=value ...', got {rule!r}")
        settings: dict = {}
        for item in rest.split():
            key, eq, value = item.partition("=")
            if not eq or not value:
                raise ConfigError(f"--optimizer.groups: expected key=value in rule {rule!r}, got {item!r}")
            if key not in GROUP_KEYS:
                raise ConfigError(f"--optimizer.groups: {choice_message('key', key, GROUP_KEYS)[2:]} in rule {rule!r}")
            if key == "optimizer":
                if value.lower() not in GROUP_OPTIMIZERS:
                    raise ConfigError(f"--optimizer.groups: optimizer expected one of {', '.join(GROUP_OPTIMIZERS)}, "
                                      f"got {value!r} in rule {rule!r}")
                if value.lower() == "muon" and sel in VECTOR_KINDS:
                    raise ConfigError(f"--optimizer.groups: Muon orthogonalises matrices; the {sel} parameters are "
                                      f"vectors (1 dim) in rule {rule!r}; give them adamw")
                settings[key] = value.lower()
                continue
            try:
                number = float(value)
            except ValueError:
                number = math.nan
            if not math.isfinite(number) or number < 0:
                raise ConfigError(f"--optimizer.groups: {key} expected a finite value >= 0, got {value!r} "
                                  f"in rule {rule!r}")
            settings[key] = number
        out.append((sel, settings))
    return out


def _validate_optimizer(o) -> None:
    """The Muon, QK-clip, state dtype and group keys of ``[optimizer]``."""
    def need(ok: bool, key: str, value: Any, expected: str) -> None:
        if not ok:
            raise ConfigError(f"--{key}: expected {expected}, got {value!r}")

    need(0 <= o.muon_momentum < 1, "optimizer.muon_momentum", o.muon_momentum, "a value in [0, 1)")
    need(o.muon_ns_steps >= 1, "optimizer.muon_ns_steps", o.muon_ns_steps, "an integer >= 1")
    need(math.isfinite(o.muon_rms_match) and o.muon_rms_match > 0, "optimizer.muon_rms_match", o.muon_rms_match,
         "a finite value > 0")
    need(o.qk_clip_threshold is None or (math.isfinite(o.qk_clip_threshold) and o.qk_clip_threshold > 0),
         "optimizer.qk_clip_threshold", o.qk_clip_threshold, "none or a finite value > 0")
    rules = parse_group_rules(o.groups)
    titan = o.name == "muon" or o.state_dtype != "float32" or bool(rules) or o.qk_clip_threshold is not None
    need(not titan or o.implementation in ("auto", "titan"), "optimizer.implementation", o.implementation,
         "auto or titan with optimizer.name muon, optimizer.groups, optimizer.qk_clip_threshold or "
         "optimizer.state_dtype bfloat16 (titan's optimizer runs fused_adamw_ for its AdamW groups; fused, "
         "foreach and for-loop name torch.optim.AdamW's kernels)")


def _validate_flux(f, need) -> None:
    """The ``[flux]`` keys: ranges and that the named folders exist."""
    need(f.img_size >= 16 and f.img_size % 16 == 0, "flux.img_size", f.img_size, "a multiple of 16 >= 16")
    need(0 <= f.caption_dropout <= 1, "flux.caption_dropout", f.caption_dropout, "a probability in [0, 1]")
    need(math.isfinite(f.guidance) and f.guidance >= 0, "flux.guidance", f.guidance, "a finite value >= 0")
    need(math.isfinite(f.logit_std) and f.logit_std > 0, "flux.logit_std", f.logit_std, "a finite value > 0")
    need(math.isfinite(f.logit_mean), "flux.logit_mean", f.logit_mean, "a finite value")
    need(f.sample_steps >= 1, "flux.sample_steps", f.sample_steps, "an integer >= 1")
    need(f.sample_count >= 0, "flux.sample_count", f.sample_count, "an integer >= 0")
    need(math.isfinite(f.sample_cfg_scale) and f.sample_cfg_scale >= 1, "flux.sample_cfg_scale", f.sample_cfg_scale,
         "a finite value >= 1")
    for key in ("pipeline_path", "t5_encoder", "clip_encoder", "autoencoder_path"):
        path = getattr(f, key)
        if path and not pathlib.Path(path).expanduser().is_dir():
            raise ConfigError(f"--flux.{key}: no such folder: {path!r}")
