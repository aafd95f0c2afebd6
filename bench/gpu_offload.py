"""The offload stage of bench/run_gpu.sh: what the memory levers save and cost on the device.

    python -m bench.gpu_offload PREFIX [--dry-run]

1. The optimizer step of CPU offload on the host CPU: titan's ``fused_adamw_`` (float32 and bfloat16
   states) against ``torch.optim.AdamW(fused=True)`` over one Llama 3 8B block's parameters, seconds
   per billion parameters (``bench.bench_offload``).
2. The trainer in this process on an 8B-shaped stack (``LAYERS`` blocks of Llama 3 8B: dim 4096,
   32/8 heads, FFN 14336; vocabulary cut to ``VOCAB`` so the blocks dominate), seq 8192, batch 1,
   bf16 FSDP2 on one GPU, eager, with each lever: none, full AC (what activation offload competes
   with), activation offload, CPU offload, both. Per run: peak allocated GPU memory over setup and
   steps, the median step time of the steps after the first, the losses, and beside them what
   ``trainer.estimate.memory`` predicts (device peak, host memory, PCIe bytes per step).
Written to the ``offload`` section of PREFIX.json after each part, so a time-out loses only the rest.

``--dry-run`` (the CPU): the same code at toy sizes (1 block of dim 64, seq 32, 2 steps; no GPU
memory to read) and a 1M-parameter optimizer case.
"""
from __future__ import annotations

import gc
import os
import pathlib
import statistics
import sys
import time

from bench import gpu_report
from bench.gpu_train import _QUIET  # no plot, TensorBoard or checkpoints: the numbers go to the result files

LAYERS = 4
VOCAB = 8192
STEPS = 4
LEVERS = {
    "none": [],
    "full AC": ["--activation_checkpoint.mode", "full"],
    "activation offload": ["--activation_checkpoint.mode", "offload"],
    "CPU offload": ["--training.enable_cpu_offload"],
    "CPU + activation offload": ["--training.enable_cpu_offload", "--activation_checkpoint.mode", "offload"],
}


def _cut(dry: bool) -> None:
    from trainer.models.llama3.args import LLAMA3_FLAVORS

    base = LLAMA3_FLAVORS["8B"]
    if dry:
        LLAMA3_FLAVORS["8B"] = base.replace(dim=64, n_heads=4, n_kv_heads=2, multiple_of=32, n_layers=1,
                                            vocab_size=VOCAB)
    else:
        LLAMA3_FLAVORS["8B"] = base.replace(n_layers=LAYERS, vocab_size=VOCAB)


def lever_run(name: str, extra: list[str], folder: pathlib.Path, dry: bool) -> dict:
    """One trainer run of ``STEPS`` steps with ``extra`` options: memory, step time, losses."""
    import torch

    from trainer.config import parse_args
    from trainer.estimate.memory import Layout, estimate_memory
    from trainer.train import Trainer

    steps, seq = (2, 32) if dry else (STEPS, 8192)
    config = parse_args(["--flavor", "8B", "--training.steps", str(steps), "--training.seq_len", str(seq),
                         "--training.local_batch_size", "1", "--lr_scheduler.warmup_steps", "2",
                         "--metrics.log_freq", "1", *_QUIET, "--job.dump_folder", str(folder / name.replace(" ", "_")),
                         *extra])
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    row: dict = {"name": name, "options": " ".join(extra)}
    trainer = Trainer(config, world_size=1, rank=0, local_rank=0)
    try:
        trainer.setup()
        times, losses = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            losses.append(float(trainer.train_step()))  # reading the loss waits for the device
            times.append(time.perf_counter() - t0)
        row.update(rc=0, losses=losses, step_s=statistics.median(times[1:] or times),
                   peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None)
        # What the estimate (the planner's and the fit check's) says for this run, beside the measurement.
        est = estimate_memory(trainer.args, Layout(), 1, seq, compute_bytes=trainer.compute_dtype.itemsize,
                              ac_mode=config.activation_checkpoint.mode,
                              cpu_offload=config.training.enable_cpu_offload)
        row.update(estimated_peak_gib=est.total / 2**30, estimated_host_gib=est.host / 2**30,
                   estimated_pcie_gib=(est.h2d + est.d2h) / 2**30)
    except Exception as exc:  # noqa: BLE001  (an out-of-memory run is a result; the next lever goes on)
        row.update(rc=1, error=f"{type(exc).__name__}: {str(exc)[:300]}")
    finally:
        trainer.close()
        del trainer
        gc.collect()
    return row


def main(argv: list[str]) -> int:
    prefix, dry = argv[0], "--dry-run" in argv
    os.environ.setdefault("TITAN_KERNELS_AUTOTUNE", "0")
    import torch

    from bench.bench_offload import block_shapes, cpu_adamw

    result: dict = {"layers": 1 if dry else LAYERS, "vocab": VOCAB, "runs": []}
    shapes = [(256, 1024), (1024, 256), (1024,)] if dry else block_shapes()
    opt = cpu_adamw(shapes, rounds=2 if dry else 3)
    result["cpu_optimizer"] = {"host_threads": torch.get_num_threads(), "load": os.getloadavg(), **opt}
    for impl, r in opt.items():
        print(f"cpu optimizer {impl:18s} {r['s_per_billion']:.3f} s per billion params, {r['gbps']:.1f} GB/s", flush=True)
    gpu_report.update(prefix, "offload", result)
    _cut(dry)
    folder = pathlib.Path(prefix + "-offload")
    for name, extra in LEVERS.items():
        row = lever_run(name, extra, folder, dry)
        result["runs"].append(row)
        gpu_report.update(prefix, "offload", result)
        print(f"{name:26s} rc {row['rc']}  peak {row.get('peak_gib')} GiB (estimated {row.get('estimated_peak_gib')})  "
              f"step {row.get('step_s')} s  losses {row.get('losses')} {row.get('error', '')}", flush=True)
    return 1 if any(r["rc"] != 0 for r in result["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
