"""``JobConfig``: the whole configuration of a training run, one field per section
(:mod:`trainer.config.sections`), with its TOML form and the gradient-accumulation count.

Imports :mod:`~trainer.config.sections` and :mod:`~trainer.config.fields` of the package; the checks
(:mod:`trainer.config.validate`) and the command line (:mod:`trainer.config.cli`) build on it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from trainer.config.fields import toml_value
from trainer.config.sections import (
    ActivationCheckpoint,
    Checkpoint,
    Comm,
    Compile,
    ConfigError,
    FaultTolerance,
    Float8,
    Flux,
    Job,
    Kernels,
    LRScheduler,
    Metrics,
    Model,
    Optimizer,
    Parallelism,
    Profiling,
    Training,
    Validation,
)


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
    comm: Comm = field(default_factory=Comm)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    flux: Flux = field(default_factory=Flux)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The configuration as ``{section: {key: value}}`` of plain Python values."""
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        """The configuration as TOML text that :func:`trainer.config.parse_args` ``--config`` reads back."""
        lines: list[str] = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            for key, value in values.items():
                if value is None:
                    lines.append(f"# {key} = none")
                else:
                    lines.append(f"{key} = {toml_value(value)}")
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
