"""The native build: pure-Python fallback, setup.py failure handling, the standalone CMake build.

- With the extension absent, titan_kernels imports, reports why ``cpu`` is unavailable and runs
  the ops on the reference backend.
- A failing native build (a bad compiler flag) still completes ``build_ext`` with a warning and
  records the reason, which ``available_backends()`` then reports.
- CMakeLists.txt configures and compiles the standalone CUDA kernels and their ctest executable
  with the machine's nvcc (compile only: sm_80 here, as tests/test_cuda_compile.py compiles sm_90a);
  running ctest needs a GPU.

Slow (``pytest -m slow tests/test_build.py``): the standalone CMake build of the CUDA kernels (and
ctest on a GPU) and the CMake build of the torch extension (find_package(Torch)), about 2 minutes on
2 cores.
"""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(cmd, timeout=300, env=None, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


PURE_PYTHON_CHECK = textwrap.dedent("""
    import pathlib, sys
    sys.modules["titan_kernels._C"] = None  # as if the extension were not built
    import torch, torch.nn.functional as F
    import titan_kernels as tk
    from titan_kernels import _native
    error_file = sys.argv[1]
    if error_file:
        _native.BUILD_ERROR_FILE = pathlib.Path(error_file)
    st = tk.available_backends("cpu")["cpu"]
    assert not st.available, st
    print("REASON", st.reason)
    torch.manual_seed(0)
    x, w = torch.randn(3, 5, 48), torch.randn(48)
    assert torch.allclose(tk.rms_norm(x, w, 1e-6), F.rms_norm(x, (48,), w, 1e-6), rtol=1e-5, atol=1e-6)
    cos, sin = tk.rope_cos_sin(16, 8)
    q, k = torch.randn(2, 5, 4, 16), torch.randn(2, 5, 1, 16)
    qo, ko = tk.apply_rotary_emb(q, k, cos, sin)
    half = torch.cat([-q[..., 8:], q[..., :8]], -1)
    c, s = torch.cat([cos[:5], cos[:5]], -1)[:, None], torch.cat([sin[:5], sin[:5]], -1)[:, None]
    assert torch.allclose(qo, q * c + half * s, rtol=1e-5, atol=1e-5)
    print("OK")
""")


def test_pure_python_when_extension_is_absent():
    r = _run([sys.executable, "-c", PURE_PYTHON_CHECK, ""], timeout=120, env={"PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK" in r.stdout
    assert "titan_kernels._C is not available" in r.stdout


def test_failed_native_build_still_installs(tmp_path):
    # A compiler flag that does not exist makes the first compile fail.
    r = _run([sys.executable, "setup.py", "build_ext", "--build-lib", str(tmp_path / "lib"),
              "--build-temp", str(tmp_path / "tmp")], timeout=300,
             env={"CFLAGS": "-fno-such-flag-for-titan", "TITAN_KERNELS_CUDA": "0"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "failed to build; installing pure Python" in r.stderr
    pkg = tmp_path / "lib" / "titan_kernels"
    assert not list(pkg.glob("_C*.so")), "no library may be left behind"
    error_file = pkg / "_C_build_error.txt"
    assert error_file.read_text().startswith("the native extension failed to build")
    # ... and available_backends() says why.
    r = _run([sys.executable, "-c", PURE_PYTHON_CHECK, str(error_file)], timeout=120,
             env={"PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "failed to build" in r.stdout


def test_native_build_can_be_switched_off(tmp_path):
    r = _run([sys.executable, "setup.py", "build_ext", "--build-lib", str(tmp_path / "lib"),
              "--build-temp", str(tmp_path / "tmp")], timeout=120, env={"TITAN_KERNELS_NATIVE": "0"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "TITAN_KERNELS_NATIVE=0" in r.stderr
    assert not list((tmp_path / "lib").rglob("_C*"))


def test_forcing_cuda_without_cuda_torch_fails_clearly(tmp_path):
    import torch

    if torch.version.cuda is not None:
        pytest.skip(f"torch {torch.__version__} has CUDA: forcing the CUDA build is legitimate here")
    r = _run([sys.executable, "setup.py", "build_ext", "--build-lib", str(tmp_path / "lib")], timeout=120,
             env={"TITAN_KERNELS_CUDA": "1"})
    assert r.returncode != 0
    assert "TITAN_KERNELS_CUDA=1 but the CUDA kernels cannot be built" in r.stdout + r.stderr


# ------------------------------------------------------------------------------ reuse of a build in place

RECORD_KEY = textwrap.dedent("""
    # Records a stand-in library as if built in place here: the build key this setup.py computes.
    import json, os, sys, sysconfig
    sys.path.insert(0, "csrc")
    import torch, setup_native as s
    from torch.utils import cpp_extension
    ext = s._extension(cpp_extension, with_cuda=s._cuda_choice(torch, cpp_extension.CUDA_HOME)[0])
    lib = os.path.join("titan_kernels", "_C" + sysconfig.get_config_var("EXT_SUFFIX"))
    with open(lib, "wb") as f:
        f.write(b"a stand-in for the library built in place")
    with open(os.path.join("titan_kernels", s.KEY_FILE), "w") as f:
        json.dump(s.recorded_key(ext, lib), f)
""")


def test_build_in_place_is_reused_while_its_key_matches(tmp_path):
    # A copy of what the native build reads, with a stand-in library and its recorded key.
    shutil.copy(ROOT / "setup.py", tmp_path)
    shutil.copytree(ROOT / "csrc", tmp_path / "csrc", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "titan_kernels").mkdir()
    (tmp_path / "titan_kernels" / "__init__.py").write_text("")
    r = _run([sys.executable, "-c", RECORD_KEY], cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    (lib,) = (tmp_path / "titan_kernels").glob("_C.*")
    build = [sys.executable, "setup.py", "build_ext", "--inplace"]

    # Same key: the library is reused, nothing is compiled.
    r = _run(build, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "reusing the native extension built in place" in r.stderr, r.stderr
    assert "ninja" not in r.stdout and "g++" not in r.stdout
    assert lib.read_bytes() == b"a stand-in for the library built in place"

    # Any source change rebuilds (here with a flag that fails at once, so the build fails fast: the
    # library and its key are dropped, as for any failed build in place).
    with open(tmp_path / "csrc" / "cpu" / "rotary.cpp", "a") as f:
        f.write("// changed\n")
    r = _run(build, cwd=tmp_path, timeout=300, env={"CFLAGS": "-fno-such-flag-for-titan", "TITAN_KERNELS_CUDA": "0"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rebuilding the native extension (csrc_sha256, env changed" in r.stderr, r.stderr
    assert "failed to build; installing pure Python" in r.stderr
    assert not lib.exists() and not (tmp_path / "titan_kernels" / "_C_build_key.json").exists()


# ------------------------------------------------------------------------------ the one source list


def _setup_native():
    sys.path.insert(0, str(ROOT / "csrc"))
    try:
        import setup_native
    finally:
        sys.path.remove(str(ROOT / "csrc"))
    return setup_native


def test_every_native_source_is_in_the_one_list():
    src = _setup_native().read_sources()
    listed = src.cpu + [p for p, _ in src.isa.values()] + src.cuda + src.cuda_binding + src.cuda_test + src.header
    assert len(listed) == len(set(listed)), f"a source is listed twice: {sorted(listed)}"
    on_disk = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*")
                     if p.suffix in (".cpp", ".cu", ".h", ".cuh"))
    assert sorted(listed) == on_disk, "csrc/sources.txt must list every source and header under csrc/ (and no other)"
    assert src.isa and src.cuda_arch == ["sm_90a", "sm_80"]
    # Neither build names a source itself: both take them from the list.
    for build in ("CMakeLists.txt", "csrc/setup_native.py"):
        named = re.findall(r"csrc/[\w/]+\.(?:cpp|cu|h|cuh)\b", (ROOT / build).read_text())
        assert not named, f"{build} names sources of its own: {named}"


def test_cmake_reads_the_same_list_as_setup_py(tmp_path):
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed: CMake's reading of csrc/sources.txt cannot be checked")
    src = _setup_native().read_sources()
    script = tmp_path / "print_sources.cmake"
    script.write_text(textwrap.dedent(f"""
        include("{ROOT}/csrc/sources.cmake")
        titan_read_sources("{ROOT}/csrc/sources.txt")
        foreach(g cpu cuda cuda_binding cuda_test header)
          message("${{g}}=${{TITAN_SOURCES_${{g}}}}")
        endforeach()
        foreach(isa IN LISTS TITAN_CPU_ISAS)
          message("isa_${{isa}}=${{TITAN_ISA_SOURCE_${{isa}}}}|${{TITAN_ISA_FLAGS_${{isa}}}}")
        endforeach()
        message("gencode=${{TITAN_CUDA_GENCODE_DEFAULT}}")
    """))
    r = _run(["cmake", "-P", str(script)], timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    got = dict(line.split("=", 1) for line in r.stderr.splitlines() if "=" in line)

    def cmake_list(paths):
        return ";".join(str(ROOT / p) for p in paths)

    for group in ("cpu", "cuda", "cuda_binding", "cuda_test", "header"):
        assert got[group] == cmake_list(getattr(src, group)), group
    for isa, (path, flags) in src.isa.items():
        assert got[f"isa_{isa}"] == f"{ROOT / path}|{';'.join(flags)}", isa
    assert got["gencode"].split(";") == [f"-gencode={a}" for a in src.cuda_gencode[1::2]]


# ------------------------------------------------------------------------------ CMake


def _nvcc() -> str | None:
    return shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.exists(p)), None)


@pytest.fixture(scope="module")
def cmake_cuda_build(tmp_path_factory):
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed: the standalone CUDA build cannot be checked")
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found: the standalone CUDA build needs the CUDA toolkit")
    build = tmp_path_factory.mktemp("cmake-cuda")
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    r = _run(["cmake", "-S", str(ROOT), "-B", str(build), *gen, f"-DCMAKE_CUDA_COMPILER={nvcc}",
              "-DTITAN_CUDA_GENCODE=-gencode=arch=compute_80,code=sm_80"], timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    r = _run(["cmake", "--build", str(build), "-j", "2"], timeout=600)
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-5000:]
    return build


@pytest.mark.slow  # 16 s; the CUDA kernels' compile for sm_90a is in the default run (tests/test_cuda_compile.py)
def test_cmake_builds_standalone_cuda_kernels_and_test(cmake_cuda_build):
    assert (cmake_cuda_build / "libtitan_cuda_kernels.a").exists()
    assert (cmake_cuda_build / "titan_cuda_test").exists()
    # The test program itself runs on the host: without a usable device it reports a skip (77).
    r = _run([str(cmake_cuda_build / "titan_cuda_test")], timeout=60)
    assert r.returncode in (0, 77), r.stdout + r.stderr


@pytest.mark.slow
def test_ctest_on_gpu(cmake_cuda_build):
    if shutil.which("nvidia-smi") is None or _run(["nvidia-smi", "-L"], timeout=60).returncode != 0:
        pytest.skip("no CUDA device: the ctest run of the CUDA kernels needs a GPU (bench/run_gpu.sh runs it)")
    r = _run(["ctest", "--test-dir", str(cmake_cuda_build), "--output-on-failure"], timeout=300)
    print(r.stdout)
    assert r.returncode == 0 and "tests passed" in r.stdout, r.stdout + r.stderr


@pytest.mark.slow
def test_cmake_builds_torch_extension(tmp_path):
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed")
    out = tmp_path / "out"
    r = _run(["cmake", "-S", str(ROOT), "-B", str(tmp_path / "b"), "-DTITAN_BUILD_CUDA=OFF",
              "-DTITAN_BUILD_TORCH_EXTENSION=ON", f"-DTITAN_EXTENSION_OUTPUT_DIR={out}",
              f"-DPython3_EXECUTABLE={sys.executable}"], timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    r = _run(["cmake", "--build", str(tmp_path / "b"), "-j", "2"], timeout=900)
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-5000:]
    (lib,) = out.glob("_C*.so")
    check = textwrap.dedent(f"""
        import importlib.util, torch
        spec = importlib.util.spec_from_file_location("titan_kernels._C", {str(lib)!r})
        mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
        assert mod.has_cpu()
        x = torch.randn(4, 40)
        y, h, rstd = torch.ops.titan.rms_norm_fwd_native(x, None, None, 1e-6)
        assert torch.allclose(y, torch.nn.functional.rms_norm(x, (40,), eps=1e-6), atol=1e-6)
        # the autograd node (csrc/autograd_node.cpp, linked against torch_python): y = 2x, dy/dx = 2
        class Ctx:
            def save_for_backward(self, *t):
                self.to_save = t
        def forward(plan, args):
            ctx = Ctx(); ctx.save_for_backward(args[0]); return args[0] * 2, ctx
        def backward(ctx, saved, g):
            assert saved[0] is a or torch.equal(saved[0], a)
            return (g * 2,)
        a = torch.randn(3, requires_grad=True)
        mod.autograd_apply((forward, backward, "double"), None, (a,), a).sum().backward()
        assert torch.equal(a.grad, torch.full((3,), 2.0))
        print("OK", mod.cpu_capability())
    """)
    r = _run([sys.executable, "-c", check], timeout=120)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
