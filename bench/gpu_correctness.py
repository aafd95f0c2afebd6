"""Stage 3 of bench/run_gpu.sh: every op on every backend of the device against float64, a few shapes each.

    python -m bench.gpu_correctness PREFIX [--dry-run]

The fast subset of the kernel tests (tests/kernels/ has the full ones; on a GPU they take far longer,
mostly compiling kernels for their many shapes): forward and gradients of each op on each backend
that runs on the device, compared with float64 math written out here (not with another backend),
at one to three awkward shapes (odd row counts, a transposed input, GQA, Llama widths) in bf16 and
fp32. The relative-norm tolerances are the team's (fp32 1e-5, bf16 1e-2, float8 e4m3 7e-2, e5m2
1.2e-1). Ops: rms_norm, add_rms_norm, apply_rotary_emb (both layouts), fp8_quantize (three
granularities), fp8_gemm (tensorwise, rowwise), fp8_linear (three recipes), flash_attn (every
attention backend causal, the automatic choice non-causal, varlen plain and with a sliding window,
sinks and soft-capping, MLA's head dims on every backend: bench/gpu_correctness_attention.py), and
swiglu (plain and GPT-OSS's clamped variant) /
linear_cross_entropy / grouped_mm / fp8_grouped_mm / moe_permute + moe_unpermute when
``titan_kernels`` has them. fp8_grouped_mm is checked twice: against the unquantized float64 product
(float8 tolerance) and against float64 on the dequantized operands (the codes of the reference
quantizers, bit-identical to every backend's: the GEMMs' own accuracy, at the dtype's tolerance).
A backend that cannot take a case is listed with the reason, not failed.

Writes the ``correctness`` section of PREFIX.json after each op (a time-out loses only the rest) and
exits 1 if any check is outside its tolerance. ``--dry-run``: the CPU backends (reference, csrc cpu,
Triton in the interpreter) at tiny shapes. Autotuning: the first config only
(``TITAN_KERNELS_AUTOTUNE=0``, set by run_gpu.sh), as correctness does not depend on the tile.
"""
from __future__ import annotations

import contextlib
import inspect
import sys
import time

from bench.gpu_checks import E4M3_TOL, E5M2_TOL, Checks, device_backends, randn_as, tolerance, vjp
from bench.gpu_correctness_attention import check_flash_attn


# ----------------------------------------------------------------------------- the ops


def check_rms_norm(c: Checks, dev, S) -> None:
    import torch

    import titan_kernels as tk

    def f64(h, w, eps):
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w

    for be in device_backends("rms_norm", dev):
        for (m, n), dtype, transposed in S.rms:
            base = randn_as(n, m, dtype=dtype, dev=dev, shift=0.1).t() if transposed else \
                randn_as(m, n, dtype=dtype, dev=dev, shift=0.1)
            x = base.detach().requires_grad_()
            w = randn_as(n, dtype=dtype, dev=dev, scale=0.2, shift=1.0).requires_grad_()
            g = randn_as(m, n, dtype=dtype, dev=dev)
            with tk.use_backend(be):
                y = tk.rms_norm(x, w, 1e-6)
                dx, dw = vjp(y, (x, w), g)
            x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
            y64 = f64(x64, w64, 1e-6)
            dx64, dw64 = vjp(y64, (x64, w64), g.double())
            case = f"{m}x{n}{' transposed' if transposed else ''} {str(dtype)[6:]}"
            for q, got, want in (("y", y, y64), ("dx", dx, dx64), ("dweight", dw, dw64)):
                c.add("rms_norm", be, case, q, got, want, tolerance(dtype))
        (m, n), dtype = S.add_rms
        x = randn_as(m, n, dtype=dtype, dev=dev).requires_grad_()
        r = randn_as(m, n, dtype=dtype, dev=dev).requires_grad_()
        w = randn_as(n, dtype=dtype, dev=dev, scale=0.2, shift=1.0).requires_grad_()
        gy, gh = randn_as(m, n, dtype=dtype, dev=dev), randn_as(m, n, dtype=dtype, dev=dev)
        with tk.use_backend(be):
            y, h = tk.add_rms_norm(x, r, w, 1e-6)
            grads = vjp((y, h), (x, r, w), (gy, gh))
        # h is rounded to the storage dtype before the norm, as the unfused code does.
        h_round = (x.detach() + r.detach()).double()
        x64, r64, w64 = (t.detach().double().requires_grad_() for t in (x, r, w))
        h64 = x64 + r64
        y64 = f64(h64 + (h_round - h64).detach(), w64, 1e-6)
        want = vjp((y64, h64), (x64, r64, w64), (gy.double(), gh.double()))
        case = f"{m}x{n} {str(dtype)[6:]}"
        c.add("add_rms_norm", be, case, "y", y, y64, tolerance(dtype))
        c.add("add_rms_norm", be, case, "h", h, h_round, tolerance(dtype))
        for q, got, ref in zip(("dx", "dresidual", "dweight"), grads, want):
            c.add("add_rms_norm", be, case, q, got, ref, tolerance(dtype))


def check_rotary(c: Checks, dev, S) -> None:
    import torch

    import titan_kernels as tk

    def f64(x, cos, sin, interleaved):
        half = cos.shape[-1]
        cos, sin = cos.double()[None, :, None, :], sin.double()[None, :, None, :]
        if interleaved:
            x1, x2 = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
            o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
            return torch.cat((torch.stack((o1, o2), -1).flatten(-2), x[..., 2 * half:]), -1)
        x1, x2 = x[..., :half], x[..., half:2 * half]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., 2 * half:]), -1)

    (b, s, h, hkv, d), dtype = S.rotary
    for be in device_backends("rotary", dev):
        for interleaved in (False, True):
            q = randn_as(b, s, h, d, dtype=dtype, dev=dev).requires_grad_()
            k = randn_as(b, s, hkv, d, dtype=dtype, dev=dev).requires_grad_()
            cos, sin = tk.rope_cos_sin(d, s, 500000.0, device=dev)
            gq, gk = randn_as(b, s, h, d, dtype=dtype, dev=dev), randn_as(b, s, hkv, d, dtype=dtype, dev=dev)
            with tk.use_backend(be):
                qo, ko = tk.apply_rotary_emb(q, k, cos, sin, interleaved=interleaved)
                dq, dk = vjp((qo, ko), (q, k), (gq, gk))
            q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
            qo64, ko64 = f64(q64, cos, sin, interleaved), f64(k64, cos, sin, interleaved)
            dq64, dk64 = vjp((qo64, ko64), (q64, k64), (gq.double(), gk.double()))
            case = f"b{b} s{s} h{h}/{hkv} d{d} {'interleaved' if interleaved else 'half-split'} {str(dtype)[6:]}"
            for qn, got, want in (("q", qo, qo64), ("k", ko, ko64), ("dq", dq, dq64), ("dk", dk, dk64)):
                c.add("rotary", be, case, qn, got, want, tolerance(dtype))


def check_fp8_quantize(c: Checks, dev, S) -> None:
    import torch

    import titan_kernels as tk
    from titan_kernels.reference.fp8 import AMAX_EPS, FP8_MAX

    (m, n), dtype = S.fp8
    e4m3 = torch.float8_e4m3fn
    for be in device_backends("fp8_quantize", dev):
        for gran in ("tensorwise", "rowwise", "colwise"):
            x = randn_as(m, n, dtype=dtype, dev=dev, scale=3.0)
            with tk.use_backend(be):
                codes, scale = tk.fp8_quantize(x, dtype=e4m3, granularity=gran)
            x64 = x.double()
            dims = {"tensorwise": None, "rowwise": 1, "colwise": 0}[gran]
            amax = x64.abs().amax() if dims is None else x64.abs().amax(dims, keepdim=True)
            scale64 = amax.clamp_min(AMAX_EPS) / FP8_MAX[e4m3]
            codes64 = (x64 / scale64).clamp(-FP8_MAX[e4m3], FP8_MAX[e4m3]).to(e4m3).double()
            case = f"{m}x{n} {gran} {str(dtype)[6:]}"
            c.add("fp8_quantize", be, case, "scale", scale.reshape(scale64.shape), scale64, 1e-6)
            mismatch = (codes.double() != codes64).double().mean().item()  # ties may round either way
            c.add("fp8_quantize", be, case, "codes (share differing from f64 rounding)", mismatch, None, 1e-3)
            c.add("fp8_quantize", be, case, "dequantized vs x", codes.double() * scale.double(), x64, E4M3_TOL)


def check_fp8_gemm(c: Checks, dev, S) -> None:
    import torch

    import titan_kernels as tk
    from titan_kernels.ops import fp8 as ops_fp8

    (m, n, k), dtype = S.gemm
    names = device_backends("fp8_gemm", dev)
    if ops_fp8.scaled_mm_available(dev):
        names.append(dev.type)  # the native backend name routes the GEMM to torch._scaled_mm
    else:
        c.skip(f"fp8_gemm [{dev.type}]: this torch has no float8 torch._scaled_mm on {dev.type}")
    for be in names:
        label = f"{be} (_scaled_mm)" if be in ("cpu", "cuda") else be
        for gran in ("tensorwise", "rowwise"):
            a, sa = tk.fp8_quantize(randn_as(m, k, dtype=dtype, dev=dev), granularity=gran)
            b, sb = tk.fp8_quantize(randn_as(n, k, dtype=dtype, dev=dev, scale=0.05), granularity=gran)
            with tk.use_backend(be):
                y = tk.fp8_gemm(a, b, sa, sb, out_dtype=dtype)
            want = (a.double() * sa.double()) @ (b.double() * sb.double()).t()
            c.add("fp8_gemm", label, f"{m}x{k}x{n} {gran} -> {str(dtype)[6:]}", "out", y, want, 2e-2)


def check_fp8_linear(c: Checks, dev, S) -> None:
    import titan_kernels as tk

    (m, n, k), dtype = S.gemm
    for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        x = randn_as(m, k, dtype=dtype, dev=dev).requires_grad_()
        w = randn_as(n, k, dtype=dtype, dev=dev, scale=0.05).requires_grad_()
        g = randn_as(m, n, dtype=dtype, dev=dev)
        y = tk.fp8_linear(x, w, recipe)
        dx, dw = vjp(y, (x, w), g)
        x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        y64 = x64 @ w64.t()
        dx64, dw64 = vjp(y64, (x64, w64), g.double())
        tol_dx = E5M2_TOL if recipe == "tensorwise" else E4M3_TOL
        tol_dw = E5M2_TOL if recipe == "tensorwise" else (E4M3_TOL if recipe == "rowwise" else tolerance(dtype))
        case = f"{m}x{k}x{n} {recipe} {str(dtype)[6:]}"
        c.add("fp8_linear", "auto", case, "y", y, y64, E4M3_TOL)
        c.add("fp8_linear", "auto", case, "dx", dx, dx64, tol_dx)
        c.add("fp8_linear", "auto", case, "dweight", dw, dw64, tol_dw)


def check_swiglu(c: Checks, dev, S) -> None:
    import torch.nn.functional as F

    import titan_kernels as tk

    (m, n), dtype = S.swiglu
    for be in device_backends("swiglu", dev) or ["auto"]:
        # Plain; GPT-OSS's clamped variant on gate/up interleaved in one tensor, a good share beyond +-7.
        for scalars in ({}, {"alpha": 1.702, "limit": 7.0, "up_offset": 1.0}):
            gu = randn_as(m, 2 * n, dtype=dtype, dev=dev, scale=6.0 if scalars else 1.0)
            gate, up = (gu[:, ::2], gu[:, 1::2]) if scalars else (gu[:, :n].contiguous(), gu[:, n:].contiguous())
            gate, up, g = gate.requires_grad_(), up.requires_grad_(), randn_as(m, n, dtype=dtype, dev=dev)
            with tk.use_backend(be) if be != "auto" else contextlib.nullcontext():
                y = tk.swiglu(gate, up, **scalars)
                dg, du = vjp(y, (gate, up), g)
            g64, u64 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
            gc = g64.clamp(max=7.0)  # as Hugging Face's GptOssExperts._apply_gate
            y64 = (u64.clamp(-7.0, 7.0) + 1) * gc * (gc * 1.702).sigmoid() if scalars else F.silu(g64) * u64
            dg64, du64 = vjp(y64, (g64, u64), g.double())
            case = f"{m}x{n} {str(dtype)[6:]}" + (" GPT-OSS clamped (1.702, 7, +1), interleaved" if scalars else "")
            for qn, got, want in (("y", y, y64), ("dgate", dg, dg64), ("dup", du, du64)):
                c.add("swiglu", be, case, qn, got, want, tolerance(dtype))


def check_linear_cross_entropy(c: Checks, dev, S) -> None:
    import torch

    import titan_kernels as tk

    (m, d, vocab), dtype = S.lce
    params = list(inspect.signature(tk.linear_cross_entropy).parameters)
    hidden = randn_as(m, d, dtype=dtype, dev=dev).requires_grad_()
    weight = randn_as(vocab, d, dtype=dtype, dev=dev, scale=0.05).requires_grad_()
    target = torch.randint(0, vocab, (m,), device=dev)
    target[::7] = -100  # ignored positions
    loss = tk.linear_cross_entropy(hidden, weight, target)
    if loss.dim() != 0:
        c.skip(f"linear_cross_entropy: returns shape {tuple(loss.shape)} (parameters {params}); expected a mean loss")
        return
    dh, dw = vjp(loss, (hidden, weight), torch.ones((), device=dev))
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    loss64 = torch.nn.functional.cross_entropy(h64 @ w64.t(), target, ignore_index=-100)
    dh64, dw64 = vjp(loss64, (h64, w64), torch.ones((), dtype=torch.float64, device=dev))
    case = f"{m} tokens x {d} -> vocab {vocab} {str(dtype)[6:]}"
    for qn, got, want in (("loss", loss, loss64), ("dhidden", dh, dh64), ("dweight", dw, dw64)):
        c.add("linear_cross_entropy", "auto", case, qn, got, want, tolerance(dtype))


def _uneven_offsets(t: int, e: int, dev):
    """Cumulative ends of e uneven groups over t - 7 rows, group 1 empty, 7 rows past the last group."""
    import torch

    ends = torch.linspace(0, t - 7, e + 1)[1:].round().long()
    ends[1] = ends[0]
    return ends.to(torch.int32).to(dev)


def _loop64(x, w, offsets):
    """float64 per-expert loop: y[group e] = x[group e] @ w[e], rows past the last group 0."""
    import torch

    bounds = [0, *offsets.tolist()]
    y = torch.zeros(x.shape[0], w.shape[2], dtype=torch.float64, device=x.device)
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        y[a:b] = x[a:b].double() @ w[i].double()
    return y


def _loop64_grads(x, w, offsets, g):
    """(y, dx, dw) of ``_loop64`` in float64 on x and w's values, the gradients of g."""
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = _loop64(x64, w64, offsets)
    return (y64, *vjp(y64, (x64, w64), g.double()))


def _grouped_runs(c: Checks, dev, name: str, op, native: str, shape, dtype, offsets):
    """Each backend of the grouped GEMM ``op`` (reference, triton, the device's aten kernel ``native``)
    on fresh operands of ``shape`` (t, k, n, e): yields (label, case, x, w, g, y, dx, dw), y = op(x,
    w, offsets) and its gradients of g under that backend; a backend that refuses the case (e.g. aten:
    not this dtype or device) is skipped with its reason."""
    import titan_kernels as tk

    t, k, n, e = shape
    for be in ("reference", "triton", dev.type):
        x = randn_as(t, k, dtype=dtype, dev=dev).requires_grad_()
        w = randn_as(e, k, n, dtype=dtype, dev=dev, scale=0.05).requires_grad_()
        g = randn_as(t, n, dtype=dtype, dev=dev)
        label = f"{be} ({native})" if be == dev.type else be
        case = f"{t}x{k} -> {e} experts x {n} {str(dtype)[6:]}"
        try:
            with tk.use_backend(be):
                y = op(x, w, offsets)
                dx, dw = vjp(y, (x, w), g)
        except RuntimeError as err:
            c.skip(f"{name} [{label}] {case}: {str(err).splitlines()[0][:160]}")
            continue
        yield label, case, x, w, g, y, dx, dw


def check_grouped_mm(c: Checks, dev, S) -> None:
    import titan_kernels as tk

    (t, k, n, e), dtype = S.gmm
    # Uneven groups, one empty, and rows past the last group (they must come out zero).
    offsets = _uneven_offsets(t, e, dev)
    for label, case, x, w, g, y, dx, dw in _grouped_runs(c, dev, "grouped_mm", tk.grouped_mm, "torch._grouped_mm",
                                                         (t, k, n, e), dtype, offsets):
        for qn, got, want in zip(("y", "dx", "dw"), (y, dx, dw), _loop64_grads(x, w, offsets, g)):
            c.add("grouped_mm", label, case, qn, got, want, tolerance(dtype))


def check_fp8_grouped_mm(c: Checks, dev, S) -> None:
    import torch

    import titan_kernels as tk
    from titan_kernels.reference import fp8_grouped_mm as q

    for (t, k, n, e), dtype in S.fp8_gmm:
        offsets = _uneven_offsets(t, e, dev)
        bounds = [0, *offsets.tolist()]
        # torch._scaled_grouped_mm may refuse: bf16 only, or not on this device.
        for label, case, x, w, g, y, dx, dw in _grouped_runs(c, dev, "fp8_grouped_mm", tk.fp8_grouped_mm,
                                                             "torch._scaled_grouped_mm", (t, k, n, e), dtype, offsets):
            for qn, got, want in zip(("y", "dx", "dw"), (y, dx, dw), _loop64_grads(x, w, offsets, g)):
                c.add("fp8_grouped_mm", label, case, f"{qn} vs float64", got, want, E4M3_TOL)
            # The operands each GEMM sees, dequantized in float64: forward x rowwise / w per column,
            # dgrad dy rowwise / w per row, wgrad x and dy per (expert, column) over its tokens.
            xd, wd = x.detach(), w.detach()
            (xq, sx), (wq, sw) = q.rows(xd), q.w_fwd(wd)
            (gq, sg), (wr, swr) = q.rows(g), q.w_dgrad(wd)
            gid = q.group_ids(offsets, t).clamp_max(e - 1)
            (xc, sxc), (gc, sgc) = q.group_cols(xd, offsets), q.group_cols(g, offsets)
            xcd, gcd = xc.double() * sxc.double()[gid], gc.double() * sgc.double()[gid]
            want = {
                "y": _loop64(xq.double() * sx.double()[:, None], wq.double() * sw.double()[:, None, :], offsets),
                "dx": _loop64(gq.double() * sg.double()[:, None],
                              (wr.double() * swr.double()[:, :, None]).transpose(1, 2), offsets),
                "dw": torch.stack([xcd[a:b].t() @ gcd[a:b] for a, b in zip(bounds[:-1], bounds[1:])]),
            }
            for qn, got in (("y", y), ("dx", dx), ("dw", dw)):
                c.add("fp8_grouped_mm", label, case, f"{qn} vs dequantized float64", got, want[qn], tolerance(dtype))


def check_moe_permute(c: Checks, dev, S) -> None:
    import torch

    import titan_kernels as tk

    (t, d, e, top_k, align), dtype = S.permute
    idx = torch.rand(t, e).topk(top_k, dim=1).indices.to(dev)  # distinct experts per token
    idx[: t // 3] = idx[0]  # a crowd on the same experts: uneven groups
    # The permutation written out: slots (token order) of each expert, groups padded to align.
    flat = idx.reshape(-1).cpu().tolist()
    counts = [flat.count(i) for i in range(e)]
    padded = [-(-cnt // align) * align for cnt in counts]
    starts = [sum(padded[:i]) for i in range(e)]
    rank = [0] * e
    dst = []
    for expert in flat:
        dst.append(starts[expert] + rank[expert])
        rank[expert] += 1
    dst64 = torch.tensor(dst, device=dev).view(t, top_k)
    rows = t * top_k + e * (align - 1)
    offsets64 = torch.tensor([s + p for s, p in zip(starts, padded)], device=dev)
    for be in ("reference", "triton", dev.type):
        case = f"T{t} top-{top_k} of {e} experts, D {d}, align {align} {str(dtype)[6:]}"
        x = randn_as(t, d, dtype=dtype, dev=dev).requires_grad_()
        yp = randn_as(rows, d, dtype=dtype, dev=dev).requires_grad_()
        scores = torch.rand(t, top_k, device=dev).requires_grad_()
        gp, go = randn_as(rows, d, dtype=dtype, dev=dev), randn_as(t, d, dtype=dtype, dev=dev)
        try:
            with tk.use_backend(be):
                xp, routing = tk.moe_permute(x, idx, e, align)
                (dx,) = vjp(xp, (x,), gp)
                out = tk.moe_unpermute(yp, routing, scores)
                dyp, ds = vjp(out, (yp, scores), go)
        except RuntimeError as err:
            c.skip(f"moe_permute [{be}] {case}: {str(err).splitlines()[0][:160]}")
            continue
        c.add("moe_permute", be, case, "offsets (max abs diff)",
              float((routing.offsets.long() - offsets64).abs().max()), None, 0.0)
        x64 = x.detach().double().requires_grad_()
        xp64 = torch.zeros(rows, d, dtype=torch.float64, device=dev).index_copy(
            0, dst64.reshape(-1), x64.repeat_interleave(top_k, 0))
        (dx64,) = vjp(xp64, (x64,), gp.double())
        yp64, s64 = yp.detach().double().requires_grad_(), scores.detach().double().requires_grad_()
        out64 = (yp64[dst64] * s64[..., None]).sum(1)
        dyp64, ds64 = vjp(out64, (yp64, s64), go.double())
        c.add("moe_permute", be, case, "xp", xp, xp64, 0.0)  # a copy: exact
        c.add("moe_permute", be, case, "dx", dx, dx64, tolerance(dtype))
        c.add("moe_unpermute", be, case, "out", out, out64, tolerance(dtype))
        c.add("moe_unpermute", be, case, "dyp", dyp, dyp64, tolerance(dtype))
        c.add("moe_unpermute", be, case, "dscores", ds, ds64, tolerance(dtype))


# ----------------------------------------------------------------------------- sizes and the run


def sizes(cuda: bool):
    """The shapes of each check: the GPU's (awkward rows, Llama widths), else the dry run's tiny ones
    (Triton in the interpreter)."""
    import types

    import torch

    bf16, fp32 = torch.bfloat16, torch.float32
    table = {  # name: (on the GPU, in the dry run)
        "rms": ([((257, 4096), bf16, False), ((33, 8192), bf16, True), ((64, 1000), fp32, False)],
                [((7, 64), fp32, False), ((5, 40), bf16, True)]),
        "add_rms": (((129, 4096), bf16), ((5, 40), fp32)),
        "rotary": (((2, 257, 32, 8, 128), bf16), ((1, 9, 4, 2, 16), fp32)),
        "fp8": (((1000, 4096), bf16), ((9, 64), fp32)),
        "gemm": (((1000, 1536, 4096), bf16), ((17, 32, 64), fp32)),
        "attn": (((2, 1000, 16, 4, 128), bf16), ((1, 17, 4, 2, 16), fp32)),
        "swiglu": (((1000, 14336), bf16), ((9, 40), fp32)),
        "lce": (((1000, 1024, 32000), bf16), ((9, 32, 100), fp32)),
        "gmm": (((1000, 512, 768, 8), bf16), ((40, 16, 24, 4), fp32)),
        # aligned (the 30B-A3B path), and K/N off 16 with small groups (the padding of _scaled_grouped_mm)
        "fp8_gmm": ([((1000, 512, 768, 8), bf16), ((333, 200, 136, 5), bf16)], [((40, 16, 24, 4), fp32)]),
        "permute": (((1000, 2048, 16, 4, 16), bf16), ((9, 40, 5, 2, 4), fp32)),
    }
    return types.SimpleNamespace(**{name: pair[0 if cuda else 1] for name, pair in table.items()})


CHECKS = [("rms_norm", check_rms_norm), ("rotary", check_rotary), ("fp8_quantize", check_fp8_quantize),
          ("fp8_gemm", check_fp8_gemm), ("fp8_linear", check_fp8_linear), ("flash_attn", check_flash_attn),
          ("swiglu", check_swiglu), ("linear_cross_entropy", check_linear_cross_entropy),
          ("grouped_mm", check_grouped_mm), ("fp8_grouped_mm", check_fp8_grouped_mm),
          ("moe_permute", check_moe_permute)]
# checked when titan_kernels has them (other issues)
OPTIONAL = {"swiglu", "linear_cross_entropy", "grouped_mm", "fp8_grouped_mm", "moe_permute"}


def main(argv: list[str]) -> int:
    prefix = argv[0]
    from bench import autotune_cap

    autotune_cap.install()
    import torch

    import titan_kernels as tk
    from bench import common

    dev = common.device()
    S = sizes(dev.type == "cuda")
    c = Checks(prefix)
    torch.manual_seed(0)
    for name, check in CHECKS:
        if name in OPTIONAL and not hasattr(tk, name):
            c.skip(f"{name}: titan_kernels has no {name} yet")
            c.save()
            continue
        t0 = time.perf_counter()
        n0 = len(c.rows)
        try:
            check(c, dev, S)
        except Exception as e:  # noqa: BLE001  (one broken op must not hide the others' results)
            c.rows.append({"op": name, "backend": "?", "case": "raised", "quantity": type(e).__name__,
                           "err": float("inf"), "tol": 0.0, "ok": False})
            print(f"  FAIL {name}: raised {type(e).__name__}: {str(e)[:400]}", flush=True)
        bad = sum(not r["ok"] for r in c.rows[n0:])
        print(f"{name}: {len(c.rows) - n0} checks, {bad} outside tolerance ({time.perf_counter() - t0:.1f} s)",
              flush=True)
        c.save()
    bad = [r for r in c.rows if not r["ok"]]
    print(f"correctness: {len(c.rows) - len(bad)} of {len(c.rows)} checks within tolerance, "
          f"{len(c.skipped)} not run", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
