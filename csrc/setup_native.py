"""How setup.py builds the optional native extension ``titan_kernels._C`` from csrc/.

- C++ CPU kernels (csrc/cpu/): always tried when torch is importable at build time. Install with
  ``pip install --no-build-isolation -e .`` so the build uses the installed torch (an isolated
  build env would fetch another torch). The vectorized kernels are compiled once per x86 ISA
  (default, AVX2, AVX512) with their own flags; the extension picks one at run time.
- CUDA kernels (csrc/cuda/, sm_90a and sm_80): built when torch has CUDA and nvcc is found.

The sources, their per-ISA flags and the CUDA targets come from ``csrc/sources.txt``, the list
CMakeLists.txt reads too (``read_sources``).

A build in place (``pip install -e``, ``python setup.py build_ext --inplace``) records its build key
next to the library (``_C_build_key.json``): torch's version and CUDA flavour, Python's extension
suffix, the compile flags and build environment variables, a hash of every file under csrc/ and of
the library itself. The next build whose key is the same reuses that library instead of compiling
(and says so); any difference rebuilds, as does ``python setup.py build_ext --inplace --force``.

Environment variables:
  TITAN_KERNELS_NATIVE=0     build no extension (pure-Python install).
  TITAN_KERNELS_CUDA=0 / 1   never / always build the CUDA kernels. With 1, a CUDA build that
                             cannot be done or fails stops the install with the error.
  MAX_JOBS                   parallel compile jobs (ninja), as for any torch extension.

When the optional build fails, the install goes on in pure Python: a warning is printed and the
reason is written next to where ``_C`` would be (``_C_build_error.txt``), from where
``titan_kernels.available_backends()`` reports it.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import traceback
import warnings
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES_FILE = os.path.join(ROOT, "csrc", "sources.txt")
EXT_NAME = "titan_kernels._C"
ERROR_FILE = "_C_build_error.txt"
KEY_FILE = "_C_build_key.json"
# Environment variables that change what the compilers and the linker produce.
BUILD_ENV = ("CC", "CXX", "CFLAGS", "CXXFLAGS", "CPPFLAGS", "LDFLAGS", "LDSHARED", "CUDA_HOME",
             "NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS", "TORCH_CUDA_ARCH_LIST")


@dataclass
class Sources:
    """csrc/sources.txt: paths relative to the repository root, in file order (see its header)."""

    cpu: list[str] = field(default_factory=list)
    isa: dict[str, tuple[str, list[str]]] = field(default_factory=dict)  # isa -> (source, its flags)
    cuda: list[str] = field(default_factory=list)
    cuda_binding: list[str] = field(default_factory=list)
    cuda_test: list[str] = field(default_factory=list)
    cuda_arch: list[str] = field(default_factory=list)  # e.g. "sm_90a"
    header: list[str] = field(default_factory=list)

    @property
    def cuda_gencode(self) -> list[str]:
        """nvcc flags for the cuda_arch targets (compute_90a allows the sm_90a-only instructions)."""
        return [f for a in self.cuda_arch for f in ("-gencode", f"arch=compute_{a[3:]},code={a}")]


def read_sources(path: str = SOURCES_FILE) -> Sources:
    """The native build's one list (csrc/sources.cmake reads it for CMake). ValueError on a bad line."""
    out = Sources()
    with open(path) as f:
        for n, line in enumerate(f, 1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            if len(fields) < 2:
                raise ValueError(f"{path}:{n}: expected '<group> <path> [flags...]', got {line.strip()!r}")
            group, value, flags = fields[0], fields[1], fields[2:]
            if group.startswith("cpu_"):
                out.isa[group[4:]] = (value, flags)
            elif group in ("cpu", "cuda", "cuda_binding", "cuda_test", "cuda_arch", "header") and not flags:
                getattr(out, group).append(value)
            else:
                raise ValueError(f"{path}:{n}: unknown group {group!r} or flags on a {group!r} line: {line.strip()!r}")
    return out


def _warn(msg: str) -> None:
    # pip shows setup output only with -v or on failure; stderr + warnings make it visible in logs.
    warnings.warn(msg, stacklevel=2)
    print(f"WARNING: {msg}", file=sys.stderr)


def _x86_gnu() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and not sys.platform.startswith("win")


def _cuda_choice(torch, cuda_home: str | None) -> tuple[bool, bool, str]:
    """(build_cuda, forced, why_not) from TITAN_KERNELS_CUDA, torch's CUDA and nvcc."""
    env = os.environ.get("TITAN_KERNELS_CUDA", "").strip()
    if env not in ("", "0", "1"):
        raise SystemExit(f"TITAN_KERNELS_CUDA: expected 0 or 1, got {env!r}")
    if env == "0":
        return False, False, "TITAN_KERNELS_CUDA=0"
    why = ""
    if torch.version.cuda is None:
        why = f"torch {torch.__version__} is a CPU-only build"
    elif cuda_home is None or shutil.which(os.path.join(cuda_home, "bin", "nvcc")) is None:
        why = "nvcc was not found (set CUDA_HOME)"
    if env == "1" and why:
        raise SystemExit(f"TITAN_KERNELS_CUDA=1 but the CUDA kernels cannot be built: {why}")
    return not why, env == "1", why


def _file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _tree_sha256(paths: list[str]) -> str:
    """One hash of the files' paths (from the repository root) and contents."""
    h = hashlib.sha256()
    for path in paths:
        h.update(f"{os.path.relpath(path, ROOT)}\0{_file_sha256(path)}\0".encode())
    return h.hexdigest()


def _build_key(ext, cpp_ext) -> dict:
    """What the library depends on: torch, Python, flags, environment and every file under csrc/
    (sources, headers, the list and this file; not the prose). JSON-shaped, to compare with the record."""
    import torch

    csrc = os.path.join(ROOT, "csrc")
    files = sorted(os.path.join(d, f) for d, dirs, names in os.walk(csrc) for f in names
                   if not f.endswith((".md", ".pyc")) and "__pycache__" not in d)
    key = {
        "torch": torch.__version__, "torch_git": torch.version.git_version, "torch_cuda": torch.version.cuda,
        "python": sysconfig.get_config_var("EXT_SUFFIX"), "with_cuda": ext.titan_with_cuda,
        "compile_args": ext.extra_compile_args, "isa_sources": ext.titan_isa_sources,
        "macros": ext.define_macros, "link_args": ext.extra_link_args,
        "env": {k: os.environ[k] for k in BUILD_ENV if k in os.environ}, "csrc_sha256": _tree_sha256(files),
    }
    if ext.titan_with_cuda:
        nvcc = os.path.join(cpp_ext.CUDA_HOME, "bin", "nvcc")
        key["nvcc"] = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip()
    return json.loads(json.dumps(key))


def recorded_key(ext, library: str) -> dict:
    """The record of a build in place: the extension's build key and the library's hash."""
    return {**ext.titan_key, "library_sha256": _file_sha256(library)}


def _extension(cpp_ext, with_cuda: bool):
    cxx = ["-O3", "-Wno-unknown-pragmas"]  # ATen's vec headers carry CUDA-style `#pragma unroll`
    link = []
    if sys.platform.startswith("linux"):
        # at::parallel_for is OpenMP code inlined from ATen's headers: without -fopenmp it runs serially.
        # The resulting libgomp.so.1 dependency binds to the copy torch has already loaded.
        cxx.append("-fopenmp")
        link.append("-fopenmp")
    src = read_sources()
    macros = []
    isa_sources = []
    if _x86_gnu():
        for isa, (path, flags) in src.isa.items():
            macros.append((f"TITAN_CPU_{isa.upper()}", None))
            isa_sources.append((path, flags))
    kwargs = dict(define_macros=macros, extra_link_args=link, depends=list(src.header))
    if with_cuda:
        macros.append(("TITAN_WITH_CUDA", None))
        nvcc = ["-O3", "-lineinfo", *src.cuda_gencode]
        ext = cpp_ext.CUDAExtension(EXT_NAME, src.cpu + src.cuda + src.cuda_binding,
                                    extra_compile_args={"cxx": cxx, "nvcc": nvcc}, **kwargs)
    else:
        ext = cpp_ext.CppExtension(EXT_NAME, src.cpu, extra_compile_args={"cxx": cxx}, **kwargs)
    ext.titan_isa_sources = isa_sources
    ext.titan_with_cuda = with_cuda
    ext.optional = True  # after a failed build in place, setuptools then copies nothing into the tree
    ext.titan_key = _build_key(ext, cpp_ext)  # before BuildExtension adds its own (torch-determined) flags
    return ext


def native_build() -> dict:
    """setup() keyword arguments that build titan_kernels._C, or {} for a pure-Python install."""
    if os.environ.get("TITAN_KERNELS_NATIVE", "").strip() == "0":
        print("titan_kernels: TITAN_KERNELS_NATIVE=0, building no native extension", file=sys.stderr)
        return {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as e:
        _warn(f"titan_kernels: torch is not importable at build time ({e}); installing without the native "
              "extension. Install torch first and use `pip install --no-build-isolation`.")
        return {}

    build_cuda, forced_cuda, why_no_cuda = _cuda_choice(torch, cpp_extension.CUDA_HOME)
    if not build_cuda:
        print(f"titan_kernels: building the CPU kernels only ({why_no_cuda})", file=sys.stderr)

    class BuildNative(cpp_extension.BuildExtension):
        """BuildExtension plus per-ISA objects, a CPU-only retry and a pure-Python fallback."""

        def build_extensions(self):
            # Failures before any extension is compiled (compiler checks, flag setup) are optional too.
            try:
                super().build_extensions()
            except Exception as e:  # noqa: BLE001
                if forced_cuda:
                    raise
                reason = f"{type(e).__name__}: {e}"
                _warn(f"titan_kernels: the native extension failed to build; installing pure Python ({reason})")
                for ext in self.extensions:
                    self._fail(ext, f"the native extension failed to build: {reason}\n\n{traceback.format_exc()}")

        def finalize_options(self):
            self.titan_force = bool(self.force)  # --force; BuildExtension sets force for ninja's own checks
            super().finalize_options()

        def run(self):
            # setuptools clears `inplace` while building (it builds elsewhere, then copies into the
            # source tree): remember whether the library is bound for the source tree.
            self.titan_in_source = bool(self.inplace or getattr(self, "editable_mode", False))
            super().run()

        def _package_dirs(self, ext) -> list[str]:
            # Where the extension lands, plus the source package in an editable or in-place build.
            dirs = [os.path.dirname(self.get_ext_fullpath(ext.name))]
            if getattr(self, "titan_in_source", False):
                dirs.append(os.path.join(ROOT, *ext.name.split(".")[:-1]))
            return list(dict.fromkeys(os.path.abspath(d) for d in dirs))

        def _source_package(self, ext) -> str:
            return os.path.join(ROOT, *ext.name.split(".")[:-1])

        def _reuse(self, ext) -> bool:
            """Copy the library built in place when its recorded key is this build's; False: build it."""
            pkg = self._source_package(ext)
            lib = os.path.join(pkg, os.path.basename(self.get_ext_fullpath(ext.name)))
            if self.titan_force or not os.path.exists(lib):
                return False
            try:
                with open(os.path.join(pkg, KEY_FILE)) as f:
                    recorded = json.load(f)
            except (OSError, ValueError):
                return False
            key = recorded_key(ext, lib)
            changed = sorted(k for k in key.keys() | recorded.keys() if key.get(k) != recorded.get(k))
            if changed:
                print(f"titan_kernels: rebuilding the native extension ({', '.join(changed)} changed since "
                      "the build in place)", file=sys.stderr)
                return False
            target = self.get_ext_fullpath(ext.name)
            if os.path.abspath(target) != os.path.abspath(lib):
                os.makedirs(os.path.dirname(target), exist_ok=True)
                shutil.copy2(lib, target)
            flavour = f"CUDA {key['torch_cuda']}" if key["with_cuda"] else "CPU"
            print(f"titan_kernels: reusing the native extension built in place ({os.path.relpath(lib, ROOT)}): "
                  f"its build key matches (torch {key['torch']}, {flavour} kernels, the same csrc/ sources and "
                  "flags); `python setup.py build_ext --inplace --force` rebuilds it", file=sys.stderr)
            return True

        def _record_key(self, ext) -> None:
            # Only a build that lands in the source tree is there to be reused.
            if not getattr(self, "titan_in_source", False):
                return
            key = recorded_key(ext, self.get_ext_fullpath(ext.name))
            self._record(os.path.join(self._source_package(ext), KEY_FILE), json.dumps(key, indent=1))

        def build_extension(self, ext):
            if self._reuse(ext):
                self._built(ext)
                return
            try:
                self._build(ext)
            except Exception as e:  # noqa: BLE001  (compiler, linker, ninja: any failure is optional)
                if getattr(ext, "titan_with_cuda", False) and forced_cuda:
                    raise
                reason = f"{type(e).__name__}: {e}"
                if getattr(ext, "titan_with_cuda", False):
                    _warn(f"titan_kernels: the CUDA build failed ({reason}); retrying with the CPU kernels only")
                    cpu_ext = _extension(cpp_extension, with_cuda=False)
                    try:
                        self._prepare(cpu_ext)
                        self._build(cpu_ext)
                        self._record_key(cpu_ext)
                        for d in self._package_dirs(ext):
                            self._record(os.path.join(d, ERROR_FILE), f"CUDA kernels not built: {reason}")
                        return
                    except Exception as e2:  # noqa: BLE001
                        reason = f"{type(e2).__name__}: {e2}"
                _warn(f"titan_kernels: the native extension failed to build; installing pure Python ({reason})")
                self._fail(ext, f"the native extension failed to build: {reason}\n\n{traceback.format_exc()}")
                return
            self._record_key(ext)
            self._built(ext)

        def _built(self, ext) -> None:
            for d in self._package_dirs(ext):
                if os.path.exists(os.path.join(d, ERROR_FILE)):
                    os.remove(os.path.join(d, ERROR_FILE))

        def _build(self, ext):
            cxx = list(ext.extra_compile_args["cxx"] if isinstance(ext.extra_compile_args, dict)
                       else ext.extra_compile_args)
            objects = []
            for src, flags in getattr(ext, "titan_isa_sources", []):
                objects += self.compiler.compile([src], output_dir=self.build_temp, macros=ext.define_macros,
                                                 include_dirs=ext.include_dirs, debug=self.debug,
                                                 extra_postargs=cxx + flags, depends=ext.depends)
            ext.extra_objects = list(ext.extra_objects or []) + objects
            super().build_extension(ext)

        def _prepare(self, ext):
            # What BuildExtension.build_extensions does to each extension before compiling it.
            for key in ("cxx", "nvcc", "sycl"):
                ext.extra_compile_args.setdefault(key, [])
            self._add_compile_flag(ext, "-DTORCH_API_INCLUDE_EXTENSION_H")
            self._define_torch_extension_name(ext)

        @staticmethod
        def _record(path: str, text: str) -> None:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)

        def _fail(self, ext, text: str) -> None:
            # Drop a library left by an earlier build, so what is installed matches the message.
            lib_name = os.path.basename(self.get_ext_fullpath(ext.name))
            for d in self._package_dirs(ext):
                for name in (lib_name, KEY_FILE):
                    if os.path.exists(os.path.join(d, name)):
                        os.remove(os.path.join(d, name))
                self._record(os.path.join(d, ERROR_FILE), text)

    ext = _extension(cpp_extension, with_cuda=build_cuda)
    return {"ext_modules": [ext], "cmdclass": {"build_ext": BuildNative.with_options(use_ninja=True)}}
