"""Training metrics: console lines, ``<dump_folder>/metrics.jsonl``, TensorBoard, and an end summary.

At step 1, every ``log_freq`` steps and at the last step, one record is written with:
  step; loss: the mean token loss over all ranks, averaged over the steps since the previous record
  (with ``log_freq = 1``: exactly that step's loss); grad_norm: the step's global gradient norm
  before clipping; lr: the step's learning rate; tps (tokens/s per device over the interval), mfu (percent, or null where the peak is unknown),
  memory_gib (peak: GPU reserved memory, or the process's peak RSS on CPU), data_wait (share of the
  interval spent waiting for the data loader), elapsed_s (wall seconds since this process started
  training, cumulative: validation and checkpoint time included; it restarts at 0 after a resume),
  eta_s (estimated seconds to the end of the run: the steps left at the mean time per training step
  since step 1, plus each scheduled phase still to come, validations and checkpoint saves, at the
  mean time that phase took so far in this process; a phase not yet measured counts 0).
The console line shows the same, with the elapsed time and the ETA as h:mm:ss. With QK-clip the
record also has qk_max_logit and qk_clipped_heads (``trainer.optim.qk_clip``: over the steps since
the previous record), and the console line shows them when a head was clipped.

Each validation (``log_validation``) appends its own record: step, val_loss (mean token loss over
the validation tokens), val_perplexity (exp of it), val_tokens, val_batches, val_time_s, elapsed_s;
TensorBoard tags validation/loss and validation/perplexity. Its time is left out of the training
interval, so tps stays the training rate.

A resumed run appends to the same metrics.jsonl; the steps it logs again after the checkpoint are
newer records of the same step (``trainer.plot`` keeps the last one of each step). Each record is
appended by one ``write`` of the whole line; a last line torn by a kill in the middle of a write
(no final newline) is cut off when the next run opens the file (:func:`repair_jsonl`), so the
resumed run's first record starts on a line of its own.

MFU = tps x FLOPs/token / peak FLOP/s (torchtitan's definition; FLOPs/token from
``ModelArgs.flops_per_token``). Peaks are dense bf16 tensor-core figures from the vendors' data
sheets (``PEAK_BF16_FLOPS``); on a CPU or an unknown GPU the MFU is reported as "n/a" rather than
against a made-up peak.
"""
from __future__ import annotations

import json
import logging
import math
import os
import pathlib
import resource
import sys
import time
from dataclasses import dataclass, field

import torch

# Dense BF16 peak FLOP/s (NVIDIA data sheets; SXM parts unless named).
PEAK_BF16_FLOPS: dict[str, float] = {
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "A100": 312e12,
}

JSONL_NAME = "metrics.jsonl"

logger = logging.getLogger("trainer")


def repair_jsonl(path: str | os.PathLike) -> int:
    """Cut a torn last line (one without its newline, left by a kill mid-write) off the file ``path``.

    Returns the number of bytes removed (0 when the file is whole or absent)."""
    try:
        f = open(path, "r+b")
    except FileNotFoundError:
        return 0
    with f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return 0
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        # Find the last newline, reading backwards in blocks (records are short).
        end, keep = size, 0
        while end > 0:
            start = max(0, end - 65536)
            f.seek(start)
            block = f.read(end - start)
            i = block.rfind(b"\n")
            if i >= 0:
                keep = start + i + 1
                break
            end = start
        f.truncate(keep)
    logger.warning("%s: removed a torn last line (%d bytes, from a run killed while writing it)", path, size - keep)
    return size - keep


def peak_flops(device: torch.device) -> float | None:
    """Peak dense bf16 FLOP/s of ``device``, or None (CPU, or a GPU not in ``PEAK_BF16_FLOPS``)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    if "H100" in name and ("PCIe" in name or "PCIE" in name):
        return PEAK_BF16_FLOPS["H100 PCIe"]
    for key in ("H200", "H100", "A100"):
        if key in name:
            return PEAK_BF16_FLOPS[key]
    return None


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory so far in GiB: reserved by the CUDA caching allocator, or the peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**30
    # ru_maxrss is in KiB on Linux, bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


class _Color:
    def __init__(self, enabled: bool) -> None:
        codes = dict(grey="90", red="31", green="32", yellow="33", blue="34", magenta="35", cyan="36", bold="1")
        for name, code in codes.items():
            setattr(self, name, f"\033[{code}m" if enabled else "")
        self.reset = "\033[0m" if enabled else ""


@dataclass
class Summary:
    """What the end-of-run summary reports."""

    steps: int = 0  # steps done by this process (a resumed run counts only its own)
    first_step: int = 0
    last_step: int = 0
    first_loss: float = math.nan
    last_loss: float = math.nan
    min_loss: float = math.inf
    tokens: int = 0
    train_time_s: float = 0.0
    data_wait_s: float = 0.0
    tps_history: list[float] = field(default_factory=list)
    mfu_history: list[float] = field(default_factory=list)
    peak_memory_gib: float = 0.0
    last_val_loss: float | None = None


def format_duration(seconds: float) -> str:
    """``h:mm:ss`` (or ``m:ss`` under an hour) of a non-negative duration; ``?`` if unknown."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


class MetricsLogger:
    """Collects per-step numbers; every ``log_freq`` steps writes one record (rank 0 only).

    Args:
        dump_folder: where metrics.jsonl (and the TensorBoard folder) go.
        log_freq: steps between records (>= 1).
        device: the training device (for memory and the MFU peak).
        flops_per_token: training FLOPs per token (``ModelArgs.flops_per_token(seq_len)``).
        total_steps: the run's last step (always logged).
        enabled: False on ranks other than 0 (they still time themselves, but write nothing).
        enable_tensorboard / tb_folder: also write TensorBoard scalars under dump_folder/tb_folder.
        enable_color: ANSI colors on the console (only when stdout is a terminal; NO_COLOR disables).
        wandb: a ``trainer.observe.wandb_log.WandbLogger`` that gets every record too (closed by ``close``), or None.
        phases: ``{name: every}`` the phases between steps the ETA counts (``phase`` measures them):
            every ``every`` steps and at the last step; None = at the last step only; 0 = never.
    """

    def __init__(
        self,
        dump_folder: str | os.PathLike,
        log_freq: int,
        device: torch.device,
        flops_per_token: int,
        total_steps: int,
        enabled: bool = True,
        enable_tensorboard: bool = False,
        tb_folder: str = "tb",
        enable_color: bool = True,
        wandb=None,
        phases: dict[str, int | None] | None = None,
    ) -> None:
        if not isinstance(log_freq, int) or log_freq < 1:
            raise ValueError(f"metrics.log_freq: expected an integer >= 1, got {log_freq!r}")
        self.log_freq = log_freq
        self.device = device
        self.flops_per_token = flops_per_token
        self.total_steps = total_steps
        self.enabled = enabled
        self.peak = peak_flops(device)
        use_color = enable_color and sys.stdout.isatty() and not os.environ.get("NO_COLOR")
        self.c = _Color(use_color)
        self.summary = Summary()
        self._interval_tokens = 0
        self._interval_data_wait = 0.0
        self._interval_loss = None
        self._interval_steps = 0
        self._interval_start = time.perf_counter()
        self._run_start = self._interval_start
        self._rate_start: tuple[int, float] | None = None  # (step, time) after the first step, for the ETA
        self._phases = {name: every for name, every in (phases or {}).items() if every != 0}
        self._phase_time: dict[str, tuple[int, float]] = {}  # name -> (times measured, seconds in all)
        self._jsonl = None
        self._tb = None
        self._wandb = wandb if enabled else None
        if enabled:
            folder = pathlib.Path(dump_folder)
            folder.mkdir(parents=True, exist_ok=True)
            repair_jsonl(folder / JSONL_NAME)
            # Unbuffered: each record is one write() of the whole line (O_APPEND), never half a line.
            self._jsonl = open(folder / JSONL_NAME, "ab", buffering=0)
            if enable_tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(folder / tb_folder))

    def reset_timer(self) -> None:
        """Start a new timing interval now (e.g. after setup or a resume)."""
        self._interval_start = time.perf_counter()
        self._interval_tokens = 0
        self._interval_data_wait = 0.0
        self._interval_loss = None
        self._interval_steps = 0

    def start(self) -> None:
        """The training loop starts now: elapsed_s counts from here."""
        self.reset_timer()
        self._run_start = self._interval_start
        self._rate_start = None

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` (e.g. a validation) out of the current interval's time, so tps is the training rate."""
        self._interval_start += seconds

    def phase(self, name: str, seconds: float) -> None:
        """A phase between steps (a validation, a checkpoint save) took ``seconds``: the ETA counts it
        per occurrence left (``phases``) at its mean time, and leaves it out of the time per step."""
        n, total = self._phase_time.get(name, (0, 0.0))
        self._phase_time[name] = (n + 1, total + seconds)
        if self._rate_start is not None:
            self._rate_start = (self._rate_start[0], self._rate_start[1] + seconds)

    def occurrences(self, name: str, step: int) -> int:
        """How many times phase ``name`` still runs at steps ``step``..``total_steps`` (both included)."""
        every, last = self._phases.get(name, 0), self.total_steps
        if every == 0 or step > last:
            return 0
        if every is None:
            return 1
        return last // every - (step - 1) // every + (last % every != 0)

    def eta_s(self, step: int, now: float | None = None) -> float:
        """Seconds to the end of the run after step ``step``'s training (NaN before a time per step is
        known): the steps left at the mean training time per step since the first step, plus the
        scheduled phases still to come at step ``step`` or later, each at its mean measured time."""
        now = time.perf_counter() if now is None else now
        if self._rate_start is None or step <= self._rate_start[0]:
            return math.nan
        per_step = (now - self._rate_start[1]) / (step - self._rate_start[0])
        phases = sum(total / n * self.occurrences(name, step) for name, (n, total) in self._phase_time.items())
        return per_step * (self.total_steps - step) + phases

    def should_log(self, step: int) -> bool:
        return step == 1 or step % self.log_freq == 0 or step == self.total_steps

    def step(
        self,
        step: int,
        tokens: int,
        data_wait_s: float,
        loss: torch.Tensor | float | None = None,
        grad_norm: torch.Tensor | float | None = None,
        lr: float | None = None,
        extra=None,
    ) -> dict | None:
        """Account one finished step; at logging steps, write and return the record (else None).

        ``tokens``: tokens this device processed in the step. ``loss``/``grad_norm`` may stay tensors
        (only read, forcing a device sync, at logging steps). ``extra``: a callable returning more
        ``{name: float}`` for the record (e.g. the MoE expert loads), called at logging steps only;
        each goes to TensorBoard as ``train/<name>``.
        """
        if loss is not None:
            loss = loss.detach() if isinstance(loss, torch.Tensor) else float(loss)
            self._interval_loss = loss if self._interval_loss is None else self._interval_loss + loss
            self._interval_steps += 1
        self._interval_tokens += tokens
        self._interval_data_wait += data_wait_s
        self.summary.tokens += tokens
        self.summary.data_wait_s += data_wait_s
        if self.summary.steps == 0:
            self.summary.first_step = step
        self.summary.steps += 1
        self.summary.last_step = step
        now = time.perf_counter()
        if self._rate_start is None:  # the first step (compilation, allocation) is left out of the ETA
            self._rate_start = (step, now)
        if not self.should_log(step):
            return None
        dt = max(now - self._interval_start, 1e-9)
        loss_v = float(self._interval_loss) / self._interval_steps if self._interval_steps else math.nan
        record = {
            "step": step,
            "loss": loss_v,
            "grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
            "lr": float(lr) if lr is not None else math.nan,
            "tps": self._interval_tokens / dt,
            "mfu": None,
            "memory_gib": peak_memory_gib(self.device),
            "data_wait": self._interval_data_wait / dt,
            "elapsed_s": now - self._run_start,
            "eta_s": self.eta_s(step, now),
        }
        if math.isnan(record["eta_s"]):
            record["eta_s"] = None
        if extra is not None:
            record.update(extra())
        if self.peak is not None:
            record["mfu"] = 100.0 * record["tps"] * self.flops_per_token / self.peak
        s = self.summary
        s.train_time_s += dt
        if math.isnan(s.first_loss):
            s.first_loss = loss_v
        s.last_loss = loss_v
        s.min_loss = min(s.min_loss, loss_v)
        s.tps_history.append(record["tps"])
        if record["mfu"] is not None:
            s.mfu_history.append(record["mfu"])
        s.peak_memory_gib = max(s.peak_memory_gib, record["memory_gib"])
        self._write(record)
        self.reset_timer()
        return record

    def _write(self, r: dict) -> None:
        if not self.enabled:
            return
        c = self.c
        mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.2f}%"
        width = len(str(self.total_steps))
        eta = format_duration(r["eta_s"]) if r["eta_s"] is not None else "?"
        print(
            f"{c.red}step {r['step']:>{width}}  {c.green}loss {r['loss']:8.4f}  "
            + (f"mtp_loss {r['mtp_loss']:.4f}  " if "mtp_loss" in r else "") + f"{c.yellow}grad_norm {r['grad_norm']:7.4f}  "
            f"{c.cyan}lr {r['lr']:.3e}  {c.blue}tps {r['tps']:,.0f}  {c.magenta}mfu {mfu}  "
            f"{c.grey}memory {r['memory_gib']:.2f}GiB  data {100 * r['data_wait']:.1f}%  "
            f"elapsed {format_duration(r['elapsed_s'])}  eta {eta}"
            + (f"  moe max/mean load {r['moe_max_load']:.2f}" if "moe_max_load" in r else "")
            + (f"  qk-clip {r['qk_clipped_heads']} head(s) clipped, max logit {r['qk_max_logit']:.1f}"
               if r.get("qk_clipped_heads") else "") + f"{c.reset}",
            flush=True,
        )
        self._jsonl.write((json.dumps(r) + "\n").encode())
        if self._tb is not None:
            for key in ("loss", "grad_norm", "lr", "tps", "mfu", "memory_gib", "data_wait"):
                if r[key] is not None:
                    self._tb.add_scalar(f"train/{key}", r[key], r["step"])
            for key in r:
                # expert load per layer; the MTP modules' loss; QK-clip's max logit and clipped heads
                if (key.startswith(("moe_", "qk_")) or key == "mtp_loss") and r[key] is not None:
                    self._tb.add_scalar(f"train/{key}", r[key], r["step"])
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log_train(r)

    def log_validation(self, step: int, result: dict) -> dict:
        """Write (rank 0) one validation record: ``result`` holds val_loss, val_perplexity, val_tokens,
        val_batches and val_time_s (``trainer.evaluate.Validator.evaluate``). Returns the record."""
        record = {"step": step, **result, "elapsed_s": time.perf_counter() - self._run_start}
        self.phase("validation", result["val_time_s"])
        self.summary.last_val_loss = record["val_loss"]
        if not self.enabled:
            return record
        c = self.c
        width = len(str(self.total_steps))
        print(
            f"{c.red}step {step:>{width}}  {c.bold}validation{c.reset}  {c.green}loss {record['val_loss']:8.4f}"
            + (f"  perplexity {record['val_perplexity']:,.2f}" if "val_perplexity" in record else "")
            + f"{c.reset}  {c.grey}{record['val_tokens']:,} tokens in "
            f"{record['val_batches']} batch(es), {record['val_time_s']:.1f}s{c.reset}",
            flush=True,
        )
        self._jsonl.write((json.dumps(record) + "\n").encode())
        if self._tb is not None:
            self._tb.add_scalar("validation/loss", record["val_loss"], step)
            if "val_perplexity" in record:  # a language model's (a diffusion model has none)
                self._tb.add_scalar("validation/perplexity", record["val_perplexity"], step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log_validation(step, record)
        return record

    def log_samples(self, step: int, samples: list[tuple[str, str]]) -> None:
        """Write (rank 0) the (prompt, completion) pairs of a validation (``validation.sample_prompts``):
        printed, one ``{"step", "samples"}`` record in metrics.jsonl, TensorBoard text ``validation/samples``."""
        if not self.enabled or not samples:
            return
        c = self.c
        for prompt, completion in samples:
            print(f"{c.red}step {step}{c.reset}  {c.bold}sample{c.reset}  {prompt!r} -> {completion!r}", flush=True)
        record = {"step": step, "samples": [{"prompt": p, "completion": t} for p, t in samples]}
        self._jsonl.write((json.dumps(record) + "\n").encode())
        if self._tb is not None:
            text = "\n\n".join(f"**{p}**{t}" for p, t in samples)
            self._tb.add_text("validation/samples", text, step)

    def log_images(self, step: int, tag: str, images) -> None:
        """(rank 0) ``images`` (n, 3, H, W) float in [0, 1] to TensorBoard under ``tag`` (a family's
        validation samples); nothing without TensorBoard."""
        if self.enabled and self._tb is not None:
            self._tb.add_images(tag, images, step)
            self._tb.flush()

    def print_summary(self) -> dict:
        """Print (rank 0) and return the end-of-run summary."""
        s = self.summary
        # The first interval includes warm-up (allocations, compilation); leave it out when there is more.
        tps = s.tps_history[1:] if len(s.tps_history) > 1 else s.tps_history
        mfu = s.mfu_history[1:] if len(s.mfu_history) > 1 else s.mfu_history
        out = {
            "steps": s.steps,
            "first_step": s.first_step,
            "last_step": s.last_step,
            "first_loss": s.first_loss,
            "last_loss": s.last_loss,
            "min_loss": s.min_loss,
            "tokens_per_device": s.tokens,
            "train_time_s": s.train_time_s,
            "tps_mean": sum(tps) / len(tps) if tps else math.nan,
            "mfu_mean": sum(mfu) / len(mfu) if mfu else None,
            "peak_memory_gib": s.peak_memory_gib,
            "data_wait": s.data_wait_s / s.train_time_s if s.train_time_s > 0 else math.nan,
            "val_loss": s.last_val_loss,
        }
        if self.enabled:
            c = self.c
            mfu_txt = "n/a" if out["mfu_mean"] is None else f"{out['mfu_mean']:.2f}%"
            resumed = f" ({s.first_step}..{s.last_step}, resumed)" if s.first_step > 1 else ""
            val = f", validation loss {s.last_val_loss:.4f}" if s.last_val_loss is not None else ""
            print(
                f"{c.bold}summary{c.reset}: {out['steps']} steps{resumed} in {out['train_time_s']:.1f}s, "
                f"loss {out['first_loss']:.4f} -> {out['last_loss']:.4f} (min {out['min_loss']:.4f}){val}, "
                f"{out['tps_mean']:,.0f} tokens/s per device, MFU {mfu_txt}, "
                f"peak memory {out['peak_memory_gib']:.2f}GiB, data wait {100 * out['data_wait']:.1f}%",
                flush=True,
            )
        return out

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
