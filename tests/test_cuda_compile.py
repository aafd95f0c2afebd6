"""Compile-only check of the CUDA kernels with this machine's nvcc (no GPU needed).

csrc/cuda/*.cu (raw pointers + cudaStream_t, no torch headers) are compiled with
``nvcc -gencode arch=compute_90a,code=sm_90a -Xptxas -v``; the ptxas report (registers, stack,
spills of every kernel) is printed, and the test fails on any register spill in the hot kernels:
the 16-byte-pack RMSNorm forward/backward kernels, the dweight reduction and the vectorized rotary
kernel. The one-element-per-pack fallbacks (unaligned rows) are reported; a spill there is shown but
tolerated. This catches syntax errors, ptxas errors and spills that a
CPU-only CI would otherwise never see. The torch binding (csrc/cuda/binding.cpp) is syntax-checked
against the installed torch's headers with the host compiler.

sm_80 is compiled by the CMake build test (tests/test_build.py). Skips, with the reason, only when
nvcc is absent.
"""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
from dataclasses import dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CUDA_DIR = ROOT / "csrc" / "cuda"
NVCC = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.exists(p)), None)

pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found: the CUDA compile check needs the CUDA toolkit")

# Mangled names: rms_norm_{fwd,bwd}_kernel<T, VEC, TPR>, dw_reduce_kernel<W>,
# rotary_vec_kernel<T, VEC, INTERLEAVED>, rotary_scalar_kernel<T>.
RMS_KERNEL = re.compile(r"rms_norm_(?:fwd|bwd)_kernelI\w+?Li(\d+)ELi(\d+)E")


@dataclass
class KernelReport:
    name: str
    registers: int = 0
    stack: int = 0
    spill_stores: int = 0
    spill_loads: int = 0

    @property
    def hot(self) -> bool:
        m = RMS_KERNEL.search(self.name)
        if m:
            return int(m.group(1)) > 1  # 16-byte packs; VEC == 1 is the unaligned fallback
        return "rotary_vec_kernel" in self.name or "dw_reduce_kernel" in self.name


def parse_ptxas(text: str) -> list[KernelReport]:
    """Kernels of a ``-Xptxas -v`` report, with their registers, stack and spills."""
    out: list[KernelReport] = []
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            out.append(KernelReport(m.group(1)))
            continue
        if not out:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            out[-1].stack, out[-1].spill_stores, out[-1].spill_loads = map(int, m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m:
            out[-1].registers = int(m.group(1))
    return out


def _demangle(names: list[str]) -> dict[str, str]:
    """Readable kernel names (one c++filt call; the mangled names when it is absent)."""
    out = dict(zip(names, names))
    if shutil.which("c++filt"):
        r = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
        if r.returncode == 0 and len(r.stdout.splitlines()) == len(names):
            out = dict(zip(names, r.stdout.splitlines()))
    return {k: re.sub(r"titan::cuda::\(anonymous namespace\)::|\(.*\)$", "", v) for k, v in out.items()}


@pytest.fixture(scope="module")
def ptxas(tmp_path_factory) -> tuple[str, list[KernelReport]]:
    out = tmp_path_factory.mktemp("nvcc")
    procs = []
    for src in ("rms_norm.cu", "rotary.cu"):
        cmd = [NVCC, "-std=c++17", "-O3", "-gencode", "arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
               "-c", str(CUDA_DIR / src), "-o", str(out / (src + ".o"))]
        procs.append((src, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    text = ""
    for src, p in procs:
        log, _ = p.communicate(timeout=600)
        assert p.returncode == 0, f"nvcc failed on {src}:\n{log[-8000:]}"
        text += log
    return text, parse_ptxas(text)


def test_kernels_compile_for_sm90a_and_report(ptxas, capsys):
    _, kernels = ptxas
    names = " ".join(k.name for k in kernels)
    for expected in ("rms_norm_fwd_kernel", "rms_norm_bwd_kernel", "dw_reduce_kernel", "rotary_vec_kernel",
                     "rotary_scalar_kernel"):
        assert expected in names, f"{expected} missing from the ptxas report"
    short = _demangle([k.name for k in kernels])
    with capsys.disabled():
        print(f"\nptxas -v, sm_90a ({len(kernels)} kernels): registers, stack bytes, spill stores/loads")
        for k in sorted(kernels, key=lambda k: short[k.name]):
            flag = "" if not (k.spill_stores or k.spill_loads) else ("  SPILL (hot)" if k.hot else "  spill (fallback)")
            print(f"  {short[k.name]:64s} regs {k.registers:3d}  stack {k.stack:4d}  "
                  f"spill {k.spill_stores}/{k.spill_loads}{flag}")


def test_no_spills_in_hot_kernels(ptxas):
    _, kernels = ptxas
    hot = [k for k in kernels if k.hot]
    assert len(hot) >= 30, "the 16-byte-pack kernels were not all found"
    short = _demangle([k.name for k in hot])
    spilling = [f"{short[k.name]}: {k.spill_stores} B stores, {k.spill_loads} B loads, {k.registers} regs"
                for k in hot if k.spill_stores or k.spill_loads]
    assert not spilling, "register spills in hot kernels:\n" + "\n".join(spilling)


def test_binding_compiles_against_torch_headers(tmp_path):
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if cxx is None:
        pytest.skip("no host C++ compiler found")
    import torch
    from torch.utils.cpp_extension import include_paths

    cuda_include = pathlib.Path(NVCC).resolve().parent.parent / "include"
    if not (cuda_include / "cuda_runtime_api.h").exists():
        cuda_include = pathlib.Path("/usr/local/cuda/include")
    # A CPU build of torch ships c10/cuda headers but not the CMake-generated macros header.
    shim = tmp_path / "c10" / "cuda" / "impl"
    shim.mkdir(parents=True)
    (shim / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    cmd = [cxx, "-std=c++20", "-fsyntax-only", "-Wall", "-Wno-unknown-pragmas", f"-I{tmp_path}",
           *(f"-I{p}" for p in include_paths()), f"-I{cuda_include}", str(CUDA_DIR / "binding.cpp")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"torch {torch.__version__}: {r.stderr[-6000:]}"
