"""Benchmark harness shared by every bench/bench_*.py module.

Each benchmark times one implementation of one op at one shape and records a row with:
  time (median seconds), bytes the op must move and FLOPs it must do, the achieved GB/s and
  TFLOP/s, their share of the device's *measured* ceilings (copy bandwidth, dense matmul rate),
  and at the end of the session the speed ratio against the baselines timed in the same run.

Timing: on CUDA, ``triton.testing.do_bench`` (CUDA events, L2 flushed between runs, median);
on the CPU, pytest-benchmark's own timer (median of rounds). Inputs are random, never zeros.

The ceilings are measured in the benchmark's own process, the first time a share needs them, with
the load average at that moment (printed beside them: on a shared machine a ceiling taken while
other work held the cores is too low). A row above 100% of a ceiling re-measures it (the best
measurement wins); a share still above 100% is flagged in the table as a measurement error and
written as null in the JSON, never printed as a result.

The session summary (bench/conftest.py) prints the table and, when ``BENCH_OUT`` is set, writes
``$BENCH_OUT.json`` and ``$BENCH_OUT.md`` with the device, date and library versions. Missing
folders on the way are created; a ``BENCH_OUT`` that is a folder (existing, or ending in ``/``)
gets ``<date>-<device kind>.json/.md`` inside it. Results we do not mean to commit go under
``bench/results/local/`` (ignored by git, as ``bench/run_gpu.sh`` does without ``--commit-results``).
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

ROWS: list["Row"] = []
BASELINES = ("eager", "compile", "liger", "torchao", "sdpa", "_scaled_mm", "torch.mm",
             "sdpa-cudnn", "sdpa-flash", "sdpa-efficient", "sdpa-math", "fa3", "fa2",
             "loop", "_grouped_mm", "torch-fused", "torch-foreach", "torch-muon", "causal")


@dataclass
class Row:
    op: str
    shape: str
    dtype: str
    impl: str
    time_s: float
    bytes: float = 0.0
    flops: float = 0.0
    gbps: float = 0.0
    bw_share: float = 0.0
    tflops: float = 0.0
    flop_share: float = 0.0
    ratios: dict = field(default_factory=dict)


def device() -> torch.device:
    """The device benchmarks run on: CUDA when present, else the CPU (``BENCH_DEVICE`` overrides)."""
    name = os.environ.get("BENCH_DEVICE")
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def strict() -> bool:
    """Whether ``BENCH_STRICT`` asks the benchmarks to assert their speed targets (any value but empty
    or ``0``); without it they print the ratios and targets only (shared cores make timings noisy)."""
    return os.environ.get("BENCH_STRICT", "") not in ("", "0")


def target_note() -> str:
    """What a printed target means in this run."""
    return "asserted (BENCH_STRICT)" if strict() else "not asserted without BENCH_STRICT=1"


def on_cuda() -> bool:
    return device().type == "cuda"


def sync() -> None:
    if on_cuda():
        torch.cuda.synchronize()


def _cpu_median(fn: Callable[[], object], warmup: int = 3, min_time: float = 0.2, max_reps: int = 200) -> float:
    for _ in range(warmup):
        fn()
    times = []
    start = time.perf_counter()
    while len(times) < max_reps and (time.perf_counter() - start < min_time or len(times) < 5):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(fn: Callable[[], object]) -> float:
    """Median seconds per call of ``fn`` on the benchmark device."""
    if on_cuda():
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3
    return _cpu_median(fn)


def load_average() -> tuple[float, float, float] | None:
    """The machine's 1, 5 and 15 minute load averages (``os.getloadavg``); None where the OS has none."""
    try:
        return os.getloadavg()
    except (AttributeError, OSError):
        return None


def _load_str(load) -> str:
    return "n/a" if load is None else " / ".join(f"{x:.2f}" for x in load)


@dataclass
class Ceiling:
    """A measured ceiling: the best rate seen in this process (per second), the load average when it
    was measured, and how many times it was measured."""
    value: float
    load: tuple[float, float, float] | None
    samples: int = 1


CEILINGS: dict[str, Ceiling] = {}
MAX_REMEASURES = 3  # per ceiling and process: a share over 100% re-measures it at most this often


def _ceiling(key: str, measure_rate: Callable[[], float], remeasure: bool) -> float:
    """The best rate measured for ``key`` in this process; measured now when there is none yet or when
    ``remeasure`` (a ceiling taken while other work held the cores is too low; the best one wins)."""
    c = CEILINGS.get(key)
    if c is None or (remeasure and c.samples <= MAX_REMEASURES):
        rate, load = measure_rate(), load_average()
        if c is None or rate > c.value:
            CEILINGS[key] = Ceiling(rate, load, 1 if c is None else c.samples + 1)
        else:
            c.samples += 1
    return CEILINGS[key].value


def copy_bandwidth(remeasure: bool = False) -> float:
    """Measured device copy bandwidth in bytes/s (read + write bytes of a large ``copy_``), in this
    process; the best of its measurements (``remeasure`` adds one)."""
    def rate() -> float:
        dev = device()
        n = (1 << 30 if dev.type == "cuda" else 1 << 26) // 4  # 1 GiB on GPU (>> L2), 64 MiB on CPU
        src = torch.randn(n, device=dev)
        dst = torch.empty_like(src)
        t = measure(lambda: dst.copy_(src))
        return 2 * src.numel() * src.element_size() / t

    return _ceiling("copy", rate, remeasure)


def _matmul_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if device().type == "cpu" else dtype  # no bf16 units on our CPUs


def matmul_rate(dtype: torch.dtype = torch.bfloat16, remeasure: bool = False) -> float:
    """Measured dense matmul rate in FLOP/s for ``dtype`` (8192^3 on GPU; 1024^3 in float32 on CPU), in
    this process; the best of its measurements (``remeasure`` adds one)."""
    dtype = _matmul_dtype(dtype)

    def rate() -> float:
        dev = device()
        n = 8192 if dev.type == "cuda" else 1024
        a = torch.randn(n, n, device=dev, dtype=dtype)
        b = torch.randn(n, n, device=dev, dtype=dtype)
        t = measure(lambda: a @ b)
        return 2 * n**3 / t

    return _ceiling(f"matmul {str(dtype).replace('torch.', '')}", rate, remeasure)


def ceilings_line() -> str:
    """One line: each ceiling measured so far with the load average (1/5/15 min) it was measured
    under, and the load now. A share of a ceiling means little when the load exceeds the cores."""
    parts = []
    for key, c in CEILINGS.items():
        value = f"{c.value / 1e9:.1f} GB/s" if key == "copy" else f"{c.value / 1e12:.3g} TFLOP/s"
        parts.append(f"{key} {value} (load {_load_str(c.load)}, best of {c.samples})")
    return (f"ceilings measured in this process: {', '.join(parts) or 'none'}; load now "
            f"{_load_str(load_average())} on {os.cpu_count()} CPUs")


def share_cell(share: float, unit: str = "") -> str:
    """A share of a ceiling as a percentage (followed by ``unit``), blank when not measured, and a flag
    instead of a figure when it exceeds the ceiling (then the ceiling, not the op, was mismeasured)."""
    if not share:
        return ""
    return ">100% (ceiling measured under load)" if share > 1 else f"{100 * share:.0f}{unit}"


def run(
    benchmark,
    fn: Callable[[], object],
    *,
    op: str,
    impl: str,
    shape: str | tuple,
    dtype: torch.dtype | str,
    bytes_moved: float = 0.0,
    flops: float = 0.0,
    flop_dtype: torch.dtype = torch.bfloat16,
) -> Row:
    """Time ``fn`` through pytest-benchmark and record a row of the session table.

    bytes_moved: the bytes the op must read and write at minimum (the roofline numerator);
    flops: the FLOPs it must do. Either may be 0 when it does not apply.
    """

    def call():
        fn()
        sync()

    if benchmark is not None:
        benchmark.pedantic(call, warmup_rounds=2, rounds=5 if on_cuda() else 3, iterations=1)
    t = measure(fn)
    row = Row(op=op, shape=str(shape), dtype=str(dtype).replace("torch.", ""), impl=impl, time_s=t,
              bytes=float(bytes_moved), flops=float(flops))
    if bytes_moved:
        row.gbps = bytes_moved / t / 1e9
        row.bw_share = bytes_moved / t / copy_bandwidth()
        if row.bw_share > 1:  # above the ceiling: measure the ceiling again, now, and keep the best
            row.bw_share = bytes_moved / t / copy_bandwidth(remeasure=True)
    if flops:
        row.tflops = flops / t / 1e12
        row.flop_share = flops / t / matmul_rate(flop_dtype)
        if row.flop_share > 1:
            row.flop_share = flops / t / matmul_rate(flop_dtype, remeasure=True)
    if benchmark is not None:
        benchmark.extra_info.update({k: v for k, v in asdict(row).items() if k != "ratios"})
    ROWS.append(row)
    return row


def with_backend(fn: Callable, name: str | None) -> Callable:
    """``fn`` (a titan_kernels op) run under ``titan_kernels.use_backend(name)``; None: ``fn`` itself
    (the automatic choice)."""
    if name is None:
        return fn
    import titan_kernels as tk

    def f(*args, **kwargs):
        with tk.use_backend(name):
            return fn(*args, **kwargs)

    return f


def implementations(titan: Callable, eager: Callable, *, backends: tuple[str, ...] = ("triton", "cuda", "cpu"),
                    liger: Callable[[], Callable | None] | None = None, extra: dict | None = None) -> dict:
    """The implementations an elementwise bench_*.py module times, in this order: "titan" (the op,
    automatic backend), ``extra`` ({name: callable}), "eager" (the PyTorch formula), "compile"
    (torch.compile of it, dynamic=False), "titan-<name>" (the op under ``use_backend(name)``) for each
    of ``backends`` available on the device but Triton on the CPU (the interpreter is no benchmark),
    and on CUDA "liger" when ``liger()`` (None when Liger-Kernel is not installed) gives one."""
    import titan_kernels as tk

    dev = device()
    impls = {"titan": titan, **(extra or {}), "eager": eager, "compile": torch.compile(eager, dynamic=False)}
    for name in backends:
        if tk.available_backends(dev)[name].available and not (name == "triton" and dev.type == "cpu"):
            impls[f"titan-{name}"] = with_backend(titan, name)
    if dev.type == "cuda" and liger is not None and (fn := liger()) is not None:
        impls["liger"] = fn
    return impls


def with_ratios(rows: list[Row]) -> list[Row]:
    """Fill each row's ``ratios``: baseline time / this time, for baselines in the same group."""
    groups: dict[tuple, list[Row]] = {}
    for r in rows:
        groups.setdefault((r.op, r.shape, r.dtype), []).append(r)
    for group in groups.values():
        base = {r.impl: r.time_s for r in group if r.impl in BASELINES}
        for r in group:
            r.ratios = {b: t / r.time_s for b, t in base.items() if b != r.impl}
    return rows


def _cpu_name() -> str:
    """The CPU model and the vector ISA ATen uses on it (e.g. 'AMD EPYC (AVX512)')."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), name)
    except OSError:
        pass
    return f"{name} ({torch.backends.cpu.get_cpu_capability()})"


def environment() -> dict:
    """Device, date and versions recorded with every result file."""
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if on_cuda() else _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if os.environ.get("BENCH_SKIP_CEILINGS") != "1":
        info["copy_bandwidth_GBps"] = copy_bandwidth() / 1e9
        info["matmul_TFLOPs"] = matmul_rate() / 1e12
    info["ceilings"] = {k: {"value": c.value, "load_average": c.load, "samples": c.samples} for k, c in CEILINGS.items()}
    info["load_average"] = load_average()
    return info


def row_json(r: Row) -> dict:
    """A row for the JSON file; a share over 100% of a ceiling is no result: it is null there, and
    ``measurement_error`` says which share and by how much it exceeded the ceiling."""
    d = asdict(r)
    over = {k: d[k] for k in ("bw_share", "flop_share") if d[k] > 1}
    if over:
        d.update(dict.fromkeys(over))
        d["measurement_error"] = ", ".join(f"{k} {v:.2f} > 1: ceiling measured under load" for k, v in over.items())
    return d


def table(rows: list[Row]) -> str:
    """Markdown table of the rows (ratios > 1 mean this impl is faster than that baseline); a share over
    100% of a ceiling is flagged, not printed (``share_cell``)."""
    head = "| op | shape | dtype | impl | time (us) | GB/s | % copy BW | TFLOP/s | % matmul | speedup vs baselines |"
    lines = [head, "|" + "---|" * 10]
    for r in with_ratios(rows):
        ratios = ", ".join(f"{k} {v:.2f}x" for k, v in sorted(r.ratios.items()))
        lines.append(
            f"| {r.op} | {r.shape} | {r.dtype} | {r.impl} | {r.time_s * 1e6:.1f} | "
            f"{r.gbps:.1f} | {share_cell(r.bw_share)} | {r.tflops:.1f} | {share_cell(r.flop_share)} | {ratios} |"
        )
    return "\n".join(lines)


def output_prefix(out: str) -> str:
    """The file prefix for ``BENCH_OUT``: itself, or ``<folder>/<date>-<cpu|gpu>`` for a folder; its
    parent folders are created (a missing folder must not lose a finished benchmark run)."""
    if out.endswith(os.sep) or os.path.isdir(out):
        kind = "gpu" if on_cuda() else "cpu"
        out = os.path.join(out, f"{datetime.date.today().isoformat()}-{kind}")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    return out


def save(prefix: str, rows: list[Row]) -> str:
    """Write ``prefix.json`` and ``prefix.md`` with the environment and the rows; returns the prefix
    used (``output_prefix``: folders created, a folder gets a dated file name)."""
    prefix = output_prefix(prefix)
    env = environment()
    with open(prefix + ".json", "w") as f:
        json.dump({"environment": env, "rows": [row_json(r) for r in with_ratios(rows)]}, f, indent=1)
    with open(prefix + ".md", "w") as f:
        f.write("# Benchmark results\n\n")
        f.write("\n".join(f"- {k}: {v}" for k, v in env.items()) + "\n\n")
        f.write(ceilings_line() + "\n\n")
        f.write(table(rows) + "\n")
    return prefix
