"""Peak memory of live tensors while the trainer runs, on the CPU: the measurement the memory model
(``trainer.estimate.memory``) is checked against (tests/trainer/test_plan.py).

    python -m tests.trainer.memory_probe OUT.json [trainer arguments]
    python -m tests.trainer.memory_probe --table [CASE ...]

The first runs ``trainer.train.main`` in this process (one rank; under a launcher that sets RANK,
WORLD_SIZE, MASTER_ADDR/PORT, one rank of many) and writes ``{"rank": r, "peak_bytes": n}`` to
OUT.json. The second measures every layout of ``CASES`` (debugmodel, fp32 on the CPU, seq 128,
2 steps; ``measure`` starts one such process per rank) and prints measured and estimated peaks.

``PeakTracker`` is a TorchDispatchMode: every storage an op creates is counted from its creation to
its release (a weak reference's callback), and FSDP2's in-place storage resizes change its count.
A DTensor (a wrapper) counts as its local shard. The peak is the largest sum of live bytes: what the allocator must hold at once, without its
fragmentation or caching (which the estimate leaves to headroom). Parameters and optimizer state
are counted because they are created while the mode is on (the model is materialized inside
``main``).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten


class PeakTracker(TorchDispatchMode):
    """Live and peak bytes of the (non-meta) tensor storages created while the mode is active."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._orig_resize = None

    def _add(self, st: torch.UntypedStorage) -> None:
        key = id(st)
        if key in self._sizes:
            return
        n = st.nbytes()
        self._sizes[key] = n
        self.live += n
        self.peak = max(self.peak, self.live)

        def released(_ref, key=key):
            self.live -= self._sizes.pop(key, 0)
            self._refs.pop(key, None)

        self._refs[key] = weakref.ref(st, released)

    def _resized(self, st: torch.UntypedStorage, n: int) -> None:
        key = id(st)
        if key in self._sizes:
            self.live += n - self._sizes[key]
            self._sizes[key] = n
            self.peak = max(self.peak, self.live)

    def __enter__(self):
        orig = torch.UntypedStorage.resize_
        tracker = self

        def resize_(st, n):
            out = orig(st, n)
            tracker._resized(st, n)
            return out

        self._orig_resize = orig
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        return super().__exit__(*exc)

    def _add_tensor(self, t: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(t):  # DTensor and the like: count the tensors inside
            for name in t.__tensor_flatten__()[0]:
                inner = getattr(t, name)
                if isinstance(inner, torch.Tensor):
                    self._add_tensor(inner)
        elif t.device.type != "meta":
            self._add(t.untyped_storage())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add_tensor(t)
        return out


SEQ_LEN = 128
COMMON = ["--training.seq_len", str(SEQ_LEN), "--training.steps", "2", "--metrics.log_freq", "1",
          "--metrics.enable_color", "false"]
REPO = Path(__file__).resolve().parents[2]
B4 = ["--training.local_batch_size", "4"]
# name: (ranks, trainer arguments, estimate_memory arguments)
CASES = {
    "1 process": (1, B4, dict(layout=(1, 1, 1, 1, 1))),
    "1 process, full AC": (1, [*B4, "--activation_checkpoint.mode", "full"], dict(layout=(1, 1, 1, 1, 1), ac_mode="full")),
    "1 process, selective op AC": (1, [*B4, "--activation_checkpoint.mode", "selective",
                                       "--activation_checkpoint.selective_ac_option", "op"],
                                   dict(layout=(1, 1, 1, 1, 1), ac_mode="selective", selective_ac_option="op")),
    "FSDP 2": (2, B4, dict(layout=(1, 2, 1, 1, 1))),
    "FSDP 2, 2 accumulation steps": (2, [*B4, "--training.global_batch_size", "16"],
                                     dict(layout=(1, 2, 1, 1, 1), grad_accum=2)),
    "TP 2": (2, [*B4, "--parallelism.tensor_parallel_degree", "2"], dict(layout=(1, 1, 2, 1, 1))),
    "PP 2, 1F1B, 4 micro-batches": (2, [*B4, "--parallelism.pipeline_parallel_degree", "2"],
                                    dict(layout=(1, 1, 1, 2, 1), pp_schedule="1F1B")),
    "PP 2, Interleaved1F1B": (2, [*B4, "--parallelism.pipeline_parallel_degree", "2",
                                  "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"],
                              dict(layout=(1, 1, 1, 2, 1), pp_schedule="Interleaved1F1B")),
    "CP 2": (2, [*B4, "--parallelism.context_parallel_degree", "2"], dict(layout=(1, 1, 1, 1, 2))),
    # multi-head latent attention, a MoE with a shared expert, one MTP module (on the last stage)
    "DeepSeek-V3 debugmodel, 1 process": (1, [*B4, "--model.name", "deepseek_v3", "--flavor", "debugmodel"],
                                          dict(layout=(1, 1, 1, 1, 1), family="deepseek_v3")),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(world: int, argv: list[str], folder: str | Path | None = None, timeout: float = 600) -> int:
    """The largest per-rank peak (bytes) of the trainer run ``COMMON + argv`` on ``world`` CPU processes."""
    folder = Path(folder or tempfile.mkdtemp(prefix="memory-probe-"))
    folder.mkdir(parents=True, exist_ok=True)
    port = str(_free_port())
    procs = []
    for r in range(world):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
        env.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        if world > 1:
            env.update(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tests.trainer.memory_probe", str(folder / f"peak-{r}.json"), *COMMON,
             "--job.dump_folder", str(folder / "run"), *argv],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    errors = [p.communicate(timeout=timeout)[1] for p in procs]
    peaks = []
    for r, p in enumerate(procs):
        out = folder / f"peak-{r}.json"
        if p.returncode != 0 or not out.is_file():
            raise RuntimeError(f"rank {r} of {argv} failed (exit {p.returncode}):\n{errors[r][-3000:]}")
        peaks.append(json.loads(out.read_text())["peak_bytes"])
    return max(peaks)


def estimate(case: str) -> "object":
    """The memory model's MemoryEstimate for ``CASES[case]`` (fp32 compute, the CPU's loss chunk)."""
    from trainer.estimate.memory import Layout, estimate_memory
    from tests.trainer.helpers import llama_model_args as model_args

    from trainer.registry import model_args as family_args

    world, argv, kw = CASES[case]
    kw = dict(kw)
    layout = Layout(*kw.pop("layout"))
    family = kw.pop("family", None)
    args = family_args(family, "debugmodel", 258, SEQ_LEN) if family else model_args("debugmodel", 258, SEQ_LEN)
    return estimate_memory(args, layout, 4, SEQ_LEN, compute_bytes=4, master_bytes=4, loss_chunk_bytes=4 << 20, **kw)


def table(cases: list[str]) -> list[tuple[str, float, float]]:
    """``(case, measured bytes, estimated bytes)`` for each case, printed as they come."""
    rows = []
    print(f"{'layout (debugmodel, fp32, batch 4 x 128)':<42} {'measured MiB':>13} {'estimated MiB':>14} {'error':>7}")
    for case in cases:
        world, argv, _ = CASES[case]
        got, est = measure(world, argv), estimate(case).total
        rows.append((case, got, est))
        print(f"{case:<42} {got / 2**20:>13.2f} {est / 2**20:>14.2f} {100 * (est / got - 1):>+6.1f}%", flush=True)
    return rows


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--table":
        rows = table(argv[1:] or list(CASES))
        worst = max(abs(e / m - 1) for _, m, e in rows)
        print(f"largest error {100 * worst:.1f}%")
        return 0

    from trainer import train
    from trainer.config import parse_args

    out, rest = argv[0], argv[1:]
    torch.set_num_threads(1)
    config = parse_args(rest)
    with PeakTracker() as tracker:
        rc = train.main(config)
    rank = int(os.environ.get("RANK", "0"))
    with open(out, "w", encoding="utf-8") as fh:
        json.dump({"rank": rank, "rc": rc, "peak_bytes": tracker.peak}, fh)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
