"""Stage 1 of bench/run_gpu.sh: the device, driver and versions, and the measured ceilings.

    python -m bench.gpu_env PREFIX [--dry-run]

Writes the ``environment`` section of ``PREFIX.json`` (see bench/gpu_report.py): GPU name, SM count,
memory, compute capability, driver, torch / CUDA / Triton / Python / numpy versions, and the two
ceilings every later share is taken of, measured here: device copy bandwidth (read + write bytes of a
1 GiB ``copy_``) and the dense bf16 matmul rate (8192^3), both from bench/common.py; plus the float8
``torch._scaled_mm`` rate at 8192^3 (tensorwise, bf16 out) when the device has it. ``--dry-run``: the
CPU, with bench/common.py's small CPU sizes. The load average each ceiling was measured under is
printed beside it (``ceilings``).
"""
from __future__ import annotations

import platform
import shutil
import subprocess
import sys


def _nvidia_smi() -> dict:
    if shutil.which("nvidia-smi") is None:
        return {"nvidia_smi": "not found"}
    q = "name,driver_version,memory.total,clocks.max.sm,power.limit"
    r = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True, text=True,
                       timeout=30)
    if r.returncode != 0:
        return {"nvidia_smi": f"failed: {r.stderr.strip()[:200]}"}
    return {"nvidia_smi": r.stdout.strip().splitlines()}


def _scaled_mm_rate(common) -> float | None:
    import torch

    from titan_kernels.ops import fp8 as ops_fp8

    dev = common.device()
    if dev.type != "cuda" or not ops_fp8.scaled_mm_available(dev):
        return None
    n = 8192
    a = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
    one = torch.ones((), device=dev)
    t = common.measure(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16))
    return 2 * n**3 / t


def environment(dry_run: bool) -> dict:
    import numpy
    import torch

    from bench import common

    info: dict = {}
    dev = common.device()
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        info.update(device=props.name, sm_count=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2**30, 1),
                    capability=".".join(map(str, torch.cuda.get_device_capability(dev))))
        info.update(_nvidia_smi())
    else:
        info["device"] = common._cpu_name() + (" (dry run)" if dry_run else "")
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    info.update(torch=torch.__version__, cuda=torch.version.cuda, python=platform.python_version(),
                numpy=numpy.__version__)
    nvcc = shutil.which("nvcc")
    if nvcc:
        r = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30)
        info["nvcc"] = (r.stdout.strip().splitlines() or ["?"])[-1]
    info["copy_bandwidth_GBps"] = common.copy_bandwidth() / 1e9
    info["matmul_TFLOPs"] = common.matmul_rate() / 1e12
    info["ceilings"] = common.ceilings_line()  # with the load average each was measured under
    fp8 = _scaled_mm_rate(common)
    if fp8 is not None:
        info["fp8_scaled_mm_TFLOPs"] = fp8 / 1e12
    return info


def main(argv: list[str]) -> int:
    prefix = argv[0]
    dry_run = "--dry-run" in argv
    from bench import gpu_report

    info = environment(dry_run)
    gpu_report.update(prefix, "environment", info)
    for k, v in info.items():
        print(f"  {k}: {v:.4g}" if isinstance(v, float) else f"  {k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
