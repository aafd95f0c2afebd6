"""Stage 4 of bench/run_gpu.sh: the headline benchmarks, each as a share of the measured ceiling and
as a ratio to the baselines timed in the same process.

    python -m bench.gpu_headline PREFIX [--dry-run]

Reuses the timed functions of the bench modules (``test_*(benchmark, ...)``, called with
``benchmark=None``: bench/common.py then times with ``triton.testing.do_bench`` on CUDA), at a
headline subset of their parameters, in this order (most important first; each group has a share of
the stage's time, and the results are saved after each group, so a time-out loses only the rest):

  rms_norm        fwd+bwd at 16384x4096, 65536x4096, 16384x8192 (bf16): titan and each backend vs
                  eager, torch.compile (and Liger when installed)
  rms_norm.compiled  torch.compile(fullgraph=True) of titan rms_norm / add_rms_norm fwd+bwd through the
                  custom op and through the triton_op variant (rms_norm_triton_op.py), checked
                  against eager and timed against each other and Inductor's own F.rms_norm. The
                  verdict (does triton_op pay: >= 3% faster) is in the notes and in ``triton_op``.
  rotary          fwd+bwd, 4 x 4096 tokens, 32/8 heads, head_dim 128
  attention       fwd and bwd, head_dim 128, seq 4k and 8k causal: titan (automatic), titan-triton
                  and every SDPA backend (sdpa-math is not timed past 2k: it materializes the scores)
  attention_variants  fwd+bwd of a sliding window (128) and of sinks at seq 8k and 32k (GPT-OSS's
                  64 / 8 heads, head_dim 64) against full causal and FlashAttention's window where
                  installed, and MLA's head dims (192 / 128, 8k causal) against SDPA; TFLOP/s over
                  the unmasked score entries only (bench/bench_attention_variants.py)
  attention_chunked  fwd+bwd of Llama 4's chunked attention (chunk 8192, 40 / 8 heads, head_dim 128) at
                  seq 32k against causal at the same shape; TFLOP/s over the unmasked score entries
                  (bench/bench_chunked_attention.py)
  fp8_gemm        tensorwise at the Llama 3 8B q/o, FFN up and FFN down shapes (16384 tokens):
                  titan, titan-triton vs torch._scaled_mm and bf16 torch.mm
  float8_linear   Float8Linear fwd+bwd at the 8B FFN up shape vs bf16 nn.Linear (torchao if present)
  swiglu          fwd+bwd at 16384 x 14336 (the 8B FFN) vs eager, torch.compile (bench/bench_swiglu.py)
  swiglu.gpt_oss  GPT-OSS's clamped SwiGLU fwd+bwd, 65536 rows (16384 tokens x top-4) x 2880, gate/up
                  interleaved: titan vs the eager composition of Hugging Face's experts, torch.compile of it
  cross_entropy   linear cross-entropy fwd+bwd, 16384 tokens x 4096 -> vocab 128256
                  (bench/bench_cross_entropy.py); these two are skipped with the reason while their
                  files are absent, and their filters are lenient while other issues shape them
  grouped_mm      MoE grouped GEMM fwd+bwd at Qwen3-30B-A3B shapes (8192 tokens, top-8 of 128
                  experts: 2048 -> 768 gate/up and 768 -> 2048 down, bf16): titan (measured choice),
                  titan-fp8 (fp8_grouped_mm: rowwise float8, torch._scaled_grouped_mm) next, then
                  titan-triton, titan-fp8-triton vs torch._grouped_mm and the per-expert loop
                  (bench/bench_moe.py; the loop last, should the group's share run out)
  adamw_step      one AdamW step of a Llama 3 8B FFN weight (4096 x 14336): titan's fused_adamw_
                  (float32 and bf16 states) vs torch.optim.AdamW fused and foreach (bench/bench_optim.py)
  decode          generation's decode step (trainer.generate) at Llama 3 8B shapes cut to 4 layers, bf16,
                  batch 1 and 32: tokens/s and the share of the bandwidth limit (weights + cache bytes
                  per step over the copy bandwidth measured in this run; bench/gpu_decode.py)
  newton_schulz   Muon's Newton-Schulz at 4096 x 4096 and 8192 x 28672 (bf16): titan (measured
                  choice), titan-aten (cuBLAS), titan-triton (symmetric products) vs torch.optim.Muon's
                  iteration; TFLOP/s and share of the bf16 matmul rate measured in the same run

Writes the ``headline`` section of PREFIX.json (rows, the Markdown table, ceilings, notes).
``--dry-run``: the CPU shapes of each module (the modules' own CPU smoke sizes), Triton in the
interpreter left out as the modules do, torch.compile baselines left out (Inductor's CPU code
generation would take minutes) and the compiled triton_op check replaced by an eager one.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import itertools
import os
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]

# (group, module, function, parameter filter, share of the stage's time)
# A filter maps a parameter to the values to time; values the module does not have (its CPU sizes)
# fall back to the module's own first value, so the dry run times what the module runs on the CPU.
GROUPS = [
    ("rms_norm", "bench.bench_rms_norm", "test_rms_norm",
     {"pass_": ["fwd+bwd"], "shape": [(16384, 4096), (65536, 4096), (16384, 8192)]}, 0.16),
    ("rms_norm.compiled", None, "compiled_rms_norm", {}, 0.15),
    ("rotary", "bench.bench_rotary", "test_rotary", {"pass_": ["fwd+bwd"], "shape": [(4, 4096, 32, 8)]}, 0.07),
    ("attention", "bench.bench_attention", "test_attention",
     {"pass_": ["fwd", "bwd"], "shape": [(4096, 128, True), (8192, 128, True)]}, 0.17),
    ("attention_variants", "bench.bench_attention_variants", "test_attention_variant",
     {"pass_": ["fwd+bwd"], "seq": [8192, 32768]}, 0.12),
    ("attention_chunked", "bench.bench_chunked_attention", "test_chunked_attention",
     {"pass_": ["fwd+bwd"], "seq": [32768]}, 0.04),
    ("fp8_gemm", "bench.bench_fp8", "test_fp8_gemm",
     {"shape": ["8B.attn_qo", "8B.ffn_up", "8B.ffn_down"], "gran": ["tensorwise"]}, 0.12),
    ("float8_linear", "bench.bench_fp8", "test_float8_linear_fwd_bwd",
     {"shape": ["8B.ffn_up"], "recipe": ["tensorwise"]}, 0.05),
    ("swiglu", "bench.bench_swiglu", "test_swiglu", {"pass_": ["fwd+bwd"], "shape": [(16384, 14336)]}, 0.06),
    ("swiglu.gpt_oss", "bench.bench_swiglu", "test_swiglu_clamped",
     {"pass_": ["fwd+bwd"], "shape": [(65536, 2880)], "impl": ["titan", "eager", "compile"]}, 0.03),
    ("cross_entropy", "bench.bench_cross_entropy", "test_cross_entropy",
     {"pass_": ["fwd+bwd"], "shape": [(16384, 4096, 128256)]}, 0.08),
    ("grouped_mm", "bench.bench_moe", "test_grouped_mm",
     {"pass_": ["fwd+bwd"], "shape": ["30B-A3B.w13", "30B-A3B.w2"]}, 0.10),
    ("adamw_step", "bench.bench_optim", "test_adamw_step", {"shape": ["8B.ffn"]}, 0.04),
    ("newton_schulz", "bench.bench_optim", "test_newton_schulz", {"shape": [(4096, 4096), (8192, 28672)]}, 0.10),
    ("decode", None, "decode_timing", {}, 0.08),
]
# Groups whose modules other issues are still shaping: their filters fall back to the module's first
# value instead of failing, and a missing function name to every timed function of the module.
SOFT = {"swiglu", "cross_entropy"}
SLOW = "__slow__"  # a parameter marked pytest.mark.slow (left out of the dry run, as of the default test run)
DRY_EXCLUDE = {"impl": {"compile"}, SLOW: True}  # Inductor on the CPU: minutes of C++ compiles
TRITON_OP_PAYS = 1.03  # triton_op must be at least 3% faster than the custom op to replace it


def _axes(fn) -> list[list[dict]]:
    """The parametrize axes of a pytest function, each a list of {argname: value} dicts, in the order
    pytest nests them (the top decorator, ``impl`` in our modules, varies fastest)."""
    axes = []
    for mark in getattr(fn, "pytestmark", []):
        if mark.name != "parametrize":
            continue
        names = mark.args[0]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        values = []
        for raw in mark.args[1]:
            slow = False
            if hasattr(raw, "values") and hasattr(raw, "marks"):  # pytest.param(...)
                vals = tuple(raw.values)
                slow = any(m.name == "slow" for m in raw.marks)
            else:
                vals = (raw,) if len(names) == 1 else tuple(raw)
            values.append({**dict(zip(names, vals)), **({SLOW: True} if slow else {})})
        axes.append(values)
    return axes


def cases(fn, wanted: dict, exclude: dict, strict: bool = False) -> list[dict]:
    """The parameter combinations of ``fn`` to time: its parametrize axes filtered by ``wanted``.

    strict (on CUDA, where the modules' lists are the GPU ones): every wanted value must exist, so a
    typo fails instead of timing another shape. Otherwise values the module lacks (its CPU sizes)
    fall back to its first value.
    """
    axes = []
    for axis in _axes(fn):
        name = next(iter(axis[0])) if len(axis[0]) == 1 else None
        if name in wanted:
            keep = [v for v in axis if v[name] in wanted[name]]
            missing = [w for w in wanted[name] if w not in [v[name] for v in axis]]
            if strict and missing:
                raise ValueError(f"{fn.__module__}.{fn.__name__}: {name} has no {missing}; it has "
                                 f"{[v[name] for v in axis]}")
            axis = keep or axis[:1]
        if name in exclude:
            axis = [v for v in axis if v[name] not in exclude[name]]
        if exclude.get(SLOW):
            axis = [v for v in axis if not v.get(SLOW)]
        axes.append(axis)
    return [{k: v for d in combo for k, v in d.items() if k != SLOW} for combo in itertools.product(*axes)]


def _skip_reason(fn) -> str | None:
    for mark in getattr(fn, "pytestmark", []):
        if mark.name == "skipif" and mark.args and mark.args[0] is True:
            return mark.kwargs.get("reason", "skipif")
    return None


def run_function(fn, wanted: dict, exclude: dict, deadline: float, notes: list[str], label: str,
                 strict: bool) -> None:
    import pytest

    why = _skip_reason(fn)
    if why:
        notes.append(f"{label}: {fn.__name__} skipped: {why}")
        return
    params = set(inspect.signature(fn).parameters) - {"benchmark"}
    todo = cases(fn, wanted, exclude, strict)
    if not params <= {k for c in todo[:1] for k in c}:
        notes.append(f"{label}: {fn.__name__} needs fixtures other than `benchmark` ({sorted(params)}): not run")
        return
    for i, kw in enumerate(todo):
        if time.perf_counter() > deadline:
            notes.append(f"{label}: its time share ran out after {i} of {len(todo)} cases")
            return
        try:
            fn(None, **kw)
        except pytest.skip.Exception as e:  # the module's own reason (an impl that cannot run here)
            notes.append(f"{label} {kw}: skipped: {str(e)[:200]}")
        except Exception as e:  # noqa: BLE001  (one failing case must not hide the rest)
            notes.append(f"{label} {kw}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
            print(f"  {label} {kw}: FAILED {type(e).__name__}: {e}", flush=True)


# ----------------------------------------------------------------------------- compiled: custom op vs triton_op


def compiled_rms_norm(deadline: float, notes: list[str], dry: bool) -> dict:
    """torch.compile(fullgraph=True) of rms_norm / add_rms_norm through the custom op and the triton_op."""
    import torch
    import torch.nn.functional as F

    import titan_kernels as tk
    from bench import common
    from titan_kernels.ops.rms_norm_triton_op import add_rms_norm_triton_op, rms_norm_triton_op

    dev = common.device()
    m, n = (16384, 4096) if dev.type == "cuda" else (64, 256)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    x = torch.randn(m, n, device=dev, dtype=dtype)
    r = torch.randn(m, n, device=dev, dtype=dtype)
    w = torch.rand(n, device=dev, dtype=dtype) + 0.5
    g = torch.randn(m, n, device=dev, dtype=dtype)
    eps = 1e-6
    fns = {
        "rms_norm": {
            "compile": lambda x, r, w: (F.rms_norm(x, (n,), w, eps),),
            "titan custom_op": lambda x, r, w: (tk.rms_norm(x, w, eps),),
            "titan triton_op": lambda x, r, w: (rms_norm_triton_op(x, w, eps),),
        },
        "add_rms_norm": {  # the pre-norm residual step of every block; custom op vs triton_op only
            "titan custom_op": lambda x, r, w: tk.add_rms_norm(x, r, w, eps),
            "titan triton_op": lambda x, r, w: add_rms_norm_triton_op(x, r, w, eps),
        },
    }
    # The dry run (CPU): the triton_op cannot compile there (the interpreter would run on fake
    # tensors), so it runs eagerly, and the others compile with aot_eager (no C++ code generation).
    backend = "aot_eager" if dry else "inductor"
    out: dict = {"shape": f"{m}x{n}", "dtype": str(dtype).replace("torch.", ""), "backend": backend, "checks": {}}
    for op, impls in fns.items():
        ref = None
        times = {}
        for impl, f in impls.items():
            if time.perf_counter() > deadline:
                notes.append(f"rms_norm.compiled: its time share ran out before {op} {impl}")
                return out
            eager_only = dry and impl == "titan triton_op"
            torch._dynamo.reset()
            cf = f if eager_only else torch.compile(f, fullgraph=True, dynamic=False, backend=backend)
            xg, rg, wg = (t.detach().requires_grad_() for t in (x, r, w))

            def step(cf=cf, xg=xg, rg=rg, wg=wg):
                outs = cf(xg, rg, wg)
                return torch.autograd.grad(outs, (xg, rg, wg), [g] * len(outs), allow_unused=True)

            try:
                result = step()
            except Exception as e:  # noqa: BLE001  (fullgraph compile refused: that is the finding)
                out["checks"][f"{op} {impl}"] = f"FAILED {type(e).__name__}: {str(e).splitlines()[0][:300]}"
                notes.append(f"rms_norm.compiled {op} {impl}: torch.compile(fullgraph=True) FAILED: "
                             f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
                continue
            vals = [t for t in result if t is not None]
            if ref is None:
                ref, ref_name = vals, impl
            else:
                errs = [((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
                        for a, b in zip(vals, ref)]
                tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
                out["checks"][f"{op} {impl}"] = (f"{'ok' if max(errs) <= tol else 'MISMATCH'}: max rel. error "
                                                 f"{max(errs):.1e} vs {ref_name} (the gradients)")
            label = impl + (" (eager: not compilable on the CPU)" if eager_only else "")
            row = common.run(None, step, op=f"{op}.compiled fwd+bwd", impl=label, shape=(m, n), dtype=dtype,
                             bytes_moved=(5 if op == "rms_norm" else 8) * m * n * x.element_size())
            times[impl] = row.time_s
        if "titan custom_op" in times and "titan triton_op" in times and not dry:
            ratio = times["titan custom_op"] / times["titan triton_op"]
            verdict = ("pays: route the compiled CUDA path through it (TITAN_KERNELS_TRITON_OP=1)"
                       if ratio >= TRITON_OP_PAYS else "does not pay: keep the custom op")
            out[op] = {"custom_op_s": times["titan custom_op"], "triton_op_s": times["titan triton_op"],
                       "speedup_triton_op": ratio, "verdict": verdict}
            notes.append(f"rms_norm.compiled {op}: triton_op {ratio:.2f}x the custom op's speed ({verdict})")
    return out


# ----------------------------------------------------------------------------- the run


def functions(group: str, modname: str, fname: str | None) -> list:
    mod = importlib.import_module(modname)
    if fname and (hasattr(mod, fname) or group not in SOFT):
        return [getattr(mod, fname)]
    return [f for name, f in vars(mod).items() if name.startswith("test_") and callable(f)
            and "benchmark" in inspect.signature(f).parameters]


def check_params() -> int:
    """The dry run's check of the GPU parameter lists: import the modules as on CUDA (BENCH_DEVICE=cuda,
    nothing is allocated at import) and check that every wanted value exists."""
    assert os.environ.get("BENCH_DEVICE") == "cuda", "run with BENCH_DEVICE=cuda"
    bad = 0
    for group, modname, fname, wanted, _ in GROUPS:
        if modname is None:
            continue
        if importlib.util.find_spec(modname) is None:
            print(f"{group}: {modname} not in the tree (skipped on the GPU too)")
            continue
        for fn in functions(group, modname, fname):
            try:
                n = len(cases(fn, wanted, {}, strict=True))
                print(f"{group}: {fn.__name__}: {n} CUDA cases")
            except ValueError as e:  # lenient groups (SOFT) time the module's first value instead
                bad += group not in SOFT
                print(f"{group}: {'WARNING (lenient group)' if group in SOFT else 'ERROR'}: {e}")
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--check-params":
        return check_params()
    prefix, dry = argv[0], "--dry-run" in argv
    from bench import autotune_cap

    autotune_cap.install()
    import torch

    from bench import common, gpu_report

    if dry:  # one call per timing: the dry run walks the code paths, it measures nothing
        def once(fn):
            t0 = time.perf_counter()
            fn()
            return max(time.perf_counter() - t0, 1e-9)

        common.measure = once
    budget = float(os.environ.get("BENCH_STAGE_BUDGET", "120"))
    t_start = time.perf_counter()
    end = t_start + budget - 8  # leave time to write the files
    notes: list[str] = []
    ceilings = {"copy_bandwidth_GBps": common.copy_bandwidth() / 1e9, "matmul_TFLOPs": common.matmul_rate() / 1e12,
                "load_average": common.load_average()}
    head: dict = {"ceilings": ceilings, "notes": notes}
    failed = False

    def save():
        rows = common.with_ratios(common.ROWS)
        head["rows"] = [common.row_json(r) for r in rows]
        head["ceilings"]["line"] = common.ceilings_line()  # re-measured ones included
        head["table"] = common.table(rows) if rows else ""
        gpu_report.update(prefix, "headline", head)

    exclude = DRY_EXCLUDE if dry else {}
    for group, modname, fname, wanted, share in GROUPS:
        t0 = time.perf_counter()
        deadline = min(end, t0 + share * budget * 1.5)  # a group may borrow a little from the ones after it
        n0, k0 = len(common.ROWS), len(notes)
        try:
            if modname is None and fname == "decode_timing":
                from bench.gpu_decode import decode_timing

                head["decode"] = decode_timing(deadline, notes, dry)
            elif modname is None:
                head["triton_op"] = compiled_rms_norm(deadline, notes, dry)
            elif importlib.util.find_spec(modname) is None:
                notes.append(f"{group}: {modname.replace('.', '/')}.py is not in the tree yet: skipped")
            else:
                for fn in functions(group, modname, fname):
                    run_function(fn, wanted, exclude, deadline, notes, group,
                                 strict=common.on_cuda() and group not in SOFT)
        except Exception as e:  # noqa: BLE001  (an import or setup error of one group)
            failed = True
            notes.append(f"{group}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
            print(f"{group}: FAILED {type(e).__name__}: {e}", flush=True)
        failed |= any("FAILED" in n or "MISMATCH" in n for n in notes[k0:])
        print(f"{group}: {len(common.ROWS) - n0} timings in {time.perf_counter() - t0:.1f} s", flush=True)
        for note in notes[k0:]:
            print(f"  {note}", flush=True)
        save()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    print(head["table"], flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
