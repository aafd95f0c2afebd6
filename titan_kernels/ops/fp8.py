"""Float8 ops: ``torch.ops.titan.fp8_quantize``, ``torch.ops.titan.fp8_gemm`` and the training
GEMM triple of a linear layer, ``torch.ops.titan.fp8_linear`` with its backward
``torch.ops.titan.fp8_linear_backward``.

Math: dynamic scaling as in Micikevicius et al. 2022, "FP8 Formats for Deep Learning" (section 4)
and torchao.float8 (see ``titan_kernels.reference.fp8`` for the exact formulas). The training
recipes keep torchao's names and meanings:

  recipe               forward y = x W^T        grad_input dx = dy W          grad_weight dW = dy^T x
  tensorwise           x, W e4m3 tensorwise     dy e5m2 tensorwise, W e4m3    dy e5m2, x e4m3 (tensorwise)
  rowwise              x, W e4m3 rowwise        dy e4m3 rowwise, W e4m3 colw. dy, x e4m3 colwise
  rowwise_with_gw_hp   x, W e4m3 rowwise        dy e4m3 rowwise, W e4m3 tensorwise   high precision

Every scale is taken along the reduction (K) dim of its GEMM; the rowwise recipes round scales
down to powers of two, as torchao does. The forward GEMM uses fast accumulation, the gradient
GEMMs do not (torchao's defaults). The backward re-quantizes x and W from the high-precision
tensors saved by the forward (the same memory as a bf16 Linear; the same codes as the forward).

Backends. ``fp8_quantize``: ``reference`` and ``triton``. ``fp8_gemm``: ``reference``
(dequantize + float32 matmul), ``triton`` (our persistent GEMM, TMA on sm_90) and ``scaled_mm``,
``torch._scaled_mm`` (cuBLASLt / CUTLASS on CUDA; the CPU kernel of torch >= 2.13), registered in
``titan_kernels.backend`` as the native implementation of both the ``cpu`` and ``cuda`` families (it
needs no extension of ours). The automatic choice takes it first where torch has it for the device
and, on the CPU, where a one-time timing shows it is not slower than the reference GEMM. The ops
follow the rms_norm pattern: ``custom_op`` + fake + ``register_autograd`` (fp8_linear), and an
eager fast path.

Under DTensor, ``fp8_linear`` runs on local shards (rules in ``titan_kernels.dtensor``): each
shard is scaled on its own (per-shard amax), which is exact dequantized math for that shard; the
result matches the unsharded one to fp8 accuracy, not bit for bit. ``fp8_quantize`` and ``fp8_gemm``
have no sharding rule (DTensor refuses them with an error) because a tensorwise amax would need a
collective.
"""
from __future__ import annotations

import contextlib
import functools

import torch

from titan_kernels import backend as _backend
from titan_kernels.ops._common import FLOAT_DTYPES, check_float, check_same_device, check_tensor, eager_fast_path
from titan_kernels.reference import fp8 as _ref
from titan_kernels.reference.fp8 import FP8_DTYPES, FP8_MAX, GRANULARITIES  # noqa: F401  (re-exported)

OP_QUANT = "fp8_quantize"
OP_GEMM = "fp8_gemm"
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
OUT_DTYPES = FLOAT_DTYPES
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

# Each quantize backend: (fp8_quantize, tensorwise_amax, fp8_quantize_from_amax).
_backend.register_impl(
    OP_QUANT, "reference",
    (_ref.fp8_quantize, lambda x: _ref.amax(x, "tensorwise"), _ref.fp8_quantize_from_amax),
)
_backend.register_impl(OP_GEMM, "reference", _ref.fp8_gemm)


def _register_triton() -> None:
    try:
        from titan_kernels.triton import fp8_gemm as _tri_gemm
        from titan_kernels.triton import fp8_quantize as _tri_quant
    except ImportError:  # triton not installed: the backend reports itself unavailable
        return
    _backend.register_impl(
        OP_QUANT, "triton", (_tri_quant.fp8_quantize, _tri_quant.tensorwise_amax, _tri_quant.fp8_quantize_from_amax)
    )
    _backend.register_impl(OP_GEMM, "triton", _tri_gemm.fp8_gemm)


_register_triton()


# ----------------------------------------------------------------------------- torch._scaled_mm


@functools.lru_cache(maxsize=None)
def _scaled_mm_works(device: str, a_dtype, b_dtype, rowwise: bool, out_dtype, with_bias: bool) -> bool:
    """Whether ``torch._scaled_mm`` accepts this combination on ``device`` (probed once on 16^3:
    the accepted dtypes, scale modes and bias support differ between CPU, CUDA and versions)."""
    if not hasattr(torch, "_scaled_mm"):
        return False
    dev = torch.device(device)
    try:
        a = torch.zeros(16, 16, device=dev).to(a_dtype)
        b = torch.zeros(16, 16, device=dev).to(b_dtype)
        if rowwise:
            sa, sb = torch.ones(16, 1, device=dev), torch.ones(1, 16, device=dev)
        else:
            sa, sb = torch.ones((), device=dev), torch.ones((), device=dev)
        bias = torch.zeros(16, device=dev, dtype=out_dtype) if with_bias else None
        torch._scaled_mm(a, b.t(), sa, sb, bias=bias, out_dtype=out_dtype)
    except (RuntimeError, TypeError, NotImplementedError, ValueError):
        return False
    return True


def scaled_mm_available(device: torch.device | str) -> bool:
    """Whether ``torch._scaled_mm`` runs an e4m3 tensorwise GEMM on this device type."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        return False
    return _scaled_mm_works(str(dev), E4M3, E4M3, False, torch.bfloat16, False)


@functools.lru_cache(maxsize=None)
def _cpu_scaled_mm_pays() -> bool:
    """One timing, once per process: torch._scaled_mm against the dequantized float32 matmul at
    128^3. Measured on our AVX2 EPYC CPUs (torch 2.13): _scaled_mm took 2.1 s for a 256 x 256 x 768
    GEMM, about a thousand times the float32 matmul, so there the reference GEMM is the fast path;
    CPUs with native float8 support in oneDNN keep _scaled_mm."""
    import time

    a = torch.randn(128, 128).to(E4M3)
    b = torch.randn(128, 128).to(E4M3)
    one = torch.ones(())

    def best(fn) -> float:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    t_scaled = best(lambda: torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16))
    t_ref = best(lambda: (a.float() @ b.float().t()).to(torch.bfloat16))
    return t_scaled <= 2 * t_ref


_ALIGN = 16  # _scaled_mm wants K and N multiples of 16 on CUDA; we pad everywhere so the CPU tests it


def _pad_to(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``t`` (row-major) zero-padded to (rows, cols)."""
    if t.shape == (rows, cols):
        return t.contiguous()
    out = t.new_zeros((rows, cols))
    out[: t.shape[0], : t.shape[1]] = t
    return out


def scaled_mm_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    use_fast_accum: bool,
) -> torch.Tensor:
    """``fp8_gemm`` on ``torch._scaled_mm``; same contract as ``reference.fp8.fp8_gemm``.

    Adapts to _scaled_mm's conventions: a row-major and b column-major (``b.t()`` of a row-major
    (N, K)), K and N zero-padded to multiples of 16 (zeros add nothing to the dot products; the
    extra columns are cut off), scales either both scalars or (M, 1) and (1, N) (a tensorwise
    scale facing a rowwise one is broadcast). A combination this torch/device refuses (e.g. rowwise
    with a float32 output on CUDA) runs as an unscaled float32 _scaled_mm with the scales and bias
    applied in float32 afterwards; e5m2 x e5m2, which cuBLASLt refuses outright, runs on the
    Triton kernel (or the reference where Triton cannot run).
    """
    m, k = a.shape
    n = b.shape[0]
    if m == 0 or n == 0 or k == 0:
        return _ref.fp8_gemm(a, b, a_scale, b_scale, out_dtype, bias, use_fast_accum)
    dev = a.device
    kp, np_ = -(-k // _ALIGN) * _ALIGN, -(-n // _ALIGN) * _ALIGN
    a2 = _pad_to(a, m, kp)
    b2 = _pad_to(b, np_, kp)
    rowwise = a_scale.numel() != 1 or b_scale.numel() != 1
    if rowwise:
        # Built from 1-D vectors: _scaled_mm checks stride(1) == 1 even on size-1 dims.
        sa = a_scale.float().reshape(-1).expand(m).reshape(m, 1).contiguous()
        sb = torch.ones(np_, dtype=torch.float32, device=dev)
        sb[:n] = b_scale.float().reshape(-1)
        sb = sb.reshape(1, np_)
    else:
        sa, sb = a_scale.float().reshape(()), b_scale.float().reshape(())
    fuse_bias = bias is not None and bias.dtype == out_dtype and out_dtype != torch.float32
    mm_dtype = out_dtype if bias is None or fuse_bias else torch.float32
    key = (str(dev), a.dtype, b.dtype)
    if _scaled_mm_works(*key, rowwise, mm_dtype, fuse_bias):
        y = torch._scaled_mm(a2, b2.t(), sa, sb, bias=_pad_to(bias.reshape(1, -1), 1, np_).reshape(-1) if fuse_bias else None,
                             out_dtype=mm_dtype, use_fast_accum=use_fast_accum)[:, :n]
        if bias is not None and not fuse_bias:
            y = y + bias.float()
    elif _scaled_mm_works(*key, False, torch.float32, False):
        one = torch.ones((), device=dev)
        y = torch._scaled_mm(a2, b2.t(), one, one, out_dtype=torch.float32, use_fast_accum=use_fast_accum)[:, :n]
        y = y * a_scale.float().reshape(-1, 1) * b_scale.float().reshape(1, -1)
        if bias is not None:
            y = y + bias.float()
    else:
        impl = _backend.get_impl(OP_GEMM, dev, "triton" if _backend.backend_status("triton", dev).available else "reference")
        return impl(a, b, a_scale, b_scale, out_dtype, bias, use_fast_accum)
    return y.to(out_dtype).contiguous()


# ----------------------------------------------------------------------------- backend choice


def _why_not_scaled_mm(device: torch.device, case) -> str | None:
    return None if scaled_mm_available(device) else "this torch has no float8 torch._scaled_mm for the device"


def _scaled_mm_slower(device: torch.device, case) -> str | None:
    if device.type != "cpu" or _cpu_scaled_mm_pays():
        return None
    return "measured slower than the dequantized float32 GEMM on this CPU (asked for by name it still runs)"


# torch._scaled_mm is the native GEMM of both device types (no extension of ours needed): "cpu" /
# "cuda" / "scaled_mm" ask for it; the automatic choice takes it first where it is not slower.
for _fam in ("cpu", "cuda"):
    _backend.register_impl(OP_GEMM, _fam, scaled_mm_gemm, name="scaled_mm", why_not=_why_not_scaled_mm,
                           auto=_scaled_mm_slower)


def _quant_impl(device: torch.device):
    return _backend.get_impl(OP_QUANT, device)


def _gemm_impl(device: torch.device):
    """The GEMM implementation for ``device``, chosen by ``titan_kernels.backend`` (torch._scaled_mm
    as the native one, else triton / reference)."""
    return _backend.get_impl(OP_GEMM, device)


def gemm_backend_name(device: torch.device | str) -> str:
    """The name of the GEMM implementation ``fp8_gemm`` would use now on ``device``
    ("scaled_mm", "triton" or "reference")."""
    return _backend.resolve(OP_GEMM, torch.device(device))


# ----------------------------------------------------------------------------- validation


def _name(dtype: object) -> str:
    return str(dtype).replace("torch.", "")


def _check_fp8_dtype(dtype: object, arg: str) -> None:
    if dtype not in FP8_DTYPES:
        raise TypeError(f"{arg}: expected torch.float8_e4m3fn or torch.float8_e5m2, got {_name(dtype)}")


def _check_bool(v: object, arg: str) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"{arg}: expected a bool, got {type(v).__name__}")
    return v


def _validate_quantize(x, dtype, granularity, round_scales_to_power_of_2) -> None:
    check_float(x, "x")
    _check_fp8_dtype(dtype, "dtype")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity: expected one of {GRANULARITIES}, got {granularity!r}")
    if granularity != "tensorwise" and x.dim() != 2:
        raise ValueError(
            f"x: {granularity} granularity expects a 2-D tensor (rows, cols), got shape {tuple(x.shape)}; "
            "reshape to 2-D first"
        )
    _check_bool(round_scales_to_power_of_2, "round_scales_to_power_of_2")


def _scale_kind(scale, arg: str, rows: int, rows_name: str) -> str:
    check_tensor(scale, arg)
    if scale.dtype != torch.float32:
        raise TypeError(f"{arg}: expected a float32 tensor, got {_name(scale.dtype)}")
    if scale.dim() <= 2 and scale.numel() == 1:
        return "tensorwise"
    if tuple(scale.shape) == (rows, 1):
        return "rowwise"
    raise ValueError(
        f"{arg}: expected shape () or (1,) (tensorwise) or ({rows}, 1) (rowwise, {rows_name} = {rows}), "
        f"got {tuple(scale.shape)}"
    )


def _validate_gemm(a, b, a_scale, b_scale, out_dtype, bias, use_fast_accum) -> None:
    for t, arg in ((a, "a"), (b, "b")):
        check_tensor(t, arg)
        _check_fp8_dtype(t.dtype, f"{arg} (dtype)")
        if t.dim() != 2:
            raise ValueError(f"{arg}: expected a 2-D tensor, got shape {tuple(t.shape)}")
    if b.shape[1] != a.shape[1]:
        raise ValueError(
            f"b: expected shape (N, K) with K = a.shape[1] = {a.shape[1]} (out = a @ b.T), got {tuple(b.shape)}"
        )
    _scale_kind(a_scale, "a_scale", a.shape[0], "M")
    _scale_kind(b_scale, "b_scale", b.shape[0], "N")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype: expected one of float32, bfloat16, float16, got {_name(out_dtype)}")
    if bias is not None:
        check_float(bias, "bias")
        if tuple(bias.shape) != (b.shape[0],):
            raise ValueError(f"bias: expected shape ({b.shape[0]},) (N), got {tuple(bias.shape)}")
    _check_bool(use_fast_accum, "use_fast_accum")
    check_same_device({"a": a, "b": b, "a_scale": a_scale, "b_scale": b_scale, "bias": bias})


def _validate_linear(x, weight, recipe) -> None:
    check_float(x, "x")
    check_float(weight, "weight")
    if x.dim() < 1:
        raise ValueError("x: expected at least 1 dimension (..., in_features), got a 0-d tensor")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"weight: expected shape (out_features, {x.shape[-1]}) to match the last dim of x, got {tuple(weight.shape)}"
        )
    if weight.dtype != x.dtype:
        raise TypeError(f"weight: expected dtype {_name(x.dtype)} (the dtype of x), got {_name(weight.dtype)}")
    if recipe not in RECIPES:
        raise ValueError(f"recipe: expected one of {RECIPES}, got {recipe!r}")
    check_same_device({"x": x, "weight": weight})


# ----------------------------------------------------------------------------- recipe math


def linear_fwd(x2: torch.Tensor, weight: torch.Tensor, recipe: str) -> torch.Tensor:
    """y (M, N) = x2 (M, K) @ weight (N, K)^T in float8 per ``recipe``, in x2.dtype."""
    quant, gemm = _quant_impl(x2.device)[0], _gemm_impl(x2.device)
    gran, pow2 = ("tensorwise", False) if recipe == "tensorwise" else ("rowwise", True)
    xq, xs = quant(x2, E4M3, gran, pow2)
    wq, ws = quant(weight, E4M3, gran, pow2)
    return gemm(xq, wq, xs, ws, x2.dtype, None, True)


def linear_bwd_prequantized(
    dy2: torch.Tensor, xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
    x_dtype: torch.dtype, w_dtype: torch.dtype, compute_dx: bool, compute_dweight: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Backward of the tensorwise recipe from tensorwise-quantized x (M, K) and W (N, K): dy is
    cast to e5m2 once and used by both GEMMs (its transpose needs no new scale).

    Goes through the public ops (eager fast path, or the custom ops when traced), so that it also
    runs inside a compiled autograd.Function (the FSDP2 float8 all-gather path of Float8Linear).
    """
    dyq, dys = fp8_quantize(dy2, dtype=E5M2)
    dx = fp8_gemm(dyq, wq.t(), dys, ws, out_dtype=x_dtype) if compute_dx else None
    dw = fp8_gemm(dyq.t(), xq.t(), dys, xs, out_dtype=w_dtype) if compute_dweight else None
    return dx, dw


def linear_bwd(
    dy2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, recipe: str, compute_dx: bool, compute_dweight: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dx (M, K) in x2.dtype, dW (N, K) in weight.dtype) per ``recipe``; None where not asked."""
    quant, gemm = _quant_impl(x2.device)[0], _gemm_impl(x2.device)
    if recipe == "tensorwise":
        xq, xs = quant(x2, E4M3, "tensorwise", False) if compute_dweight else (None, None)
        wq, ws = quant(weight, E4M3, "tensorwise", False) if compute_dx else (None, None)
        return linear_bwd_prequantized(dy2, xq, xs, wq, ws, x2.dtype, weight.dtype, compute_dx, compute_dweight)
    dx = dw = None
    if compute_dx:
        dyq, dys = quant(dy2, E4M3, "rowwise", True)
        if recipe == "rowwise":
            # Scales of W along N (its columns): colwise codes, whose transpose is row-major (K, N).
            wq, ws = quant(weight, E4M3, "colwise", True)
            dx = gemm(dyq, wq.t(), dys, ws.t(), x2.dtype, None, False)
        else:
            wq, ws = quant(weight, E4M3, "tensorwise", True)
            dx = gemm(dyq, wq.t(), dys, ws, x2.dtype, None, False)
    if compute_dweight:
        if recipe == "rowwise":
            # dW = dy^T x reduces over tokens (M): colwise scales for both.
            dyq, dys = quant(dy2, E4M3, "colwise", True)
            xq, xs = quant(x2, E4M3, "colwise", True)
            dw = gemm(dyq.t(), xq.t(), dys.t(), xs.t(), weight.dtype, None, False)
        else:
            dw = torch.mm(dy2.t(), x2).to(weight.dtype)
    return dx, dw


def _rows(t: torch.Tensor) -> torch.Tensor:
    # Explicit row count: reshape(-1, 0) is ambiguous for an empty last dim.
    return t.reshape(t.shape[:-1].numel(), t.shape[-1])


def _unflatten(t: torch.Tensor, lead: torch.Size, cols: int) -> torch.Tensor:
    # _unsafe_view (as aten.matmul does): the result is not tracked as a view of the 2-D GEMM
    # output, so callers may modify it in place (FSDP2 and autograd warn about returned views).
    return torch.ops.aten._unsafe_view(t, (*lead, cols))


# ----------------------------------------------------------------------------- ops


@torch.library.custom_op("titan::fp8_quantize", mutates_args=())
def fp8_quantize_op(
    x: torch.Tensor, dtype: torch.dtype, granularity: str, round_scales_to_power_of_2: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic float8 quantization; see ``fp8_quantize``. Returns (codes, scale)."""
    return _quant_impl(x.device)[0](x, dtype, granularity, round_scales_to_power_of_2)


@fp8_quantize_op.register_fake
def _(x, dtype, granularity, round_scales_to_power_of_2):
    if granularity == "colwise":
        codes = _ref.empty_colwise(x.shape[0], x.shape[1], dtype, x.device)
        return codes, x.new_empty((1, x.shape[1]), dtype=torch.float32)
    codes = torch.empty(x.shape, dtype=dtype, device=x.device)
    if granularity == "rowwise":
        return codes, x.new_empty((x.shape[0], 1), dtype=torch.float32)
    return codes, x.new_empty((), dtype=torch.float32)


@torch.library.custom_op("titan::fp8_gemm", mutates_args=())
def fp8_gemm_op(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    use_fast_accum: bool,
) -> torch.Tensor:
    """(a * a_scale) @ (b * b_scale)^T (+ bias); see ``fp8_gemm``. Returns a contiguous (M, N)."""
    return _gemm_impl(a.device)(a, b, a_scale, b_scale, out_dtype, bias, use_fast_accum)


@fp8_gemm_op.register_fake
def _(a, b, a_scale, b_scale, out_dtype, bias, use_fast_accum):
    return torch.empty((a.shape[0], b.shape[0]), dtype=out_dtype, device=a.device)


@torch.library.custom_op("titan::fp8_linear", mutates_args=())
def fp8_linear_op(x: torch.Tensor, weight: torch.Tensor, recipe: str) -> torch.Tensor:
    """y = x @ weight^T with float8 GEMMs per ``recipe``. x (..., K), weight (N, K) -> (..., N) in
    x.dtype, contiguous."""
    return _unflatten(linear_fwd(_rows(x), weight, recipe), x.shape[:-1], weight.shape[0])


@fp8_linear_op.register_fake
def _(x, weight, recipe):
    return torch.empty((*x.shape[:-1], weight.shape[0]), dtype=x.dtype, device=x.device)


@torch.library.custom_op("titan::fp8_linear_backward", mutates_args=())
def fp8_linear_backward_op(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, recipe: str, compute_dx: bool, compute_dweight: bool,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of fp8_linear. dy (..., N), x (..., K), weight (N, K). Returns dx (..., K) in
    x.dtype and dW (N, K) in weight.dtype, each contiguous; a gradient whose ``compute_*`` flag is
    False comes back empty with its last dim 0 ((..., 0) and (N, 0)), a placeholder of the same
    rank, so that every DTensor placement of the real gradient is valid for it too. ``backend``:
    the backend request in force when the forward ran (None: the one in force now)."""
    return _linear_backward(dy, x, weight, recipe, compute_dx, compute_dweight, backend)


@fp8_linear_backward_op.register_fake
def _(dy, x, weight, recipe, compute_dx, compute_dweight, backend=None):
    dx = x.new_empty((*x.shape[:-1], x.shape[-1] if compute_dx else 0))
    dw = weight.new_empty((weight.shape[0], weight.shape[1] if compute_dweight else 0))
    return dx, dw


# ----------------------------------------------------------------------------- the one autograd definition
# The eager fast path (``_Fp8LinearFn``) and the op path (``register_autograd``) save with ``_save`` and
# differentiate with ``_grads``; the backward's quantize and GEMM kernels run under the backend
# request captured when the forward ran (``request_context``), whichever path ran.


def request_context(request: str | None):
    """A context in which the titan ops see ``request`` (a backend name, "" for automatic, None:
    leave the current request as it is)."""
    if request is None:
        return contextlib.nullcontext()
    if request == "":
        return _backend.automatic()
    return _backend.use_backend(request)


def refuse_double_backward(op: str, *tensors) -> None:
    """Raise when a backward runs with ``create_graph=True`` through an op whose backward has no
    derivative (the float8 casts are not differentiable)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError(f"titan::{op}: double backward (create_graph=True through a float8 linear) is not "
                           "supported; its float8 casts are not differentiable")


def _linear_backward(dy, x, weight, recipe, compute_dx, compute_dweight, request):
    with request_context(request):
        dx, dw = linear_bwd(_rows(dy), _rows(x), weight, recipe, compute_dx, compute_dweight)
    dx = _unflatten(dx, x.shape[:-1], x.shape[-1]) if dx is not None else x.new_empty((*x.shape[:-1], 0))
    dw = dw if dw is not None else weight.new_empty((weight.shape[0], 0))
    return dx, dw


def _save(ctx, x, weight, recipe, request):
    ctx.save_for_backward(x, weight)
    ctx.recipe, ctx.request = recipe, request


def _grads(ctx, dy, through_op: bool):
    x, weight = ctx.saved_tensors
    refuse_double_backward("fp8_linear", dy, x, weight)
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if through_op:
        dx, dw = torch.ops.titan.fp8_linear_backward(dy, x, weight, ctx.recipe, need_dx, need_dw, ctx.request)
    else:
        dx, dw = _linear_backward(dy, x, weight, ctx.recipe, need_dx, need_dw, ctx.request)
    return (dx if need_dx else None), (dw if need_dw else None), None


def _setup_fp8_linear(ctx, inputs, output):
    x, weight, recipe = inputs
    # Under torch.compile the request cannot be traced: the backward reads the one in force then.
    request = None if torch.compiler.is_compiling() else (_backend.requested_backend() or "")
    _save(ctx, x, weight, recipe, request)


def _backward_fp8_linear(ctx, dy):
    return _grads(ctx, dy, through_op=True)


fp8_linear_op.register_autograd(_backward_fp8_linear, setup_context=_setup_fp8_linear)


class _Fp8LinearFn(torch.autograd.Function):
    """The eager fast path: the same forward, ``_save`` and ``_grads`` as the op, without the dispatcher."""

    @staticmethod
    def forward(ctx, x, weight, recipe):
        _save(ctx, x, weight, recipe, _backend.requested_backend() or "")
        return _unflatten(linear_fwd(_rows(x), weight, recipe), x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        return _grads(ctx, dy, through_op=False)


# ----------------------------------------------------------------------------- public API


def fp8_quantize(
    x: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float8_e4m3fn,
    granularity: str = "tensorwise",
    round_scales_to_power_of_2: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic float8 quantization: amax, scale and saturated cast fused (one kernel per pass).

    Args:
        x: float32 / bfloat16 / float16, any strides; any shape for "tensorwise", 2-D (rows, cols)
            for "rowwise" and "colwise"; zero-size allowed.
        dtype: torch.float8_e4m3fn (max 448) or torch.float8_e5m2 (max 57344).
        granularity: "tensorwise" (one scale), "rowwise" (one per row, over the last dim) or
            "colwise" (one per column).
        round_scales_to_power_of_2: round the scale up to a power of two (the cast multiplier
            down), so that scaling is exact in any precision.

    Returns:
        (x_fp8, scale): x_fp8 in ``dtype`` with x's shape (contiguous; column-major for "colwise",
        so that ``x_fp8.t()`` is row-major), and ``scale`` float32 of shape () / (rows, 1) /
        (1, cols), with ``x ~= x_fp8.float() * scale``. scale = max(amax, 1e-12) / fp8_max, so an
        all-zero tensor or row gets a finite positive scale and zero codes; values beyond the
        range saturate to +-fp8_max. NaN in a group makes its scale NaN. Not differentiable.

    Raises:
        TypeError: x not a float32/bf16/fp16 tensor (e.g. an int tensor), dtype not float8,
            round_scales_to_power_of_2 not a bool.
        ValueError: unknown granularity; rowwise/colwise on a tensor that is not 2-D.

    Source: Micikevicius et al. 2022, "FP8 Formats for Deep Learning", section 4; torchao.float8
    (``reference.fp8`` has the exact formulas).
    """
    _validate_quantize(x, dtype, granularity, round_scales_to_power_of_2)
    x = x.detach()
    if eager_fast_path(x):
        return _quant_impl(x.device)[0](x, dtype, granularity, round_scales_to_power_of_2)
    return torch.ops.titan.fp8_quantize(x, dtype, granularity, round_scales_to_power_of_2)


def fp8_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """Scaled float8 GEMM in the layout of ``nn.Linear``: ``(a * a_scale) @ (b * b_scale).T + bias``.

    Args:
        a: (M, K) float8_e4m3fn / float8_e5m2, any strides, any M (zero included).
        b: (N, K) float8, any strides (e.g. ``weight_fp8`` for y = x W^T, or ``codes.t()``).
        a_scale: float32, () / (1,) (tensorwise) or (M, 1) (rowwise): dequantization scales, as
            returned by ``fp8_quantize``.
        b_scale: float32, () / (1,) or (N, 1). A tensorwise scale may face a rowwise one.
        out_dtype: float32, bfloat16 or float16.
        bias: (N,) float tensor or None, added in float32 before the final rounding.
        use_fast_accum: let Hopper tensor cores accumulate in their reduced precision for the
            whole K loop (faster, slightly less accurate).

    Returns:
        (M, N) contiguous tensor in ``out_dtype``, accumulated in float32. K or N that a backend
        cannot take (``torch._scaled_mm`` wants multiples of 16) are zero-padded, which leaves the
        result unchanged. Not differentiable (use ``fp8_linear`` / ``Float8Linear`` for training).

    Raises:
        TypeError: a or b not float8, a scale not float32, out_dtype not float32/bf16/fp16.
        ValueError: a or b not 2-D, K of b != K of a, a scale shape that fits neither granularity,
            bias shape != (N,), mixed devices.
        RuntimeError: the requested backend cannot run on the device.

    Source: the scaled-matmul contract of ``torch._scaled_mm`` with torchao's dequantization-scale
    convention; Micikevicius et al. 2022.
    """
    _validate_gemm(a, b, a_scale, b_scale, out_dtype, bias, use_fast_accum)
    if bias is not None:
        bias = bias.detach()
    if eager_fast_path(a, b, a_scale, b_scale, bias):
        return _gemm_impl(a.device)(a, b, a_scale, b_scale, out_dtype, bias, use_fast_accum)
    return torch.ops.titan.fp8_gemm(a, b, a_scale, b_scale, out_dtype, bias, use_fast_accum)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, recipe: str = "tensorwise") -> torch.Tensor:
    """``x @ weight.T`` with its forward, grad_input and grad_weight GEMMs in float8 per ``recipe``.

    Args:
        x: (..., K) float32 / bfloat16 / float16.
        weight: (N, K), the same dtype as x.
        recipe: "tensorwise", "rowwise" or "rowwise_with_gw_hp" (torchao's meanings; see the
            module docstring for the dtype and scaling of each GEMM).

    Returns:
        (..., N) in x.dtype. Differentiable in x and weight (dx in x.dtype, dW in weight.dtype).

    Raises:
        TypeError: x or weight not float32/bf16/fp16, or their dtypes differ.
        ValueError: weight not (N, K) with K = x.shape[-1], unknown recipe, mixed devices.

    Source: torchao.float8 recipes; Micikevicius et al. 2022, section 4.
    """
    _validate_linear(x, weight, recipe)
    if eager_fast_path(x, weight):
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            return _Fp8LinearFn.apply(x, weight, recipe)
        return _unflatten(linear_fwd(_rows(x), weight, recipe), x.shape[:-1], weight.shape[0])
    return torch.ops.titan.fp8_linear(x, weight, recipe)


def tensorwise_amax(x: torch.Tensor) -> torch.Tensor:
    """max(|x|) of a float tensor as a float32 () tensor, on the selected quantize backend."""
    return _quant_impl(x.device)[1](x)


def fp8_quantize_from_amax(
    x: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype = E4M3, round_scales_to_power_of_2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tensorwise quantization with a known amax (e.g. all-reduced over the shards of a weight):
    the same codes and scale as ``fp8_quantize`` of the full tensor whose amax it is."""
    return _quant_impl(x.device)[2](x, amax, dtype, round_scales_to_power_of_2)
