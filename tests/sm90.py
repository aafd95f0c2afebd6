"""What the sm_90a compile tests share: Triton's bundled ptxas, the skip where this Triton cannot
compile for NVIDIA, and the run of a test module's ``main`` in a subprocess (the test session sets
``TRITON_INTERPRET=1``, under which ``@triton.jit`` functions cannot be compiled)."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def ptxas() -> str | None:
    """Triton's bundled ptxas (ptxas-blackwell first, where the build ships one), or None."""
    import triton

    bindir = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    return next((str(bindir / n) for n in ("ptxas-blackwell", "ptxas") if (bindir / n).exists()), None)


def require_nvidia_backend() -> None:
    import triton

    if not (pathlib.Path(triton.__file__).parent / "backends" / "nvidia").is_dir():
        pytest.skip("this Triton build has no NVIDIA backend to compile for sm_90a")
    if ptxas() is None:
        pytest.skip("this Triton build ships no ptxas")


def run_compile_module(module: str, all_configs: bool, timeout: int, stderr_tail: int):
    """``python -m module [--all]`` with the interpreter off; its last stdout line, parsed as JSON."""
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", module] + (["--all"] if all_configs else [])
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-stderr_tail:]
    return json.loads(r.stdout.strip().splitlines()[-1])
