"""``bash bench/run_gpu.sh --dry-run`` walks every stage of the GPU run on the CPU, so that a typo, a
wrong argument or a package the GPU machine lacks fails here, not in the GPU's 15 minutes.

The dry run runs each stage's real entry point with the real arguments at toy sizes: the trainer
(debug model through ``python -m trainer``, and the cut 8B flavor eager, compiled with aot_eager, and
float8), the correctness table on the CPU backends (Triton in the interpreter), the headline
benchmark groups (one call per timing) plus the check that their GPU parameter lists hold the
headline shapes, and the native stage's build commands (without compiling) and test collection. The
packages missing on the GPU machine are unimportable there (bench/dry_run_site). It takes about a
minute on 2 idle cores.

Checked here: every stage exits 0 within its (dry) budget, the result files hold every stage's
section, and the printed budgets of the default plan add up to at most 8 minutes. Without
``--dry-run`` and without a CUDA device the script stops at once in one line; its results go to the
untracked bench/results/local/ unless ``--commit-results``.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "run_gpu.sh"
LIMIT_S = 8 * 60


def _run(*args, timeout=900, **env):
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHON": sys.executable, **env})


def _budgets(text: str) -> dict[str, int]:
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^\s+([a-z][\w-]*)\s+(\d+) s$", text, re.M)
            if m.group(1) != "total"}


def test_plan_fits_eight_minutes():
    r = _run("--plan")
    assert r.returncode == 0, r.stderr
    budgets = _budgets(r.stdout)
    assert list(budgets) == ["environment", "train", "correctness", "headline", "offload", "native"], r.stdout
    assert sum(budgets.values()) <= LIMIT_S, budgets
    full = _run("--full", "--plan")
    assert full.returncode == 0 and "layouts" in _budgets(full.stdout), full.stdout


def test_unknown_option_is_refused():
    r = _run("--fulll")
    assert r.returncode == 2 and "unknown option --fulll" in r.stderr


def test_without_cuda_it_stops_at_once(tmp_path):
    # A CPU machine (or no device visible): one line and a non-zero code before any stage, and no
    # result file, instead of five failed stages and a results file without a GPU name.
    out = tmp_path / "results"
    r = _run(str(out), timeout=120, CUDA_VISIBLE_DEVICES="")
    assert r.returncode == 3, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == "" and len(r.stderr.splitlines()) == 1, r.stderr
    assert "no CUDA device visible" in r.stderr and "is_available() False" in r.stderr and "--dry-run" in r.stderr
    assert not out.exists()


def test_results_stay_untracked_unless_asked():
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert "bench/results/local/" in ignored
    r = _run("--plan")
    assert r.returncode == 0 and "results: bench/results/local/<date>-<gpu>.{json,md,log}" in r.stdout, r.stdout
    r = _run("--plan", "--commit-results")
    assert r.returncode == 0 and "results: bench/results/<date>-<gpu>.{json,md,log}" in r.stdout, r.stdout
    r = _run("--plan", "/elsewhere")
    assert "results: /elsewhere/<date>-<gpu>" in r.stdout, r.stdout
    r = _run("--help")
    assert r.returncode == 0 and "--commit-results" in r.stdout and r.stdout.startswith("# The one script"), r.stdout
    assert "set -uo" not in r.stdout


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run_gpu_dry")
    r = _run("--dry-run", str(out))
    prefix = next(out.glob("*-cpu-dry-run.json"), None)
    return r, out, json.loads(prefix.read_text()) if prefix else {}


def test_dry_run_walks_every_stage(dry_run):
    r, out, result = dry_run
    tail = (r.stdout + r.stderr)[-6000:]
    assert r.returncode == 0, tail
    stages = result["stages"]
    assert list(stages) == ["environment", "train", "correctness", "headline", "offload", "native"], stages
    for name, st in stages.items():
        assert st["rc"] == 0 and st["status"] == "ok", (name, st, tail)
    printed = _budgets(r.stdout.split("=== environment")[0])
    assert printed == result["plan"]["budgets"] and sum(printed.values()) <= LIMIT_S, printed
    for suffix in (".json", ".md", ".log"):
        assert next(out.glob(f"*-cpu-dry-run{suffix}")).stat().st_size > 0


def test_dry_run_sections_hold_results(dry_run):
    _, _, result = dry_run
    env = result["environment"]
    assert env["copy_bandwidth_GBps"] > 0 and env["matmul_TFLOPs"] > 0
    runs = {r["name"]: r for r in result["train"]["runs"]}
    assert set(runs) == {"debugmodel", "8B-4L eager", "8B-4L compile", "8B-4L float8", "flux-dev 6 blocks"}
    for run in runs.values():
        assert run["rc"] == 0 and run["tokens_per_s"] > 0 and len(run["losses"]) >= 2, run
    rows = result["correctness"]["rows"]
    assert rows and all(r["ok"] for r in rows)
    assert {"rms_norm", "add_rms_norm", "rotary", "fp8_quantize", "fp8_gemm", "fp8_linear",
            "flash_attn"} <= {r["op"] for r in rows}
    head = result["headline"]
    ops = {row["op"].split(".")[0] for row in head["rows"]}
    assert {"rms_norm", "rotary", "attention", "fp8_gemm", "float8_linear"} <= ops, ops
    assert any(r["op"] == "rms_norm.compiled fwd+bwd" and "triton_op" in r["impl"] for r in head["rows"])
    assert not any("FAILED" in n for n in head["notes"]), head["notes"]
    off = result["offload"]
    assert {r["name"] for r in off["runs"]} == {"none", "full AC", "activation offload", "CPU offload",
                                                 "CPU + activation offload"}
    assert all(r["rc"] == 0 and len(r["losses"]) == 2 for r in off["runs"]), off["runs"]
    assert len({tuple(r["losses"]) for r in off["runs"]}) == 1  # every lever gives the same losses
    assert off["cpu_optimizer"]["titan"]["s_per_billion"] > 0 and "torch-fused" in off["cpu_optimizer"]
    native = result["native"]
    assert native["pytest"]["rc"] == 0 and set(native["builds"].values()) == {"ok"}, native
