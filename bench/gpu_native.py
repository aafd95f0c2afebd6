"""Stage 5 of bench/run_gpu.sh: the native CUDA extension build and its tests (last: the slowest to build).

    python -m bench.gpu_native start PREFIX [--dry-run]    at the start of stage 3: the builds, in the background
    python -m bench.gpu_native finish PREFIX [--dry-run]   stage 5: wait for them, install, test, record
    python -m bench.gpu_native stop                        end the builds if still running (run_gpu.sh on exit)

The builds are CPU work (nvcc, the host compiler), so they start in the background, niced, when the
trainer stage is over, and overlap the correctness and benchmark stages, which keep the GPU busy but
need little CPU; their results are read in stage 5, as the issue orders:

  torch extension   ``TITAN_KERNELS_CUDA=1 python setup.py build_ext --build-lib build/gpu-native/lib``:
                    the CPU kernels and the CUDA kernels (sm_90a + sm_80) with the torch binding, built
                    outside the source tree so that the stages running meanwhile keep one set of
                    backends; ``finish`` copies ``_C*.so`` into titan_kernels/.
  standalone CUDA   ``cmake -S . -B build/cmake-cuda`` (sm_90a only) and ``cmake --build``: csrc/cuda/*.cu
                    without torch and the ctest executable.

``finish`` waits for both until its deadline (the stage budget less the time the tests need), then
runs on the GPU: the native op tests and the op suites' ``cuda``-backend cases (pytest
tests/kernels/test_native.py, test_rms_norm.py, test_rotary.py ``-k cuda``, TITAN_TEST_DEVICE=cuda)
and ``ctest``. Writes the ``native`` section of PREFIX.json. ``--dry-run`` (the CPU): the build
commands are checked without compiling (``setup.py --name`` imports the build code; ``cmake
--version``) and pytest only collects the test files.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
WORK = pathlib.Path(os.environ.get("BENCH_NATIVE_WORK", REPO / "build" / "gpu-native"))  # logs, pids, build output
BUILD_SECONDS = 420  # each background build's own limit
TEST_RESERVE = 28  # seconds stage 5 keeps for the tests after waiting for the builds
PYTEST_TARGETS = ["tests/kernels/test_native.py", "tests/kernels/test_rms_norm.py", "tests/kernels/test_rotary.py"]


def _jobs(dry: bool) -> dict[str, list[str]]:
    py = sys.executable
    if dry:
        return {"extension": [py, "setup.py", "--name"],
                "cmake": ["cmake", "--version"] if shutil.which("cmake") else [py, "-c", "print('cmake not installed')"]}
    ext = [py, "setup.py", "build_ext", "--build-lib", str(WORK / "lib"), "--build-temp", str(WORK / "tmp")]
    generator = "-G Ninja " if shutil.which("ninja") else ""
    cmake = ["bash", "-c",
             f"cmake -S . -B build/cmake-cuda {generator}"
             "-DTITAN_CUDA_GENCODE=-gencode=arch=compute_90a,code=sm_90a && cmake --build build/cmake-cuda -j 4"]
    if not shutil.which("cmake"):
        cmake = [py, "-c", "import sys; print('cmake not installed'); sys.exit(3)"]
    return {"extension": ext, "cmake": cmake}


def start(dry: bool) -> int:
    WORK.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TITAN_KERNELS_CUDA=os.environ.get("TITAN_KERNELS_CUDA", "1"),
               MAX_JOBS=os.environ.get("MAX_JOBS", "8"))
    for name, cmd in _jobs(dry).items():
        for suffix in (".rc", ".log", ".pid"):
            (WORK / f"{name}{suffix}").unlink(missing_ok=True)
        # nice: the stages running meanwhile time GPU work from the host; `timeout`: a hung build ends.
        wrapped = ["bash", "-c", 'nice -n 10 timeout --kill-after=10 "$0" "$@"; echo $? > "$RC_FILE"',
                   str(BUILD_SECONDS), *cmd]
        log = open(WORK / f"{name}.log", "w")
        proc = subprocess.Popen(wrapped, cwd=REPO, env=dict(env, RC_FILE=str(WORK / f"{name}.rc")), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        (WORK / f"{name}.pid").write_text(str(proc.pid))
        print(f"native: {name} build started in the background (pid {proc.pid}): {' '.join(cmd)}", flush=True)
    return 0


def stop() -> int:
    for pid_file in WORK.glob("*.pid"):
        try:
            os.killpg(int(pid_file.read_text()), signal.SIGKILL)
            print(f"native: ended the unfinished {pid_file.stem} build", flush=True)
        except (ProcessLookupError, ValueError, PermissionError):
            pass
        pid_file.unlink(missing_ok=True)
    return 0


def _wait(deadline: float) -> dict[str, int | None]:
    rcs: dict[str, int | None] = {}
    names = list(_jobs(False))
    while True:
        for name in names:
            f = WORK / f"{name}.rc"
            if f.is_file() and f.read_text().strip():
                rcs[name] = int(f.read_text().strip())
        if len(rcs) == len(names) or time.time() > deadline:
            break
        time.sleep(1.0)
    return {name: rcs.get(name) for name in names}


def _tail(path: pathlib.Path, n: int = 20) -> list[str]:
    if not path.is_file():
        return []
    return [line[:300] for line in path.read_text(errors="replace").splitlines()[-n:]]


_running: list = []


def _on_term(*_):
    # The stage's `timeout` ends this process: end the test run too (its own session) and the builds.
    for proc in _running:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    stop()
    sys.exit(143)


def _run(cmd: list[str], timeout: float, env: dict) -> tuple[int | str, list[str]]:
    print(f"native: {' '.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    _running.append(proc)
    try:
        out, _ = proc.communicate(timeout=max(timeout, 1))
        rc: int | str = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        rc = "timeout"
    lines = out.splitlines()
    print("\n".join(f"    {line}" for line in lines[-25:]), flush=True)
    return rc, [line[:300] for line in lines[-40:]]


def finish(prefix: str, dry: bool) -> int:
    from bench import gpu_report

    t0 = time.time()
    budget = float(os.environ.get("BENCH_STAGE_BUDGET", "60"))
    rcs = _wait(t0 + max(budget - TEST_RESERVE, 5))
    stop()
    result: dict = {"builds": {}}
    for name, rc in rcs.items():
        status = "did not finish in time" if rc is None else ("ok" if rc == 0 else f"failed (rc {rc})")
        result["builds"][name] = status
        print(f"native: {name} build {status}", flush=True)
        if rc != 0:
            result[f"{name} build log (tail)"] = _tail(WORK / f"{name}.log")
    env = dict(os.environ, TITAN_TEST_DEVICE="cpu" if dry else "cuda")
    left = lambda: t0 + budget - 4 - time.time()  # noqa: E731
    if not dry and rcs["extension"] == 0:
        built = sorted((WORK / "lib" / "titan_kernels").glob("_C*.so"))
        for so in built:
            shutil.copy2(so, REPO / "titan_kernels" / so.name)
        (REPO / "titan_kernels" / "_C_build_error.txt").unlink(missing_ok=True)
        result["installed"] = [so.name for so in built]
    pytest_cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:timeout", *PYTEST_TARGETS]
    pytest_cmd += ["--collect-only"] if dry else ["-k", "cuda or native", "-x"]
    if dry or rcs["extension"] == 0:
        rc, tail = _run(pytest_cmd, left() - (8 if not dry else 0), env)
        result["pytest"] = {"command": " ".join(pytest_cmd[1:]), "rc": rc, "tail": tail[-12:]}
    else:
        result["pytest"] = "not run: the extension was not built"
    ctest = ["ctest", "--test-dir", "build/cmake-cuda", "--output-on-failure"]
    if dry:
        result["ctest"] = "not run in the dry run (" + ("ctest found" if shutil.which("ctest") else "ctest not installed") + ")"
    elif rcs["cmake"] == 0:
        rc, tail = _run(ctest, left(), env)
        result["ctest"] = {"rc": rc, "tail": tail[-12:]}
    else:
        result["ctest"] = "not run: the standalone CUDA build did not succeed"
    gpu_report.update(prefix, "native", result)
    ok = all(rc == 0 for rc in rcs.values()) and isinstance(result["pytest"], dict) and result["pytest"]["rc"] == 0
    if not dry:
        ok = ok and isinstance(result["ctest"], dict) and result["ctest"]["rc"] == 0
    return 0 if ok else 1


def main(argv: list[str]) -> int:
    cmd = argv[0]
    dry = "--dry-run" in argv
    if cmd == "start":
        return start(dry)
    if cmd == "stop":
        return stop()
    if cmd == "finish":
        signal.signal(signal.SIGTERM, _on_term)
        return finish(argv[1], dry)
    raise SystemExit(f"gpu_native: unknown command {cmd!r} (start, finish, stop)")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
