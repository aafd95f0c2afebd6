"""Stage 2 of bench/run_gpu.sh: the trainer on the device, tokens/s, MFU, peak memory and a falling loss.

    python -m bench.gpu_train PREFIX [--dry-run]

Runs, each a separate process with its own time limit (a failure or time-out is recorded with the
last lines of its output, and the next run goes on):

  debugmodel      ``python -m trainer`` itself (the debug model, a few steps): the command line users run.
  8B-4L eager     Llama 3 8B cut to 4 layers: dim 4096, 32/8 heads, FFN 14336, vocab 128256, seq 8192,
                  batch 1, bf16 with FSDP2 on one GPU (the 8B config's mixed precision, selective
                  activation checkpointing), eager;
  8B-4L compile   the same with ``--compile.enable`` (per-block torch.compile + the loss);
  8B-4L float8    the same eager with ``--float8.enable`` (our Float8Linear, tensorwise).
  flux-dev 6 blocks  a Flux training step at FLUX.1-dev width, one 1024x1024 image (4608 tokens), bf16
                  FSDP2 on one GPU (``bench/gpu_flux.py``).

The cut model runs through ``python -m bench.gpu_train --cut-8b LAYERS -- <trainer args>``, which sets
the 8B flavor's layer count in this process and then runs the trainer's own ``main`` with the args.

Per run: tokens/s per device and MFU (the trainer's, against the datasheet bf16 peak) averaged over
the logged intervals after the first (which holds compilation and warm-up), MFU against the bf16
matmul rate measured in stage 1, peak memory, and the logged losses (falling: last < first). Written
to the ``train`` section of PREFIX.json after each run.

``--dry-run`` (the CPU): the same runs and arguments at toy sizes: the 8B flavor replaced by a
1-layer dim-64 model of the same structure (the real vocabulary), seq 32, 2 steps,
``--compile.backend aot_eager`` (Inductor's CPU code generation would take minutes) and float8 on
every layer (the small-GEMM filter would skip all toy layers).
"""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

from bench import gpu_report

REPO = pathlib.Path(__file__).resolve().parents[1]
LAYERS = 4
# (name, seconds, extra trainer args): the budgets add up to the stage's (see run_gpu.sh).
# The eager run is the first to JIT-compile our Triton kernels at 8B shapes, the compiled one pays
# Inductor (~1 min for a block), the float8 one the casts; run_gpu.sh runs this stage with each
# kernel's default config (TITAN_KERNELS_AUTOTUNE=0, BENCH_AUTOTUNE_CONFIGS=1): no autotuning compiles.
RUNS_8B = [("8B-4L eager", 45, []), ("8B-4L compile", 70, ["--compile.enable"]),
           ("8B-4L float8", 35, ["--float8.enable"])]
DEBUG_SECONDS = 25
# A Flux step at flux-dev width (2 double + 4 single blocks), one 1024x1024 image (bench/gpu_flux.py);
# its 25 s come from the compile and float8 runs' budgets (85 -> 70, 45 -> 35): unmeasured on a GPU yet.
FLUX_SECONDS = 25


# Shared by every run: no plot or TensorBoard (the numbers go to the result files), no checkpoints.
_QUIET = ["--metrics.enable_color", "false", "--metrics.enable_tensorboard", "false", "--metrics.save_plot", "false",
          "--checkpoint.enable", "false"]


def _common_8b(dry: bool) -> list[str]:
    steps, log_freq, seq = (2, 1, 32) if dry else (12, 2, 8192)
    return ["--flavor", "8B", "--training.steps", str(steps), "--metrics.log_freq", str(log_freq),
            "--training.seq_len", str(seq), "--training.local_batch_size", "1",
            "--lr_scheduler.warmup_steps", "3", *_QUIET]


def _debug_args(dry: bool) -> list[str]:
    steps, seq = (2, 32) if dry else (10, 256)
    return ["--training.steps", str(steps), "--metrics.log_freq", "1" if dry else "2",
            "--training.seq_len", str(seq), "--lr_scheduler.warmup_steps", "2", *_QUIET]


def _dry_extra(extra: list[str]) -> list[str]:
    out = list(extra)
    if "--compile.enable" in out:
        out += ["--compile.backend", "aot_eager"]
    if "--float8.enable" in out:
        out += ["--float8.auto_filter_small_kgemms", "false"]  # toy layers would all be filtered out
    return out


def cut_8b(layers: int, dry: bool) -> None:
    """Make the 8B flavor ``layers`` deep in this process (at toy width for the dry run)."""
    from trainer.models.llama3.args import LLAMA3_FLAVORS  # the registered family's own dict

    base = LLAMA3_FLAVORS["8B"]
    if dry:  # same structure (GQA, FFN multiplier, vocabulary), toy width, one layer (CPU float8 is slow)
        base, layers = base.replace(dim=64, n_heads=4, n_kv_heads=2, multiple_of=32), 1
    LLAMA3_FLAVORS["8B"] = base.replace(n_layers=layers)


def flops_per_token(layers: int, seq: int, dry: bool) -> float:
    cut_8b(layers, dry)
    from trainer.registry import model_args

    return float(model_args("llama3", "8B", 1, seq).flops_per_token(seq))


def _tail(text: str, n: int = 25) -> list[str]:
    return [line[:300] for line in text.splitlines()[-n:]]


_children: set = set()


def _kill_children(*_signal) -> None:
    # Each run is its own process group (its compile workers included): end the whole group.
    for proc in list(_children):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if _signal:  # SIGTERM from the stage's `timeout`: leave no run behind on the device
        sys.exit(143)


def run_one(name: str, cmd: list[str], folder: pathlib.Path, timeout: float, env: dict) -> dict:
    row: dict = {"name": name, "command": " ".join(cmd[1:])}
    t0 = time.perf_counter()
    print(f"--- {name}: {' '.join(cmd[1:])} (limit {timeout:.0f} s)", flush=True)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    _children.add(proc)
    try:
        out, _ = proc.communicate(timeout=timeout)
        row["rc"] = proc.returncode
    except subprocess.TimeoutExpired:
        _kill_children()
        out, _ = proc.communicate()
        row["rc"] = "timeout"
    finally:
        _children.discard(proc)
    row["wall_s"] = time.perf_counter() - t0
    print("\n".join(f"    {line}" for line in _tail(out, 12)), flush=True)
    row.update(gpu_report.run_summary(folder))
    if row["rc"] != 0:
        row["output_tail"] = _tail(out)
    return row


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--cut-8b":  # the child: the trainer with the 8B flavor cut
        layers, dry = int(argv[1]), "--dry-run" in argv
        rest = argv[argv.index("--") + 1:]
        from bench import autotune_cap

        autotune_cap.install()
        cut_8b(layers, dry)
        from trainer.__main__ import main as trainer_main

        return trainer_main(rest)

    prefix, dry = argv[0], "--dry-run" in argv
    signal.signal(signal.SIGTERM, _kill_children)
    env_info = gpu_report.load(prefix).get("environment", {})
    measured = env_info.get("matmul_TFLOPs")
    folder = pathlib.Path(prefix + "-runs")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    py = sys.executable
    runs: list[dict] = []

    def save():
        gpu_report.update(prefix, "train", {"runs": runs, "layers_of_8b": LAYERS,
                                            "measured_matmul_TFLOPs": measured})

    out = folder / "debugmodel"
    row = run_one("debugmodel", [py, "-m", "trainer", *_debug_args(dry), "--job.dump_folder", str(out)], out,
                  DEBUG_SECONDS * (3 if dry else 1), dict(env, TITAN_KERNELS_AUTOTUNE="0"))
    row["layers"] = 6
    runs.append(row)
    save()

    seq = 32 if dry else 8192
    fpt = flops_per_token(LAYERS, seq, dry)
    for name, seconds, extra in RUNS_8B:
        out = folder / name.replace(" ", "_")
        args = [*_common_8b(dry), *(_dry_extra(extra) if dry else extra), "--job.dump_folder", str(out)]
        cmd = [py, "-m", "bench.gpu_train", "--cut-8b", str(LAYERS), *(["--dry-run"] if dry else []), "--", *args]
        row = run_one(name, cmd, out, seconds * (3 if dry else 1), env)
        row["layers"] = 1 if dry else LAYERS
        row["flops_per_token"] = fpt
        if measured and row.get("tokens_per_s"):
            row["mfu_measured_percent"] = 100.0 * row["tokens_per_s"] * fpt / (measured * 1e12)
        runs.append(row)
        save()

    out = folder / "flux-dev-6blocks"
    row = run_one("flux-dev 6 blocks", [py, "-m", "bench.gpu_flux", str(out), *(["--dry-run"] if dry else [])], out,
                  FLUX_SECONDS * (3 if dry else 1), dict(env, TITAN_KERNELS_AUTOTUNE="0"))
    row["layers"] = 6
    runs.append(row)
    save()

    # The dry run's two toy steps are inside the LR warmup: only the exit status counts there.
    failed = [r["name"] for r in runs if r["rc"] != 0 or (not dry and not r.get("loss_falling"))]
    for r in runs:
        print(f"{r['name']:16s} rc {r['rc']}  tokens/s {r.get('tokens_per_s', float('nan')):,.0f}  "
              f"MFU {r.get('mfu_percent')}  peak {r.get('memory_gib')} GiB  losses {r.get('losses')}", flush=True)
    if failed:
        print(f"failed or loss not falling: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
