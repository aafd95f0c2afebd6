"""What a training run tells its user outside the metrics and checkpoints.

* The log lines of setup: the model and the shape of a step (``log_model``), where the run writes
  (``log_outputs``: metrics, TensorBoard, checkpoints, plot, traces).
* ``<dump_folder>/metrics.png`` at the end (``save_plot``; a missing matplotlib is a warning).
* The one-line errors of an input that fails, naming its config key (``data_error``; a data
  source's key: ``dataset_key``), raised by :class:`trainer.train.Trainer` as :class:`trainer.step.TrainingError`
  (exit 1, no traceback).

Everything logs to the ``trainer`` logger, as the Trainer does (``trainer.environment.setup_logging``).
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from trainer.config import JobConfig
from trainer.models.common.args import format_params
from trainer.errors import TrainingError

logger = logging.getLogger("trainer")


def log_model(config: JobConfig, args, device: torch.device, dims, compute_dtype: torch.dtype,
              grad_accum: int) -> None:
    """Log the model (family, flavor, size, shape, FLOPs/token) and the shape of a step on this device."""
    cfg_t = config.training
    n_params = args.num_params()
    moe = args.moe
    logger.info(
        "model %s %s: %s = %s (dim %d, %d layers, %d heads, %d kv heads, %s, vocab %d); "
        "%.3g FLOPs/token", config.model.name, config.model.flavor, f"{n_params:,}", format_params(args), args.dim,
        args.n_layers, args.n_heads, args.kv_heads,
        f"ffn {args.ffn_hidden_dim}" if moe is None else
        f"{moe.num_experts} experts of {moe.hidden_dim}, top-{moe.top_k}, balance {moe.load_balance}",
        args.vocab_size, args.flops_per_token(cfg_t.seq_len))
    logger.info(
        "device %s, %s, compute %s, %d micro-batch(es) of %d x %d tokens per step and rank",
        device, dims.describe(), str(compute_dtype).replace("torch.", ""), grad_accum,
        cfg_t.local_batch_size, cfg_t.seq_len)


def log_outputs(config: JobConfig) -> None:
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


def save_plot(dump_folder: str) -> None:
    """``<dump_folder>/metrics.png`` from metrics.jsonl; a missing matplotlib is reported, not fatal."""
    from trainer.observe.plot import plot_runs

    try:
        path = plot_runs([dump_folder], Path(dump_folder) / "metrics.png")
    except ImportError as exc:
        logger.warning("metrics.png not drawn: %s (pip install matplotlib)", exc)
        return
    logger.info("plot of the metrics written to %s", path)


def data_error(exc: Exception, key: str) -> TrainingError:
    """A one-line error for an input that failed (a data source, the tokenizer), naming the key
    (``key`` unless the message does)."""
    msg = str(exc)
    return TrainingError(f"--{msg}" if msg.startswith(("training.", "validation.", "model.")) else f"--{key}: {msg}")


def dataset_key(config: JobConfig, section: str) -> str:
    """The config key of the source a ``section`` reads (validation's held-out part: training's)."""
    v, t = config.validation, config.training
    if section == "validation" and (v.dataset_path or v.dataset):
        return "validation.dataset_path" if v.dataset_path else "validation.dataset"
    return "training.dataset_path" if t.dataset_path else "training.dataset"
