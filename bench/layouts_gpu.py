"""Multi-GPU layouts: tokens/s and MFU of 2-D / 3-D parallel runs, and the TP + compile check.

    python bench/layouts_gpu.py OUT_PREFIX          (bench/run_gpu.sh runs it when >= 2 GPUs are visible)

Runs ``torchrun -m trainer`` on this node's GPUs (bf16, 20 steps, metrics every 5) and writes
``OUT_PREFIX.json`` / ``OUT_PREFIX.md``: per layout the world size, the steady-state tokens/s per
GPU and MFU (the mean of the logged intervals after the first, which includes compilation and
warm-up), peak memory, the final loss, and the versions. Layouts by GPU count:

  >= 2  TP 2, Llama 3 8B, eager and compiled: their losses must agree to bf16 accuracy; this is
        the check of per-block compile under tensor parallel, which is refused on the CPU (see
        trainer/parallel/README.md);
  >= 4  FSDP (n/2) x TP 2, 8B, compiled (2-D);
  >= 8  FSDP (n/4) x TP 2 x PP 2 (1F1B), 8B, compiled (3-D).

Each run has its own time limit; a failed or timed-out run is recorded with its last output lines.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from bench import gpu_report

REPO = Path(__file__).resolve().parents[1]
STEPS, LOG_FREQ = 20, 5
COMMON = ["--flavor", "8B", "--training.steps", str(STEPS), "--metrics.log_freq", str(LOG_FREQ),
          "--metrics.enable_color", "false", "--training.seq_len", "4096", "--training.local_batch_size", "1",
          "--lr_scheduler.warmup_steps", "5", "--activation_checkpoint.mode", "selective",
          "--activation_checkpoint.selective_ac_option", "op"]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
COMPILE = ["--compile.enable"]


def layouts(n: int) -> dict[str, tuple[int, list[str]]]:
    out = {"tp2_eager": (2, TP2), "tp2_compiled": (2, [*TP2, *COMPILE])}
    if n >= 4:
        out[f"fsdp{n // 2}_tp2"] = (n, [*TP2, *COMPILE])
    if n >= 8:
        out[f"fsdp{n // 4}_tp2_pp2"] = (n, [*TP2, *COMPILE, "--parallelism.pipeline_parallel_degree", "2",
                                            "--training.local_batch_size", "2"])
    return out


def run(name: str, nproc: int, extra: list[str], folder: Path, timeout: float = 420.0) -> dict:
    out = folder / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "trainer", *COMMON, *extra, "--job.dump_folder", str(out)]
    row = {"layout": name, "world": nproc, "args": " ".join(extra)}
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        row["rc"] = proc.returncode
        tail = (proc.stdout + proc.stderr).splitlines()[-15:]
    except subprocess.TimeoutExpired as exc:
        row["rc"] = "timeout"
        tail = ((exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")).splitlines()[-15:]
    summary = gpu_report.run_summary(out)
    if summary:
        row["tokens_per_s_per_gpu"] = summary.pop("tokens_per_s")
        row.update(summary)
    if row["rc"] != 0:
        row["output_tail"] = tail
    return row


def main(prefix: str) -> int:
    n = torch.cuda.device_count()
    if n < 2:
        print(f"{n} GPU(s) visible: the multi-GPU layouts need at least 2; skipped")
        return 0
    folder = Path(prefix + "-runs")
    rows = [run(name, nproc, extra, folder) for name, (nproc, extra) in layouts(n).items()]
    eager, compiled = rows[0].get("losses"), rows[1].get("losses")
    check = "not run"
    if eager and compiled and len(eager) == len(compiled):
        worst = max(abs(a - b) / abs(a) for a, b in zip(eager, compiled))
        check = f"max relative loss difference {worst:.2e} ({'ok' if worst <= 2e-2 else 'MISMATCH'} at bf16 tolerance 2e-2)"
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(), "gpus": n, "torch": torch.__version__,
            "tp_compile_check": check, "rows": rows}
    Path(prefix + ".json").write_text(json.dumps(meta, indent=1))
    lines = [f"# Parallel layouts on {n} x {meta['device']} ({meta['date']}, torch {meta['torch']})", "",
             f"TP 2 compiled vs eager: {check}", "",
             "| layout | GPUs | tokens/s/GPU | MFU % | peak GiB | final loss | rc |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        mfu = r.get("mfu_percent")
        lines.append(f"| {r['layout']} | {r['world']} | {r.get('tokens_per_s_per_gpu', float('nan')):,.0f} | "
                     f"{'n/a' if mfu is None else f'{mfu:.1f}'} | {r.get('memory_gib', float('nan')):.1f} | "
                     f"{(r.get('losses') or [float('nan')])[-1]:.4f} | {r['rc']} |")
    Path(prefix + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    for r in rows:
        if r["rc"] != 0:
            print(f"\n{r['layout']} failed ({r['rc']}):\n" + "\n".join(r.get("output_tail", [])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "bench/results/local/layouts"))
