"""The float8 training GEMMs of a linear layer: ``torch.ops.titan.fp8_linear`` (y = x W^T) and its
backward ``torch.ops.titan.fp8_linear_backward``, their one autograd definition and the public
``fp8_linear``, built on ``fp8_quantize`` / ``fp8_gemm``.

Math: dynamic scaling as in Micikevicius et al. 2022, "FP8 Formats for Deep Learning" (section 4)
and torchao.float8, whose training recipes keep their names and meanings here. A recipe is data, a
``Float8LinearConfig`` of ``titan_kernels.ops.fp8.config.RECIPES``, read once into ``PLANS`` (each
GEMM's casts as ``fp8_quantize`` calls), which ``Operands.gemm`` runs. The named recipes give:

  recipe               forward y = x W^T        grad_input dx = dy W          grad_weight dW = dy^T x
  tensorwise           x, W e4m3 tensorwise     dy e5m2 tensorwise, W e4m3    dy e5m2, x e4m3 (tensorwise)
  rowwise              x, W e4m3 rowwise        dy e4m3 rowwise, W e4m3 colw. dy, x e4m3 colwise
  rowwise_with_gw_hp   x, W e4m3 rowwise        dy e4m3 rowwise, W e4m3 tensorwise   high precision

Every axiswise scale is taken along the reduction dim of its GEMM; the rowwise recipes round scales
down to powers of two, as torchao does. The forward GEMM uses fast accumulation, the gradient GEMMs
do not (torchao's defaults). A cast two GEMMs share (dy of the tensorwise recipe) is made once. The
backward re-quantizes x and W from the high-precision tensors saved by the forward (the same memory
as a bf16 Linear; the same codes as the forward). The op is built by the op scaffold as a composite
op (its kernels are fp8_quantize's and fp8_gemm's): the forward captures the backend request as it
is, and both bodies run their kernels under it (``request_scope``), whichever path ran.

Under DTensor, ``fp8_linear`` runs on local shards (the rules below): each
shard is scaled on its own (per-shard amax), which is exact dequantized math for that shard; the
result matches the unsharded one to fp8 accuracy, not bit for bit.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from titan_kernels import backend as _backend
from titan_kernels.ops._common import check_float, check_same_device, dtype_name, refuse_create_graph
from titan_kernels.ops._scaffold import Op
import titan_kernels.ops.fp8.gemm as _gemm
import titan_kernels.ops.fp8.quantize as _quantize
from titan_kernels.ops.fp8.config import (
    GRAD_INPUT, GRAD_WEIGHT, OUTPUT, RECIPES, TENSORWISE, CastConfig, Float8LinearConfig, GemmSpec,
)
from titan_kernels.ops.fp8.gemm import fp8_gemm
from titan_kernels.ops.fp8.quantize import fp8_quantize

OP = "fp8_linear"
fp8_linear_def = Op(OP, composite=True)


# ----------------------------------------------------------------------------- validation


def _validate(x, weight, recipe) -> None:
    check_float(x, "x")
    check_float(weight, "weight")
    if x.dim() < 1:
        raise ValueError("x: expected at least 1 dimension (..., in_features), got a 0-d tensor")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"weight: expected shape (out_features, {x.shape[-1]}) to match the last dim of x, got {tuple(weight.shape)}"
        )
    if weight.dtype != x.dtype:
        raise TypeError(f"weight: expected dtype {dtype_name(x.dtype)} (the dtype of x), got {dtype_name(weight.dtype)}")
    if recipe not in RECIPES:
        raise ValueError(f"recipe: expected one of {tuple(RECIPES)}, got {recipe!r}")
    check_same_device({"x": x, "weight": weight})


# ----------------------------------------------------------------------------- the GEMMs of a config


class Kernels(NamedTuple):
    """The quantize and GEMM functions the GEMMs call, in the backends' argument order
    (``titan_kernels.reference.fp8``)."""

    quantize: Callable  # (x, dtype, granularity, round_scales_to_power_of_2) -> (codes, scale)
    gemm: Callable  # (a, b, a_scale, b_scale, out_dtype, bias, use_fast_accum) -> out


def backend_kernels(device: torch.device) -> Kernels:
    """The chosen backends' functions, called directly (inside the ops' implementations)."""
    return Kernels(_quantize.kernels(device).quantize, _gemm.kernel(device))


# Through the public functions (eager fast path, or the custom ops when traced): for autograd
# Functions that torch.compile traces (the FSDP2 float8 all-gather path of Float8Linear).
PUBLIC_KERNELS = Kernels(
    lambda x, dtype, gran, pow2: fp8_quantize(x, dtype=dtype, granularity=gran, round_scales_to_power_of_2=pow2),
    lambda a, b, sa, sb, out_dtype, bias, fast: fp8_gemm(a, b, sa, sb, out_dtype=out_dtype, bias=bias,
                                                         use_fast_accum=fast),
)

class Cast(NamedTuple):
    """One float8 cast of a layer tensor ("input" x (M, K), "weight" W (N, K), "grad_output" dy
    (M, N)) as ``fp8_quantize`` makes it; also its identity: GEMMs needing equal casts share one."""

    tensor: str
    dtype: torch.dtype | None  # None: high precision, no cast
    granularity: str  # fp8_quantize's: "tensorwise", "rowwise" or "colwise"
    round_scales_to_power_of_2: bool


class GemmPlan(NamedTuple):
    """One GEMM, out = left @ right^T (``fp8_gemm``'s layout), from a config: each operand's cast and
    whether it is transposed (the GEMM reduces over the tensor's dim 0), and the GEMM option."""

    left: Cast
    left_t: bool
    right: Cast
    right_t: bool
    use_fast_accum: bool


def _operand(config: Float8LinearConfig, tensor: str, cast: CastConfig, reduce_dim: int) -> tuple[Cast, bool]:
    # An axiswise scale runs along the reduced dim: per row for dim 1, per column for dim 0 (colwise
    # codes are column-major, so their transpose is the row-major (rows, K) operand).
    gran = TENSORWISE if cast.granularity == TENSORWISE else ("rowwise" if reduce_dim == 1 else "colwise")
    return Cast(tensor, cast.dtype, gran, config.round_scales_to_power_of_2), reduce_dim == 0


def gemm_plan(config: Float8LinearConfig, spec: GemmSpec) -> GemmPlan:
    """The GEMM ``spec`` of ``config`` as quantize and GEMM calls."""
    left = _operand(config, spec.left, getattr(config, spec.left_cast), spec.left_reduce_dim)
    right = _operand(config, spec.right, getattr(config, spec.right_cast), spec.right_reduce_dim)
    return GemmPlan(*left, *right, getattr(config, spec.options).use_fast_accum)


class Plans(NamedTuple):
    output: GemmPlan
    grad_input: GemmPlan
    grad_weight: GemmPlan


# Read from the configs once: each call then only looks its recipe up.
PLANS = {name: Plans(*(gemm_plan(config, spec) for spec in (OUTPUT, GRAD_INPUT, GRAD_WEIGHT)))
         for name, config in RECIPES.items()}


class Operands:
    """The layer's 2-D tensors for one pass ("input" x (M, K), "weight" W (N, K), "grad_output" dy
    (M, N), high precision) and their float8 casts, each made once: ``casts`` may hold some already
    (the FSDP2 all-gathered weight's, x's kept by the forward), and then the tensor is not needed."""

    def __init__(self, kernels: Kernels, tensors: dict[str, torch.Tensor]) -> None:
        self.kernels, self.tensors = kernels, tensors
        self.casts: dict[Cast, tuple[torch.Tensor, torch.Tensor]] = {}

    def cast(self, cast: Cast, transpose: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, scale) of ``cast``, transposed (codes and scale) when asked."""
        codes_scale = self.casts.get(cast)
        if codes_scale is None:
            codes_scale = self.casts[cast] = self.kernels.quantize(
                self.tensors[cast.tensor], cast.dtype, cast.granularity, cast.round_scales_to_power_of_2)
        codes, scale = codes_scale
        return (codes.t(), scale.t()) if transpose else (codes, scale)

    def gemm(self, plan: GemmPlan, out_dtype: torch.dtype) -> torch.Tensor:
        """The GEMM ``plan``, rounded once to ``out_dtype``."""
        if plan.left.dtype is None:  # high precision, and so is right (Float8LinearConfig checks)
            a, b = self.tensors[plan.left.tensor], self.tensors[plan.right.tensor]
            return torch.mm(a.t() if plan.left_t else a, b if plan.right_t else b.t()).to(out_dtype)
        a, a_scale = self.cast(plan.left, plan.left_t)
        b, b_scale = self.cast(plan.right, plan.right_t)
        return self.kernels.gemm(a, b, a_scale, b_scale, out_dtype, None, plan.use_fast_accum)

    def grads(self, plans: Plans, compute_dx: bool, compute_dweight: bool, x_dtype: torch.dtype,
              w_dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(dx (M, K) in x_dtype, dW (N, K) in w_dtype), None where not asked."""
        dx = self.gemm(plans.grad_input, x_dtype) if compute_dx else None
        dw = self.gemm(plans.grad_weight, w_dtype) if compute_dweight else None
        return dx, dw


def linear_fwd(x2: torch.Tensor, weight: torch.Tensor, recipe: str) -> torch.Tensor:
    """y (M, N) = x2 (M, K) @ weight (N, K)^T in float8 per ``recipe``, in x2.dtype."""
    ops = Operands(backend_kernels(x2.device), {"input": x2, "weight": weight})
    return ops.gemm(PLANS[recipe].output, x2.dtype)


def linear_bwd(
    dy2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, recipe: str, compute_dx: bool, compute_dweight: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dx (M, K) in x2.dtype, dW (N, K) in weight.dtype) per ``recipe``; None where not asked."""
    ops = Operands(backend_kernels(x2.device), {"input": x2, "weight": weight, "grad_output": dy2})
    return ops.grads(PLANS[recipe], compute_dx, compute_dweight, x2.dtype, weight.dtype)


# ----------------------------------------------------------------------------- a weight cast in advance
# The FSDP2 float8 all-gather (titan_kernels.nn.float8_all_gather) hands the forward the weight's
# e4m3 tensorwise codes; the forward keeps x's codes instead of x. Through the public ops, so that
# the autograd.Function running these compiles.


def _all_gather_plans(recipe: str) -> Plans:
    if not RECIPES[recipe].supports_fsdp_float8_all_gather:
        raise ValueError(f"recipe {recipe!r}: an all-gathered float8 weight needs one e4m3 tensorwise cast of the "
                         "weight (recipe 'tensorwise')")
    return PLANS[recipe]


def prequantized_fwd(x2: torch.Tensor, w_codes: torch.Tensor, w_scale: torch.Tensor, recipe: str
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y (M, N) in x2.dtype, x's codes, x's scale): the forward GEMM with the weight given as its
    e4m3 tensorwise codes (N, K) and scale ()."""
    plans = _all_gather_plans(recipe)
    ops = Operands(PUBLIC_KERNELS, {"input": x2})
    ops.casts[plans.output.right] = (w_codes, w_scale)
    y = ops.gemm(plans.output, x2.dtype)
    return (y, *ops.casts[plans.output.left])


def prequantized_bwd(
    dy2: torch.Tensor, x_codes: torch.Tensor, x_scale: torch.Tensor, w_codes: torch.Tensor, w_scale: torch.Tensor,
    recipe: str, x_dtype: torch.dtype, w_dtype: torch.dtype, compute_dx: bool, compute_dweight: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The backward of ``prequantized_fwd`` from the casts it used (the recipe's gradient GEMMs
    use those same casts of x and W: ``supports_fsdp_float8_all_gather``)."""
    plans = _all_gather_plans(recipe)
    ops = Operands(PUBLIC_KERNELS, {"grad_output": dy2})
    ops.casts[plans.output.right] = (w_codes, w_scale)
    ops.casts[plans.output.left] = (x_codes, x_scale)
    return ops.grads(plans, compute_dx, compute_dweight, x_dtype, w_dtype)


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (..., C) as (rows, C). Explicit row count: reshape(-1, 0) is ambiguous for an empty last dim."""
    return t.reshape(t.shape[:-1].numel(), t.shape[-1])


def from_rows(t: torch.Tensor, lead: torch.Size, cols: int) -> torch.Tensor:
    """A 2-D GEMM output as (*lead, cols). _unsafe_view (as aten.matmul does): the result is not
    tracked as a view of the 2-D output, so callers may modify it in place (FSDP2 and autograd warn
    about returned views)."""
    return torch.ops.aten._unsafe_view(t, (*lead, cols))


# ----------------------------------------------------------------------------- ops


def forward(x: torch.Tensor, weight: torch.Tensor, recipe: str, backend: str | None = None) -> torch.Tensor:
    """y = x @ weight^T with float8 GEMMs per ``recipe``. x (..., K), weight (N, K) -> (..., N) in
    x.dtype, contiguous. ``backend``: the request its kernels run under (None: the one in force)."""
    with _backend.request_scope(backend):
        return from_rows(linear_fwd(as_rows(x), weight, recipe), x.shape[:-1], weight.shape[0])


def backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, recipe: str, compute_dx: bool, compute_dweight: bool,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of fp8_linear. dy (..., N), x (..., K), weight (N, K). Returns dx (..., K) in
    x.dtype and dW (N, K) in weight.dtype, each contiguous; a gradient whose ``compute_*`` flag is
    False comes back empty with its last dim 0 ((..., 0) and (N, 0)), a placeholder of the same
    rank, so that every DTensor placement of the real gradient is valid for it too. ``backend``:
    the backend request in force when the forward ran (None: the one in force now)."""
    with _backend.request_scope(backend):
        dx, dw = linear_bwd(as_rows(dy), as_rows(x), weight, recipe, compute_dx, compute_dweight)
    dx = from_rows(dx, x.shape[:-1], x.shape[-1]) if dx is not None else x.new_empty((*x.shape[:-1], 0))
    dw = dw if dw is not None else weight.new_empty((weight.shape[0], 0))
    return dx, dw


def _backward_fake(dy, x, weight, recipe, compute_dx, compute_dweight, backend=None):
    dx = x.new_empty((*x.shape[:-1], x.shape[-1] if compute_dx else 0))
    dw = weight.new_empty((weight.shape[0], weight.shape[1] if compute_dweight else 0))
    return dx, dw


def refuse_double_backward(*tensors: torch.Tensor | None) -> None:
    """In a backward of fp8_linear: a RuntimeError naming the op under create_graph=True."""
    refuse_create_graph(OP, *tensors, why="; its float8 casts are not differentiable")


def _save(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.recipe = inputs[2]


def _grads(ctx, dy):
    x, weight = ctx.saved_tensors
    refuse_double_backward(dy, x, weight)
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dx, dw = fp8_linear_def.backward(dy, x, weight, ctx.recipe, need_dx, need_dw, ctx.backend)
    return (dx if need_dx else None), (dw if need_dw else None), None


# ----------------------------------------------------------------------------- sharding rules
# fp8_linear is y = x W^T with x (..., K) and W (N, K); it shards as a matmul: tokens (any dim of x
# but the last) with W replicated, colwise (W split on N -> y split on its last dim) and rowwise (x
# and W split on K -> y Partial). Each rank quantizes its own shards with their own scales: exact
# dequantized math per shard, equal to the unsharded result to fp8 accuracy. The backward: tokens ->
# dW Partial; colwise -> dx Partial, dW Shard(0); rowwise -> dx split on K, dW Shard(1). A gradient
# that is not asked for is an empty (..., 0) / (N, 0) tensor, for which the same placements are valid
# (the rules must not depend on the bool flags, which DTensor leaves out of its sharding cache key).
# The rules hold for every recipe (the string argument is not in the cache key either). fp8_quantize
# and fp8_gemm have no rules: their tensorwise scale would need a collective, so DTensor refuses them.


def _sharding(x, weight, recipe, backend=None):
    from torch.distributed.tensor import Partial, Replicate, Shard

    rep, k, flags = Replicate(), len(x.shape) - 1, [None, None]
    rules = [
        ([rep], [rep, rep, *flags]),
        ([Shard(k)], [rep, Shard(0), *flags]),
        ([Partial()], [Shard(k), Shard(1), *flags]),
    ]
    for d in range(k):
        rules.append(([Shard(d)], [Shard(d), rep, *flags]))
    return rules


def _backward_sharding(dy, x, weight, recipe, compute_dx, compute_dweight, backend=None):
    from torch.distributed.tensor import Partial, Replicate, Shard

    rep, k, flags = Replicate(), len(x.shape) - 1, [None, None, None, None]
    rules = [
        ([rep, rep], [rep, rep, rep, *flags]),
        ([Partial(), Shard(0)], [Shard(k), rep, Shard(0), *flags]),
        ([Shard(k), Shard(1)], [rep, Shard(k), Shard(1), *flags]),
    ]
    for d in range(k):
        rules.append(([Shard(d), Partial()], [Shard(d), Shard(d), rep, *flags]))
    return rules


fp8_linear_def.define(
    forward, lambda x, weight, recipe, backend=None: torch.empty((*x.shape[:-1], weight.shape[0]), dtype=x.dtype,
                                                                  device=x.device),
    setup=_save, grads=_grads, backward=backward, backward_fake=_backward_fake, sharding=_sharding,
    backward_sharding=_backward_sharding)


# ----------------------------------------------------------------------------- public API


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, recipe: str = "tensorwise") -> torch.Tensor:
    """``x @ weight.T`` with its forward, grad_input and grad_weight GEMMs in float8 per ``recipe``.

    Args:
        x: (..., K) float32 / bfloat16 / float16.
        weight: (N, K), the same dtype as x.
        recipe: a name of ``titan_kernels.ops.fp8.config.RECIPES``: "tensorwise", "rowwise" or
            "rowwise_with_gw_hp" (torchao's meanings; the module docstring gives the dtype and
            scaling of each GEMM, ``RECIPES[recipe]`` the config).

    Returns:
        (..., N) in x.dtype. Differentiable in x and weight (dx in x.dtype, dW in weight.dtype).

    Raises:
        TypeError: x or weight not float32/bf16/fp16, or their dtypes differ.
        ValueError: weight not (N, K) with K = x.shape[-1], unknown recipe, mixed devices.

    Source: torchao.float8 recipes; Micikevicius et al. 2022, section 4.
    """
    _validate(x, weight, recipe)
    return fp8_linear_def(x, weight, recipe)
