"""Float8 rowwise grouped GEMM over experts: ``torch.ops.titan.fp8_grouped_mm`` and its backward
``torch.ops.titan.fp8_grouped_mm_backward``.

The layout of ``titan_kernels.grouped_mm``: x (T, K) tokens sorted by expert, w (E, K, N), offsets
(E,) int32 cumulative group ends; y[group e] = x[group e] @ w[e], rows past offsets[E-1] zero. Each
GEMM runs on e4m3 codes with one power-of-two scale per row or column along its reduction dim,
float32 accumulation, the scales applied to the float32 result (math and layouts:
``titan_kernels.reference.fp8_grouped_mm``):

  GEMM                   left operand                         right operand
  forward  y = x w       x rowwise (per token, over K)        w per (expert, column n), over K
  dgrad   dx = dy w^T    dy rowwise (per token, over N)       w per (expert, row k), over N
  wgrad   dw = x^T dy    x per (expert, column k) over the    dy per (expert, column n) over the
                         expert's tokens                      expert's tokens
Recipes (``RECIPES``, names of the dense float8 recipes, ``titan_kernels.ops.fp8.config``): ``rowwise``,
all three GEMMs in float8 (torchao's float8 rowwise MoE training recipe); ``rowwise_with_gw_hp``, the
weight gradient in high precision through ``titan_kernels.grouped_mm``. Every float8 operand here is
scaled axiswise as in the table above (a tensorwise weight in dgrad would not factor out of a grouped
tile any better), so the op takes one thing from the recipe's config: whether its grad_weight GEMM
is in high precision. The backward re-quantizes from the
high-precision x and w saved by the forward (each GEMM needs its own scaling axis), so the op keeps
the memory of the bf16 grouped GEMM.

Why ``rowwise`` quantizes the weight gradient too: its reduction runs over a group's tokens, and a
scale per (expert, column) taken over exactly those tokens bounds each code's relative error as
rowwise scaling does elsewhere: measured on Gaussian operands (groups of 64 to 512 tokens, K 256 to
768), y, dx and dw each come within 3.7-3.8% (relative norm) of the float64 product, dw no worse
than dx (tests/kernels/test_fp8_grouped_mm.py checks it). The places that need care are handled here rather than refused: groups of
any size (empty included) and unaligned groups, for ``torch._scaled_grouped_mm``'s 2-D x 2-D form,
which CUTLASS asserts on the device for an empty group or a group not a multiple of 16 tokens (we
pad every group on the device to a multiple of 16, at least 16, no host sync). Where the weight
gradient's precision is in doubt, ``rowwise_with_gw_hp`` costs one bf16 GEMM of three.

Backends (``BACKENDS``, registered as grouped_mm's: ``titan_kernels.ops.grouped_gemm``), chosen once per
(device, dtype, K, N) key and cached:
  aten       ``torch._scaled_grouped_mm`` (CUTLASS, CUDA sm_90; not on the CPU: torch 2.13 has no CPU
             kernel). It takes e4m3 operands with bfloat16 output only, so x must be bfloat16; K and N
             are zero-padded to multiples of 16 (its 16-byte strides), the token groups of the weight
             gradient too. Whether it runs is probed once per device with tiny calls of the three
             forms and the refusal kept as the reason. The quantizers are the Triton ones where
             Triton runs on the device, else the reference ones (bit-identical codes and scales).
  triton     ours (``titan_kernels.triton.fp8_grouped_mm``): float8 tiles through the persistent
             tile queue of our grouped GEMM, the scales in the epilogue; any K/N, float32/bf16/fp16
             output. CPU only under TRITON_INTERPRET=1 (tests).
  reference  dequantize to float32, one matmul per group (a host loop over the offsets).
Automatic choice (``ORDER``): CPU reference. CUDA: aten > triton > reference, and when aten and triton both take
a key the first call of that key times both (``measured_order``; TITAN_KERNELS_GROUPED_MM_MEASURE=0
keeps the static order). Overrides: ``use_backend`` / ``TITAN_KERNELS_BACKEND`` with "reference",
"triton" or "cpu"/"cuda" (aten's kernel of that device); a requested backend that cannot take the
case raises RuntimeError with the reason. ``rowwise_with_gw_hp``'s weight gradient runs on
grouped_mm's backend of the same name where it takes the key, else on grouped_mm's automatic choice.

Built by the op scaffold, as ``grouped_mm`` (whose backend registration, choice and timing it
shares through ``grouped_gemm``): one autograd definition for the op path and the eager fast path, the forward's request
handed to the backward op. Double backward is refused with a RuntimeError naming the op.
DTensor rules: grouped_mm's (tensor parallel on the experts), without Partial inputs.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch

from titan_kernels import backend as _backend
from titan_kernels.ops import grouped_gemm as _gg
from titan_kernels.ops import grouped_mm as _gmm
from titan_kernels.ops._common import FLOAT_DTYPES, check_float, dtype_name, refuse_create_graph
from titan_kernels.ops._scaffold import Op
from titan_kernels.ops.fp8.config import RECIPES as LINEAR_RECIPES
from titan_kernels.reference import fp8_grouped_mm as _ref

OP = "fp8_grouped_mm"
fp8_grouped_mm_def = Op(OP)
BACKENDS = ("aten", "triton", "reference")
ORDER = {"cuda": ("aten", "triton", "reference"), "cpu": ("reference",)}
RECIPES = ("rowwise", "rowwise_with_gw_hp")  # the recipes implemented here (axiswise, as above)
E4M3 = torch.float8_e4m3fn
ALIGN = 16  # torch._scaled_grouped_mm: 16-byte strides (K, N) and token groups (the weight gradient)


class Kernels(NamedTuple):
    """One backend's quantizers and scaled grouped GEMMs (contracts: ``reference.fp8_grouped_mm``)."""

    rows: Callable
    w_fwd: Callable
    w_dgrad: Callable
    group_cols: Callable
    gmm: Callable
    gmm_dw: Callable


# ----------------------------------------------------------------------------- torch._scaled_grouped_mm


def _ceil(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _padded_fp8(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A contiguous zero e4m3 tensor of ``shape`` holding ``t`` in its leading corner."""
    if tuple(t.shape) == shape and t.is_contiguous():
        return t
    out = torch.zeros(shape, dtype=E4M3, device=t.device)
    out[tuple(slice(0, s) for s in t.shape)] = t
    return out


def aten_gmm(a, sa, b, sb, offsets, out_dtype: torch.dtype) -> torch.Tensor:
    """``reference.fp8_grouped_mm.gmm`` on ``torch._scaled_grouped_mm`` (2-D x 3-D form): a row-major,
    each expert of b column-major, K and N zero-padded to multiples of 16 (zeros add nothing; the
    padded columns are cut off), scale_a (T,), scale_b (E, N); bfloat16 out, rows past the last group
    zeroed (aten leaves them uninitialized, as torch._grouped_mm does)."""
    t, kc = a.shape
    e, _, n = b.shape
    kp, np_ = _ceil(kc), _ceil(n)
    a2 = _padded_fp8(a, (t, kp))
    b2 = _padded_fp8(b.transpose(1, 2), (e, np_, kp)).transpose(1, 2)  # (E, kp, np_), column-major
    sb2 = sb.float()
    if np_ != n:
        sb2 = torch.ones((e, np_), dtype=torch.float32, device=sb.device)
        sb2[:, :n] = sb
    y = torch._scaled_grouped_mm(a2, b2, sa.float().reshape(-1).contiguous(), sb2.contiguous(), offs=offsets,
                                 out_dtype=torch.bfloat16)
    if np_ != n:
        y = y[:, :n].contiguous()
    return _gg.zero_tail(y, offsets).to(out_dtype)


def padded_groups(offsets: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Token groups padded for the weight gradient's 2-D x 2-D form, on the device (no host sync):
    every group to a multiple of 16 rows and at least 16 (CUTLASS asserts on an empty group), so
    (dest (T,) int64 the padded row of each row, padded offsets (E,) int32, padded row count). Rows
    past the last group go after the last padded group, where no group reads them."""
    e = offsets.shape[0]
    ends = offsets.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    padded = ((ends - starts + ALIGN - 1) // ALIGN * ALIGN).clamp_min(ALIGN)
    pends = torch.cumsum(padded, 0)
    r = torch.arange(t, device=offsets.device)
    gid = _ref.group_ids(offsets, t)
    g = gid.clamp_max(e - 1)
    dest = torch.where(gid < e, (pends - padded)[g] + r - starts[g], pends[-1] + r - ends[-1])
    # Each padded group is at most 16 rows longer than the group: T + 16 E rows hold every row.
    return dest, pends.to(torch.int32), _ceil(t) + ALIGN * e


def aten_gmm_dw(a, sa, b, sb, offsets, out_dtype: torch.dtype) -> torch.Tensor:
    """``reference.fp8_grouped_mm.gmm_dw`` on ``torch._scaled_grouped_mm`` (2-D x 2-D form): the
    tokens of a (T, Kd) and b (T, Nd) copied (1 byte each) into zero-padded groups, a^T row-major
    (Kd, T') and b column-major (T', Nd); scales flattened per group (E*Kd,), (E*Nd,)."""
    t = a.shape[0]
    dest, pad_offsets, tp = padded_groups(offsets, t)

    def spread(codes):  # (T, C) -> (C, T') uint8 row-major, rows of codes at their padded columns
        out = torch.zeros((codes.shape[1], tp), dtype=torch.uint8, device=codes.device)
        return out.index_copy_(1, dest, codes.t().view(torch.uint8))

    at, bt = spread(a).view(E4M3), spread(b).view(E4M3)
    dw = torch._scaled_grouped_mm(at, bt.t(), sa.float().reshape(-1).contiguous(), sb.float().reshape(-1).contiguous(),
                                  offs=pad_offsets, out_dtype=torch.bfloat16)
    return dw.to(out_dtype).contiguous()


@functools.lru_cache(maxsize=None)
def aten_why_not(device_type: str, index: int | None) -> str | None:
    """None when torch._scaled_grouped_mm runs the three forms on this device (asked once, by tiny
    calls), else the reason."""
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    if device_type == "cuda" and not torch.cuda.is_available():
        return "no CUDA device is visible"
    dev = torch.device(device_type, index) if index is not None else torch.device(device_type)
    try:
        offs = torch.tensor([16, 32], dtype=torch.int32, device=dev)
        a = torch.zeros(32, 16, device=dev).to(E4M3)
        b = torch.zeros(2, 16, 16, device=dev).to(E4M3).transpose(1, 2)
        one_a, one_b = torch.ones(32, device=dev), torch.ones(2, 16, device=dev)
        aten_gmm(a, one_a, b, one_b, offs, torch.bfloat16)
        aten_gmm_dw(a, one_b, a, one_b, offs, torch.bfloat16)
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
        return f"torch._scaled_grouped_mm refuses it: {str(e).splitlines()[0][:200]}"
    return None


# ----------------------------------------------------------------------------- backends


def _quantizers(t: torch.Tensor) -> Kernels:
    """The quantizers aten's GEMMs take: the Triton ones where Triton runs on t's device, else the
    reference ones (bit-identical codes and scales)."""
    name = "triton" if _backend.backend_status("triton", t.device).available else "reference"
    return _backend.implementation(OP, name).kernels


def _aten_quantizer(field: str) -> Callable:
    def quantize(t, *args):
        return getattr(_quantizers(t), field)(t, *args)

    quantize.__name__ = f"aten_{field}"
    return quantize


def _triton_kernels() -> Kernels:
    # Imported at the first call (LazyKernel); without triton the family says why (backend_status).
    module = "titan_kernels.triton.fp8_grouped_mm"
    return Kernels(*(_backend.LazyKernel(module, n) for n in Kernels._fields))


_IMPLS = {
    "aten": Kernels(*map(_aten_quantizer, ("rows", "w_fwd", "w_dgrad", "group_cols")), aten_gmm, aten_gmm_dw),
    "triton": _triton_kernels(),
    "reference": Kernels(_ref.rows, _ref.w_fwd, _ref.w_dgrad, _ref.group_cols, _ref.gmm, _ref.gmm_dw),
}


@functools.lru_cache(maxsize=None)
def why_not(name: str, device_type: str, index: int | None, dtype: torch.dtype) -> str | None:
    """None when backend ``name`` takes fp8_grouped_mm for this key, else the reason (asked once per key)."""
    if name == "reference":
        return None
    if name == "triton":
        return _gg.triton_why_not(device_type, "titan_kernels.triton.fp8_grouped_mm")
    assert name == "aten", name
    if dtype != torch.bfloat16:
        return f"torch._scaled_grouped_mm writes bfloat16 only; x is {dtype_name(dtype)}"
    return aten_why_not(device_type, index)


@functools.lru_cache(maxsize=None)
def measured_order(cands: tuple[str, ...], device_type: str, index: int | None, dtype: torch.dtype, k: int,
                   n: int) -> tuple[str, ...]:
    """``cands`` fastest first, timed once per key on 16 experts of 512 rows, forward, dx and dw
    (recipe rowwise): ``grouped_mm.time_order``."""
    def kernels(name):
        return _backend.implementation(OP, name, device_type).kernels

    return _gg.time_order(cands, device_type, index, dtype, k, n,
                           lambda x, w, offs, name: _forward(kernels(name), x, w, offs),
                           lambda dy, x, w, offs, name: _backward(kernels(name), name, dy, x, w, offs, "rowwise",
                                                                  True, True))


# As grouped_mm's (``grouped_gemm.register_backends``): aten in the cpu and cuda families, triton,
# reference; the op's ORDER, measured on CUDA. The case key is (dtype, K, N); capabilities depend on
# the dtype alone.
_gg.register_backends(fp8_grouped_mm_def, _IMPLS,
                      lambda name, device_type, index, dtype, *_: why_not(name, device_type, index, dtype),
                      ORDER, measured_order)


def backend_for(x: torch.Tensor, w: torch.Tensor) -> tuple[str, dict[str, str]]:
    """(the backend fp8_grouped_mm(x, w, ...) would run, {skipped backend: reason}) under the current request."""
    return _gg.backend_report(OP, x, w)


# ----------------------------------------------------------------------------- validation


def _validate(x, w, offsets, recipe) -> None:
    check_float(x, "x", FLOAT_DTYPES)
    _gg.validate_layout(x, w, offsets, FLOAT_DTYPES)  # ranks, shapes, w's dtype, offsets int32 (E,), devices
    if recipe not in RECIPES:
        raise ValueError(f"recipe: expected one of {RECIPES}, got {recipe!r}")


# ----------------------------------------------------------------------------- the op


def _empty(x, w) -> bool:
    return x.shape[0] == 0 or x.shape[1] == 0 or w.shape[2] == 0


def _forward(k: Kernels, x, w, offsets) -> torch.Tensor:
    if _empty(x, w):  # nothing to quantize: an empty sum (or no rows / columns)
        return x.new_zeros((x.shape[0], w.shape[2]))
    xq, sx = k.rows(x)
    wq, sw = k.w_fwd(w)
    return k.gmm(xq, sx, wq, sw, offsets, x.dtype)


def _high_precision_dw(dy, x, w, offsets, name: str) -> torch.Tensor:
    """dw through grouped_mm: on its implementation of the same name where that takes the key, else
    on its automatic choice."""
    d = x.device
    key = _gg.case_key(x, w)
    request = name if _gmm.why_not(name, d.type, d.index, *key) is None else _backend.AUTO
    return _gmm.grouped_mm_def.kernels(d, request, key).backward(dy, x, w, offsets, False, True)[1]


def _backward(k: Kernels, name: str, dy, x, w, offsets, recipe: str, need_dx: bool, need_dw: bool):
    dx = dw = None
    empty = _empty(x, w)
    if need_dx:
        if empty:
            dx = x.new_zeros(x.shape)
        else:
            dyq, sdy = k.rows(dy)
            wq, sw = k.w_dgrad(w)
            dx = k.gmm(dyq, sdy, wq.transpose(1, 2), sw, offsets, x.dtype)
    if need_dw:
        if empty:
            dw = w.new_zeros(w.shape)
        elif LINEAR_RECIPES[recipe].cast_config_input_for_grad_weight.high_precision:
            dw = _high_precision_dw(dy, x, w, offsets, name)
        else:
            xq, sx = k.group_cols(x, offsets)
            dyq, sdy = k.group_cols(dy, offsets)
            dw = k.gmm_dw(xq, sx, dyq, sdy, offsets, w.dtype)
    return dx, dw


def forward(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, recipe: str,
            backend: str | None = None) -> torch.Tensor:
    """y (T, N) in x.dtype: y[group e] = x[group e] @ w[e] with float8 rowwise operands, rows past
    offsets[-1] zero. ``backend``: the request (None: the one in force). See
    ``titan_kernels.fp8_grouped_mm``."""
    return _forward(fp8_grouped_mm_def.kernels(x.device, backend, _gg.case_key(x, w)), x, w, offsets)


def backward(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, recipe: str,
             need_dx: bool, need_dw: bool, backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of titan::fp8_grouped_mm: dx (T, K) in x.dtype (float8 dgrad, rows past the last
    group zero) and dw (E, K, N) in w.dtype (float8 wgrad for ``rowwise``, high precision for
    ``rowwise_with_gw_hp``; zero for an empty group). A gradient not asked for comes back as an
    empty (T, 0) / (E, K, 0) tensor. ``backend``: the forward's request."""
    choice = _backend.choose(OP, x.device, _gg.case_key(x, w), backend=backend)
    dx, dw = _backward(choice.kernels, choice.backend, dy, x, w, offsets, recipe, need_dx, need_dw)
    return _gg.grads_or_empty(dx, dw, x, w)


def _setup(ctx, inputs, output):
    _gg.save_operands(ctx, inputs, output)
    ctx.recipe = inputs[3]


def _grads(ctx, dy):
    x, w, offsets = ctx.saved_tensors
    refuse_create_graph(OP, dy, x, w, why="; its float8 casts are not differentiable")
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dx, dw = fp8_grouped_mm_def.backward(dy, x, w, offsets, ctx.recipe, need_dx, need_dw, ctx.backend)
    return (dx if need_dx else None), (dw if need_dw else None), None, None


fp8_grouped_mm_def.define(
    forward, lambda x, w, offsets, recipe, backend=None: x.new_empty((x.shape[0], w.shape[2])),
    setup=_setup, grads=_grads, backward=backward,
    backward_fake=lambda dy, x, w, offsets, recipe, need_dx, need_dw, backend=None: _gg.fake_grads(
        x, w, need_dx, need_dw),
    # grouped_mm's rules (its module says why), without taking a Partial input.
    sharding=lambda x, w, offsets, *rest: _gg.sharding_rules(len(rest), linear=False),
    backward_sharding=lambda dy, x, w, offsets, *rest: _gg.backward_sharding_rules(len(rest)))


# ----------------------------------------------------------------------------- public API


def fp8_grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, *, recipe: str = "rowwise") -> torch.Tensor:
    """Float8 grouped GEMM over experts: ``y[group e] = x[group e] @ w[e]`` with e4m3 operands.

    x is quantized per token row and w per (expert, output column), both over K, with power-of-two
    scales; the GEMM accumulates the codes in float32 and applies both scales to the result, which is
    rounded once to x.dtype. The backward quantizes along each gradient GEMM's own reduction dim (see
    the module docstring, and ``recipe``).

    Args:
        x: (T, K) tokens sorted by expert, float32/bfloat16/float16; T = 0 allowed.
        w: (E, K, N) expert weights of x's dtype, any strides.
        offsets: (E,) int32 cumulative group ends: group e is rows [offsets[e-1], offsets[e]) with
            offsets[-1] = 0 before the first; non-decreasing, offsets[E-1] <= T; empty groups allowed.
            No alignment of K, N or the groups is needed (backends that want it pad).
        recipe: "rowwise" (dx and dw in float8 too) or "rowwise_with_gw_hp" (dw in high precision).

    Returns:
        (T, N) in x.dtype; rows >= offsets[E-1] are zero. Differentiable in x and w (dx in x.dtype,
        dw in w.dtype). Accuracy against the unquantized product: float8 e4m3, about 3.7% relative
        norm error on Gaussian operands (the team's tolerance 7e-2); against the product of the dequantized operands: float32
        accumulation, then the output rounding.

    Raises:
        TypeError: x not float32/bf16/fp16, w of another dtype, offsets not int32.
        ValueError: wrong ranks or shapes, no experts, mixed devices, unknown recipe, offsets not
            non-decreasing in [0, T] (checked in eager mode on CPU, where it costs no device sync).
        RuntimeError: a requested backend cannot take the case (the reason is given, e.g.
            torch._scaled_grouped_mm on the CPU or with a float32 x), or create_graph=True through the
            backward (double backward is not implemented).

    Source: dynamic float8 scaling (Micikevicius et al. 2022, "FP8 Formats for Deep Learning",
    section 4) along each GEMM's reduction dim, as in torchao's float8 rowwise MoE training and
    DeepSeek-V3 (2024, section 3.3: fine-grained scaling, float32 promotion of tensor-core sums).
    """
    _validate(x, w, offsets, recipe)
    return fp8_grouped_mm_def(x, w, _gg.prepare_offsets(x, w, offsets), recipe)
