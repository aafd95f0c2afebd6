"""Every Triton kernel compiles for Hopper (sm_90a) without a GPU: registers, shared memory, spills.

Triton's NVIDIA backend and the ptxas in the Triton wheel lower a kernel to a cubin for a target
with no device present. This catches what the interpreter cannot: constructs only the compiled path
rejects, tensor-core (wgmma) and TMA use, shared memory over the 227 KiB per block of H100/H200 and
register spills. What it does not show: speed, and results on the device (the interpreter tests
cover the semantics; bench/run_gpu.sh runs them on the GPU).

How: ``KERNELS`` is one table, a row per launcher call at a shape (CPU tensors). In a subprocess with
``TRITON_INTERPRET=0`` (the test session runs the interpreter) and a stand-in driver that names
sm_90 as the current target, every launch the row makes is captured instead of run, then compiled
with Triton's own ``warmup`` (the JIT's compile without launch) at:
  * the default config: what runs without autotuning (the launcher's heuristic tile, or the first
    config of an autotuned kernel, which is its default by our convention);
  * with ``--all`` (``pytest -m slow``): every config of each autotuned kernel.
``ptxas -v --gpu-name sm_90a`` on the PTX reports registers and spills; Triton reports the shared
memory. The test fails on spills or shared memory over the limit in the hot configurations (a row's
default configs at Llama shapes), and on a Triton kernel of ``titan_kernels/triton/`` that no row
compiles. Non-default autotuning configs are reported only: autotuning times them and skips those
that do not fit.

Adding a kernel (later issues): one ``Row`` in ``KERNELS`` whose ``drive`` calls the new launcher; a
module not in the tree yet is skipped with that reason.

Run by hand: ``TRITON_INTERPRET=0 python -m tests.test_sm90_compile [--all] [--only NAME_PART] [--md FILE]``
(``--md`` writes the report table, e.g. bench/results/<date>-sm90a-compile.md).
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Callable

import pytest

from tests import sm90

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMEM_LIMIT = 232448  # bytes of shared memory per block on H100/H200 (227 KiB)
MAX_REGISTERS = 255


@dataclass(frozen=True)
class Row:
    """One launcher call at one shape. ``drive(module)`` calls it on CPU tensors."""

    name: str
    module: str
    drive: Callable
    hot: bool = True  # spills / shared memory over the limit fail the test at the default configs
    needs: dict = field(default_factory=dict)  # kernel name -> PTX features it must use: "wgmma", "tma"
    all_only: bool = False  # compiled only with --all (slow)


# ----------------------------------------------------------------------------- the rows' launcher calls


def _t(*shape, dtype="bfloat16"):
    import torch

    return torch.randn(*shape).to(getattr(torch, dtype))


def _rms_norm(n, residual=False, backward=False):
    def drive(T):
        import torch

        x, w = _t(64, n), _t(n)
        if not backward:
            T.rms_norm_fwd(x, _t(64, n) if residual else None, w, 1e-6)
        else:
            T.rms_norm_bwd(_t(64, n), x, w, torch.ones(64), _t(64, n) if residual else None, True)

    return drive


def _rotary(n_heads, n_kv_heads, interleaved=False, backward=False):
    def drive(T):
        import torch

        q, k = _t(1, 256, n_heads, 128), _t(1, 256, n_kv_heads, 128)
        cos, sin = torch.rand(256, 64), torch.rand(256, 64)
        (T.rotary_bwd if backward else T.rotary_fwd)(q, k, cos, sin, None, interleaved)

    return drive


def _fp8_quantize(granularity):
    def drive(T):
        import torch

        T.fp8_quantize(_t(4096, 4096), torch.float8_e4m3fn, granularity, False)

    return drive


def _fp8_gemm(m, n, k, use_tma):
    def drive(T):
        import torch

        a = torch.randn(m, k).to(torch.float8_e4m3fn)
        b = torch.randn(n, k).to(torch.float8_e4m3fn)
        T.fp8_gemm(a, b, torch.ones(()), torch.ones(()), torch.bfloat16, None, False, use_tma=use_tma)

    return drive


def _attention(head_dim, varlen, part, variant="causal", head_dim_v=None):
    def drive(T):
        import torch

        from titan_kernels.attention_mask import AttentionArgs

        b, s, h, hkv = 2, 256, 8, 2
        dv = head_dim_v or head_dim
        q = _t(b, s, h, head_dim)
        k, v = _t(b, s, hkv, head_dim), _t(b, s, hkv, dv)
        cu = torch.tensor([0, 100, 256], dtype=torch.int32) if varlen else None
        if varlen:
            q, k, v = q[0], k[0], v[0]
        lse = torch.empty(h, s) if varlen else torch.empty(b, h, s)
        out = torch.empty((*q.shape[:-1], dv), dtype=q.dtype)
        dims = T._dims(q, k, cu, 156, 156)
        # causal, or GPT-OSS's sliding window (128) with soft-capping
        a = AttentionArgs(0.1, 127 if variant == "window" else -1, 0, 30.0 if variant == "window" else 0.0,
                          max_q=156, max_k=156)
        if part == "fwd":
            T._launch_fwd_portable(q, k, v, out, lse, cu, cu, dims, a)
        elif part == "sm90":  # chosen on sm_90 devices only (sm90_eligible), so launched directly
            T._launch_fwd_sm90(q, k, v, out, lse, cu, cu, dims, a)
        else:
            T.attention_bwd(out, q, k, v, out, lse, None, cu, cu, a)

    return drive


def _cross_entropy(out_dtype):
    def drive(T):
        import torch

        z, tgt = torch.randn(64, 128256), torch.randint(0, 128256, (64,))  # Llama 3 vocabulary
        T.softmax_stats(z, tgt)
        T.softmax_grad_(z, torch.rand(64), tgt, torch.ones(64), getattr(torch, out_dtype))

    return drive


def _swiglu(backward=False, n=14336, scalars=()):
    def drive(T):
        g, u = _t(64, n), _t(64, n)
        T.swiglu_bwd(_t(64, n), g, u, *scalars) if backward else T.swiglu_fwd(g, u, *scalars)

    return drive


def _moe_permute(combine=False, weighted=False):
    def drive(T):
        import torch

        tokens, top_k, d = 256, 8, 4096
        if combine:
            dst = torch.randint(0, tokens * top_k, (tokens, top_k))
            T.combine_rows(_t(tokens * top_k, d), dst, torch.rand(tokens, top_k) if weighted else None)
        else:
            src = torch.randint(-1, tokens * top_k, (tokens * top_k + 64,))
            w = torch.rand(tokens, top_k) if weighted else None
            T.permute_rows(_t(tokens, d), src, top_k, w, _t(tokens * top_k + 64, d) if weighted else None)

    return drive


def _grouped_mm(backward=False, use_tma=True, dtype="bfloat16"):
    def drive(T):
        import torch

        # Qwen3-30B-A3B expert shapes (dim 2048, expert hidden 768), 8 of its 128 experts, uneven groups.
        e, k, n = 8, 2048, 768
        x, w = _t(1024, k, dtype=dtype), _t(e, k, n, dtype=dtype)
        offsets = torch.tensor([0, 100, 300, 301, 600, 700, 1000, 1000], dtype=torch.int32)
        if backward:
            T.grouped_mm_bwd(_t(1024, n, dtype=dtype), x, w, offsets, True, True, use_tma=use_tma)
        else:
            T.grouped_mm_fwd(x, w, offsets, use_tma=use_tma)

    return drive


def _fp8_grouped_mm(backward=False):
    def drive(T):
        import torch

        # The Qwen3-30B-A3B expert shapes of _grouped_mm, bf16 in: quantizers, the float8 GEMMs (dgrad reads
        # the dgrad codes transposed) and the weight gradient on token-major codes.
        e, k, n = 8, 2048, 768
        x, w = _t(1024, k), _t(e, k, n)
        offsets = torch.tensor([0, 100, 300, 301, 600, 700, 1000, 1000], dtype=torch.int32)
        if not backward:
            (xq, sx), (wq, sw) = T.rows(x), T.w_fwd(w)
            T.gmm(xq, sx, wq, sw, offsets, torch.bfloat16)
        else:
            dy = _t(1024, n)
            (dq, sd), (wq, sw) = T.rows(dy), T.w_dgrad(w)
            T.gmm(dq, sd, wq.transpose(1, 2), sw, offsets, torch.bfloat16)
            (xc, sxc), (dc, sdc) = T.group_cols(x, offsets), T.group_cols(dy, offsets)
            T.gmm_dw(xc, sxc, dc, sdc, offsets, torch.bfloat16)

    return drive


def _fused_adamw(param: str, state: str):
    def drive(T):
        import torch

        shape = (1024, 4096)
        T.fused_adamw_([_t(*shape, dtype=param)], [torch.randn(shape)], [_t(*shape, dtype=state)],
                       [_t(*shape, dtype=state)], 1e-4, 0.9, 0.95, 1e-8, 0.1, 3, [7], [0])

    return drive


def _newton_schulz(dtype: str):
    def drive(T):
        import torch

        T.newton_schulz(_t(1024, 3584), 1, 3.4445, -4.7750, 2.0315, 1e-7, getattr(torch, dtype))

    return drive


_TC = {"wgmma"}
KERNELS: list[Row] = [
    # RMSNorm: Llama hidden sizes one pass (hot); 32k columns take the two-pass loop (reported).
    *[Row(f"rms_norm.{p} N{n}{' +res' if r else ''}", "titan_kernels.triton.rms_norm", _rms_norm(n, r, p == "bwd"))
      for p in ("fwd", "bwd") for n in (4096, 8192) for r in (False, True)],
    Row("rms_norm.fwd N32768 two-pass", "titan_kernels.triton.rms_norm", _rms_norm(32768), hot=False),
    Row("rms_norm.bwd N32768 two-pass", "titan_kernels.triton.rms_norm", _rms_norm(32768, backward=True), hot=False),
    # Rotary: Llama 3 8B (32/8 heads) and 70B (64/8), head_dim 128.
    Row("rotary.fwd h32/8 d128", "titan_kernels.triton.rotary", _rotary(32, 8)),
    Row("rotary.bwd h32/8 d128", "titan_kernels.triton.rotary", _rotary(32, 8, backward=True)),
    Row("rotary.fwd h32/8 d128 interleaved", "titan_kernels.triton.rotary", _rotary(32, 8, interleaved=True)),
    Row("rotary.fwd h64/8 d128", "titan_kernels.triton.rotary", _rotary(64, 8)),
    # Float8 quantization at a Llama activation shape.
    *[Row(f"fp8_quantize.{g} 4096x4096", "titan_kernels.triton.fp8_quantize", _fp8_quantize(g))
      for g in ("tensorwise", "rowwise", "colwise")],
    # Float8 GEMM: autotuned (>= 4 GFLOP) TMA and pointer kernels, and the fixed tile of small GEMMs.
    Row("fp8_gemm.tma 2048x1024x1024", "titan_kernels.triton.fp8_gemm", _fp8_gemm(2048, 1024, 1024, True),
        needs={"_fp8_gemm_tma_kernel": {"wgmma", "tma"}}),
    Row("fp8_gemm.pointer 2048x1024x1024", "titan_kernels.triton.fp8_gemm", _fp8_gemm(2048, 1024, 1024, False),
        needs={"_fp8_gemm_kernel": _TC}),
    Row("fp8_gemm.tma 256x256x256 fixed", "titan_kernels.triton.fp8_gemm", _fp8_gemm(256, 256, 256, True),
        needs={"_fp8_gemm_tma_kernel": {"wgmma", "tma"}}),
    Row("fp8_gemm.pointer 256x256x256 fixed", "titan_kernels.triton.fp8_gemm", _fp8_gemm(256, 256, 256, False),
        needs={"_fp8_gemm_kernel": _TC}),
    # FlashAttention, causal, GQA 8:2, head_dim 128 and 64, dense and varlen. Only with --all: the default
    # run of tests/kernels/test_attention_sm90.py already compiles the head_dim 128 defaults (~20 s).
    *[Row(f"flash_attn.{p} d{d}{' varlen' if vl else ''}", "titan_kernels.triton.flash_attn", _attention(d, vl, p),
          hot=d == 128, needs={"_fwd_kernel": _TC, "_fwd_kernel_sm90": {"wgmma", "tma"}, "_bwd_dkdv_kernel": _TC,
                               "_bwd_dq_kernel": _TC},
          all_only=True)
      for d in (128, 64) for vl in (False, True) for p in ("fwd", "sm90", "bwd")],
    # The same with a sliding window and soft-capping, and DeepSeek-V3's q/k 192 with v 128 (head_dim
    # 192 in 256-wide tiles; the Hopper kernel takes powers of two only).
    *[Row(f"flash_attn.{p} d{d} window+softcap", "titan_kernels.triton.flash_attn", _attention(d, False, p, "window"),
          hot=False, needs={"_fwd_kernel": _TC, "_fwd_kernel_sm90": {"wgmma", "tma"}, "_bwd_dkdv_kernel": _TC,
                            "_bwd_dq_kernel": _TC}, all_only=True)
      for d in (128, 64) for p in ("fwd", "sm90", "bwd")],
    *[Row(f"flash_attn.{p} d192/128", "titan_kernels.triton.flash_attn", _attention(192, False, p, head_dim_v=128),
          hot=False, needs={"_fwd_kernel": _TC, "_bwd_dkdv_kernel": _TC, "_bwd_dq_kernel": _TC}, all_only=True)
      for p in ("fwd", "bwd")],
    # SwiGLU at the Llama 3 8B FFN width.
    Row("swiglu.fwd 14336", "titan_kernels.triton.swiglu", _swiglu()),
    Row("swiglu.bwd 14336", "titan_kernels.triton.swiglu", _swiglu(backward=True)),
    # GPT-OSS's clamped variant (CLAMPED=True) at its expert width 2880.
    Row("swiglu.fwd clamped 2880", "titan_kernels.triton.swiglu", _swiglu(n=2880, scalars=(1.702, 7.0, 1.0))),
    Row("swiglu.bwd clamped 2880", "titan_kernels.triton.swiglu",
        _swiglu(backward=True, n=2880, scalars=(1.702, 7.0, 1.0))),
    # Linear cross-entropy's two passes over a chunk of logits at the Llama 3 vocabulary (bf16 and fp32 g).
    Row("cross_entropy.stats+grad V128256 bf16", "titan_kernels.triton.cross_entropy", _cross_entropy("bfloat16")),
    Row("cross_entropy.stats+grad V128256 fp32", "titan_kernels.triton.cross_entropy", _cross_entropy("float32")),
    # MoE token permute / combine, top-8 at dim 4096 (weighted: the scores' forward and gradient).
    *[Row(f"moe_permute.{kind}{' weighted' if w else ''} d4096", "titan_kernels.triton.moe_permute",
          _moe_permute(combine=kind == "combine", weighted=w)) for kind in ("permute", "combine") for w in (False, True)],
    # MoE grouped GEMM at Qwen3-30B-A3B expert shapes: the persistent TMA kernel (forward; dx reads w^T),
    # the pointer kernel, the dw kernel and the tail-zeroing kernel; bf16 on tensor cores (wgmma), fp32 IEEE.
    Row("grouped_mm.fwd tma 2048x768 bf16", "titan_kernels.triton.grouped_mm", _grouped_mm(),
        needs={"_gmm_tma_kernel": {"wgmma", "tma"}}),
    Row("grouped_mm.bwd tma 2048x768 bf16", "titan_kernels.triton.grouped_mm", _grouped_mm(backward=True),
        needs={"_gmm_tma_kernel": {"wgmma", "tma"}, "_gmm_dw_kernel": _TC}),
    Row("grouped_mm.fwd pointer 2048x768 bf16", "titan_kernels.triton.grouped_mm", _grouped_mm(use_tma=False),
        needs={"_gmm_kernel": _TC}),
    Row("grouped_mm.bwd pointer 2048x768 bf16", "titan_kernels.triton.grouped_mm",
        _grouped_mm(backward=True, use_tma=False), needs={"_gmm_kernel": _TC, "_gmm_dw_kernel": _TC}),
    Row("grouped_mm.bwd pointer 2048x768 fp32", "titan_kernels.triton.grouped_mm",
        _grouped_mm(backward=True, use_tma=False, dtype="float32")),  # IEEE fp32 products: no wgmma
    # Its float8 rowwise variant: per-(group, column) quantizer, float8 GEMMs on wgmma with the scales in the epilogue.
    Row("fp8_grouped_mm.fwd 2048x768", "titan_kernels.triton.fp8_grouped_mm", _fp8_grouped_mm(),
        needs={"_fp8_gmm_kernel": _TC}),
    Row("fp8_grouped_mm.bwd 2048x768", "titan_kernels.triton.fp8_grouped_mm", _fp8_grouped_mm(backward=True),
        needs={"_fp8_gmm_kernel": _TC, "_fp8_gmm_dw_kernel": _TC}),
    # AdamW over a tensor list (one launch): float32, bf16 states (one hash), everything bf16 (two hashes).
    *[Row(f"fused_adamw p{p} s{s_}", "titan_kernels.triton.fused_adamw", _fused_adamw(p, s_))
      for p, s_ in (("float32", "float32"), ("float32", "bfloat16"), ("bfloat16", "bfloat16"))],
    # Newton-Schulz: the symmetric X X^T / A A products and the a X + B X GEMM, bf16 on the tensor cores.
    Row("newton_schulz bf16 1024x3584", "titan_kernels.triton.newton_schulz", _newton_schulz("bfloat16"),
        needs={"_sym_kernel": _TC, "_mm_kernel": _TC}),
    Row("newton_schulz fp32 1024x3584", "titan_kernels.triton.newton_schulz", _newton_schulz("float32")),
]


# ----------------------------------------------------------------------------- capture and compile (subprocess)


class Sm90Target:
    """The stand-in for Triton's CUDA driver: what the JIT asks of it to compile (not to launch)."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def is_active(self):
        return True


@dataclass
class Launch:
    fn: object  # the JITFunction
    args: tuple
    kwargs: dict
    configs: list | None  # an autotuned launch: the autotuner's configs


def _capture(row: Row) -> list[Launch]:
    """The kernel launches ``row.drive`` makes, none of them run."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    launches: list[Launch] = []
    jit_run, tuner_run = JITFunction.run, Autotuner.run

    def run_jit(self, *args, grid, warmup, **kwargs):
        if warmup:
            return jit_run(self, *args, grid=grid, warmup=warmup, **kwargs)
        launches.append(Launch(self, args, kwargs, None))
        return None

    def run_tuner(self, *args, **kwargs):
        kwargs.pop("grid", None)
        kwargs.pop("warmup", None)
        launches.append(Launch(self.fn, args, kwargs, list(self.configs)))

    JITFunction.run, Autotuner.run = run_jit, run_tuner
    try:
        row.drive(importlib.import_module(row.module))
    finally:
        JITFunction.run, Autotuner.run = jit_run, tuner_run
    return launches


def _ptxas_report(ptx: str) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        pathlib.Path(src).write_text(ptx)
        r = subprocess.run([sm90.ptxas(), "-v", "--gpu-name", "sm_90a", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"ptxas failed: {r.stderr[-2000:]}")
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", r.stderr)]
    return {"registers": int(regs.group(1)) if regs else 0, "spill_stores": spills[0] if spills else 0,
            "spill_loads": spills[1] if len(spills) > 1 else 0}


def _config_label(kwargs: dict, fn) -> str:
    # The tile and launch options; the other constexprs (flags) are in the kernel's row name.
    keys = [k for k in kwargs if k.startswith("BLOCK") or k in ("GROUP_M", "WARP_SPECIALIZE", "ONE_PASS")]
    parts = [f"{k}={int(kwargs[k]) if isinstance(kwargs[k], bool) else kwargs[k]}" for k in keys]
    parts.append(f"w{kwargs.get('num_warps', 4)} s{kwargs.get('num_stages', 3)}")
    return " ".join(parts)


def _compile(launch: Launch, config) -> dict:
    kwargs = dict(launch.kwargs)
    if config is not None:
        kwargs.update(config.all_kwargs())
        if config.pre_hook is not None:  # e.g. TMA descriptors take the config's block shape
            config.pre_hook({**dict(zip(launch.fn.arg_names, launch.args)), **kwargs})
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    compiled = launch.fn.warmup(*launch.args, grid=(1,), **kwargs)
    ptx = compiled.asm["ptx"]
    return {"config": _config_label(kwargs, launch.fn), "smem": compiled.metadata.shared,
            "wgmma": "wgmma" in ptx, "tma": "cp.async.bulk.tensor" in ptx, **_ptxas_report(ptx)}


def compile_row(row: Row, all_configs: bool) -> list[dict]:
    """Compile every kernel launch of ``row`` (default config, or every autotuning config)."""
    out, seen = [], set()
    for launch in _capture(row):
        configs = [None] if launch.configs is None else (launch.configs if all_configs else launch.configs[:1])
        for i, cfg in enumerate(configs):
            report = _compile(launch, cfg)
            key = (launch.fn.__name__, report["config"], json.dumps(
                {k: str(v) for k, v in launch.kwargs.items() if not k.startswith("BLOCK")}, sort_keys=True))
            if key in seen:
                continue
            seen.add(key)
            default = launch.configs is None or i == 0
            out.append({"row": row.name, "kernel": launch.fn.__name__, "default": default,
                        "hot": row.hot and default, "autotuned": launch.configs is not None, **report})
    return out


def kernels_in_tree() -> dict[str, list[str]]:
    """module -> the names of its @triton.jit kernels (jit functions named *kernel*; others are helpers).

    A package under ``titan_kernels/triton/`` (e.g. ``flash_attn/``) is one entry under the package's
    name, the module its Rows name: the kernels of all its modules.
    """
    from triton.runtime.jit import JITFunction

    base = ROOT / "titan_kernels" / "triton"
    out: dict[str, set[str]] = {}
    for path in sorted(base.rglob("*.py")):
        parts = path.relative_to(base).with_suffix("").parts
        if parts == ("__init__",):
            continue
        mod = importlib.import_module(".".join(("titan_kernels", "triton", *parts)).removesuffix(".__init__"))
        found = [k for k, v in vars(mod).items() if isinstance(v, JITFunction) and "kernel" in k]
        if found:
            out.setdefault(f"titan_kernels.triton.{parts[0]}", set()).update(getattr(mod, k).__name__ for k in found)
    return {name: sorted(kernels) for name, kernels in out.items()}


def _worker(args) -> list[dict]:
    index, all_configs = args
    row = KERNELS[index]
    if importlib.util.find_spec(row.module) is None:
        return [{"row": row.name, "skipped": f"{row.module} is not in the tree yet"}]
    return compile_row(row, all_configs)


def _init_worker():
    os.environ["TRITON_INTERPRET"] = "0"
    import triton

    triton.runtime.driver.set_active(Sm90Target())


def main(argv: list[str]) -> None:
    import multiprocessing as mp

    all_configs = "--all" in argv
    _init_worker()
    only = argv[argv.index("--only") + 1] if "--only" in argv else ""  # a substring of row names
    todo = [(i, all_configs) for i, r in enumerate(KERNELS) if (all_configs or not r.all_only) and only in r.name]
    ctx = mp.get_context("spawn")  # fresh interpreters: each sets the driver before Triton is used
    with ctx.Pool(min(len(todo), max(1, os.cpu_count() or 1), 8), initializer=_init_worker) as pool:
        rows = [r for part in pool.map(_worker, todo, chunksize=1) for r in part]
    result = {"rows": rows, "kernels_in_tree": kernels_in_tree(), "all_configs": all_configs}
    if "--md" in argv:
        pathlib.Path(argv[argv.index("--md") + 1]).write_text(markdown(result))
    print(json.dumps(result))


def markdown(result: dict) -> str:
    import datetime

    import torch
    import triton

    lines = [
        "# Triton kernels compiled for sm_90a (no GPU: static facts, not timings)", "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- compiled with: triton {triton.__version__} (target cuda:90, ptxas from the Triton wheel), torch {torch.__version__}",
        f"- how: `TRITON_INTERPRET=0 python -m tests.test_sm90_compile{' --all' if result['all_configs'] else ''}`",
        f"- limits: {SMEM_LIMIT} bytes of shared memory per block (H100/H200); {MAX_REGISTERS} registers per thread",
        "- hot: the default config of a row at a Llama shape (spills there fail tests/test_sm90_compile.py)", "",
        "| row | kernel | config | default | hot | regs | smem (B) | spill st/ld (B) | wgmma | TMA |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if "skipped" in r:
            lines.append(f"| {r['row']} | skipped: {r['skipped']} | | | | | | | | |")
            continue
        lines.append(f"| {r['row']} | {r['kernel']} | {r['config']} | {r['default']} | {r['hot']} | {r['registers']} | "
                     f"{r['smem']} | {r['spill_stores']}/{r['spill_loads']} | {r['wgmma']} | {r['tma']} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- tests


def _run(all_configs: bool) -> dict:
    return sm90.run_compile_module("tests.test_sm90_compile", all_configs, timeout=3000, stderr_tail=6000)


def _print_report(result: dict, capsys) -> None:
    with capsys.disabled():
        print(f"\nTriton kernels for sm_90a ({len(result['rows'])} compiles): registers, shared memory, spills")
        for r in result["rows"]:
            if "skipped" in r:
                print(f"  {r['row']:40s} skipped: {r['skipped']}")
                continue
            flag = "" if not (r["spill_stores"] or r["spill_loads"]) else ("  SPILL (hot)" if r["hot"] else "  spill")
            print(f"  {r['row']:40s} {r['kernel']:24s} {r['config']:58s} regs {r['registers']:3d}  "
                  f"smem {r['smem']:6d}  spill {r['spill_stores']}/{r['spill_loads']}{flag}")


def _check(result: dict) -> None:
    rows = [r for r in result["rows"] if "skipped" not in r]
    assert rows, "no kernel was compiled"
    problems = []
    needs = {row.name: row.needs for row in KERNELS}  # per row: an fp32 row of a kernel may not use wgmma
    for r in rows:
        where = f"{r['row']}: {r['kernel']} [{r['config']}]"
        if r["hot"] and (r["spill_stores"] or r["spill_loads"]):
            problems.append(f"{where}: register spill {r['spill_stores']} B stores / {r['spill_loads']} B loads")
        if r["hot"] and r["smem"] > SMEM_LIMIT:
            problems.append(f"{where}: {r['smem']} B of shared memory > {SMEM_LIMIT}")
        for feature in needs.get(r["row"], {}).get(r["kernel"], ()):
            if not r[feature]:
                problems.append(f"{where}: no {feature} instruction in the PTX")
    assert not problems, "\n".join(problems)


def _check_every_kernel_compiled(result: dict) -> None:
    compiled = {r["kernel"] for r in result["rows"] if "skipped" not in r}
    if not result["all_configs"]:  # rows compiled only with --all (see their comment in KERNELS)
        compiled |= {k for row in KERNELS if row.all_only for k in result["kernels_in_tree"].get(row.module, ())}
    missing = [f"{mod}.{k}" for mod, names in result["kernels_in_tree"].items() for k in names if k not in compiled]
    assert not missing, ("Triton kernels no row of KERNELS compiles (add a Row in tests/test_sm90_compile.py): "
                         + ", ".join(missing))


def test_every_triton_kernel_compiles_for_sm90a_default_configs(capsys):
    sm90.require_nvidia_backend()
    result = _run(False)
    _print_report(result, capsys)
    _check(result)
    _check_every_kernel_compiled(result)


@pytest.mark.slow
def test_every_autotuning_config_compiles_for_sm90a(capsys):
    sm90.require_nvidia_backend()
    result = _run(True)
    _print_report(result, capsys)
    _check(result)
    _check_every_kernel_compiled(result)


if __name__ == "__main__":
    main(sys.argv[1:])
