"""The FSDP2 float8 all-gather of a ``Float8Linear`` weight (tensorwise recipe).

``Float8Linear.from_float(..., enable_fsdp_float8_all_gather=True)`` wraps the weight in
``WeightWithFloat8AllGather``, a tensor subclass that behaves as the plain high-precision weight for
every op (optimizer, init, state dict) and implements FSDP2's all-gather extension:
  * ``fsdp_pre_all_gather``: the amax of the local shard, all-reduced (MAX) over the FSDP mesh, is
    the amax of the whole weight; the shard is cast to e4m3 with it, so every rank holds codes of
    the one tensorwise scaling of the full weight, and FSDP all-gathers 1 byte per element
    instead of 2 (bf16) or 4;
  * ``fsdp_post_all_gather``: wraps the gathered codes and the scale in a
    ``Float8AllGatheredWeight``, which ``Float8Linear.forward`` hands to ``linear_prequantized``
    (no second cast).
The codes and scale are exactly those of ``fp8_quantize`` on the unsharded weight (same kernels).
Each all-gather costs one extra 4-byte all-reduce per weight (torchao can batch these for all
weights after the optimizer step; we do not yet). ``state_dict`` hands out the plain weight, so
checkpoints load with or without the wrapper. Not supported together with tensor parallelism (a
weight that is already a DTensor).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map_only

from titan_kernels import backend as _backend
import titan_kernels.ops.fp8.linear as _linear
from titan_kernels.ops.fp8.config import E4M3
from titan_kernels.ops.fp8.quantize import fp8_quantize_from_amax, tensorwise_amax

aten = torch.ops.aten

# Ops whose result is (a view or a copy of) the weight and must stay a WeightWithFloat8AllGather:
# what FSDP2 does to build and pad the shards, and what detach / nn.Parameter / .to() do.
_PRESERVE = {
    aten.detach.default, aten.alias.default, aten.view.default, aten._unsafe_view.default,
    aten.as_strided.default, aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default,
    aten.empty_like.default, aten.new_zeros.default, aten.new_empty.default,
    aten._to_copy.default, aten.clone.default, aten._pin_memory.default,
}  # not zeros_like: optimizer states (torch.zeros_like(param)) are plain tensors


def _writes_first_arg(func) -> bool:
    args = func._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


class WeightWithFloat8AllGather(torch.Tensor):
    """A high-precision weight (wrapping ``_tensor``) that FSDP2 all-gathers as e4m3 codes.

    Every op sees the plain ``_tensor`` (results of view/copy ops stay wrapped, in-place ops return
    the wrapper), so optimizers, initialisation and checkpoints work unchanged.
    """

    @staticmethod
    def __new__(cls, tensor: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype, layout=tensor.layout, device=tensor.device, requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor):
        self._tensor = tensor

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        u_args, u_kwargs = tree_map_only(cls, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*u_args, **u_kwargs)
        if _writes_first_arg(func) and isinstance(args[0], cls):
            return args[0]
        if func in _PRESERVE:
            return tree_map_only(torch.Tensor, cls, out)
        return out

    def __tensor_flatten__(self):
        return ["_tensor"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return WeightWithFloat8AllGather(inner["_tensor"])

    def __repr__(self) -> str:
        return f"WeightWithFloat8AllGather({self._tensor!r})"

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        amax = tensorwise_amax(self._tensor)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group())
        codes, scale = fp8_quantize_from_amax(self._tensor, amax, E4M3, False)
        # FSDP wants every rank's input at the padded shard size (ceil(rows / world) rows).
        rows = -(-outer_size[0] // mesh.size())
        if codes.shape[0] != rows:
            padded = torch.zeros((rows, *codes.shape[1:]), dtype=torch.uint8, device=codes.device)
            padded[: codes.shape[0]] = codes.view(torch.uint8)
            codes = padded.view(E4M3)
        # Sent as bytes: every collective backend moves uint8, not all of them float8.
        return (codes.view(torch.uint8),), (scale,)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (data,) = all_gather_outputs
        (scale,) = metadata
        if out is not None:
            # Later all-gathers refill the same buffer, which out's codes already view.
            if out._data.untyped_storage().data_ptr() != data.untyped_storage().data_ptr():
                raise RuntimeError("fsdp_post_all_gather: out does not view this all-gather buffer")
            out._scale = scale
            return
        return Float8AllGatheredWeight(data.view(E4M3), scale, param_dtype), (data,)


class Float8AllGatheredWeight(torch.Tensor):
    """The unsharded weight FSDP2 hands to ``Float8Linear``: e4m3 codes ``_data`` (N, K) and a
    float32 tensorwise ``_scale``, presented as a ``dtype`` tensor of the weight's shape.

    ``Float8Linear`` uses the codes directly. Any other op sees the dequantized weight
    (``_data * _scale`` in ``dtype``): correct, though it loses the fp8 savings.
    """

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=dtype, layout=data.layout, device=data.device, requires_grad=False,
        )

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        self._data = data
        self._scale = scale

    __torch_function__ = torch._C._disabled_torch_function_impl

    _VIEWS = {aten.detach.default, aten.alias.default, aten.view.default, aten.as_strided.default,
              aten._unsafe_view.default}

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in cls._VIEWS and isinstance(args[0], cls):
            w = args[0]
            return cls(func(w._data, *args[1:], **kwargs), w._scale, w.dtype)
        u_args, u_kwargs = tree_map_only(cls, lambda w: w.dequantize(), (args, kwargs))
        return func(*u_args, **u_kwargs)

    def dequantize(self) -> torch.Tensor:
        """The weight as a plain tensor: ``_data.float() * _scale`` in ``self.dtype``."""
        return (self._data.float() * self._scale).to(self.dtype)

    def __tensor_flatten__(self):
        return ["_data", "_scale"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride):
        return Float8AllGatheredWeight(inner["_data"], inner["_scale"], dtype)

    def __repr__(self) -> str:
        return f"Float8AllGatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype}, scale={self._scale.item():.3e})"


def is_dtensor(t: torch.Tensor) -> bool:
    if not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _plain_weight(t: torch.Tensor) -> torch.Tensor:
    """``t`` without the WeightWithFloat8AllGather wrapper (a DTensor keeps its placements), sharing
    its storage: what state_dict hands out, so checkpoints hold plain tensors (loadable without the
    wrapper, and loading in place still fills the parameter)."""
    if isinstance(t, WeightWithFloat8AllGather):
        return t._tensor
    if is_dtensor(t) and isinstance(t._local_tensor, WeightWithFloat8AllGather):
        return type(t).from_local(t._local_tensor._tensor, t.device_mesh, t.placements, run_check=False,
                                  shape=t.shape, stride=t.stride())
    return t


def state_dict_hook(module, state_dict, prefix, local_metadata) -> None:
    key = prefix + "weight"
    if state_dict.get(key) is not None:
        state_dict[key] = _plain_weight(state_dict[key])


class _PrequantizedLinearFn(torch.autograd.Function):
    """y = x W^T with W already cast (the FSDP2 float8 all-gather): ``fp8_linear``'s GEMMs from the
    given weight codes (``titan_kernels.ops.fp8.linear.prequantized_fwd`` / ``_bwd``)."""

    @staticmethod
    def forward(ctx, x, weight, recipe):
        y, xq, xs = _linear.prequantized_fwd(_linear.as_rows(x), weight._data, weight._scale, recipe)
        # The codes, not x: the backward needs nothing else (and they are half of a bf16 x).
        ctx.save_for_backward(xq, xs, weight)
        ctx.x_shape, ctx.x_dtype, ctx.recipe = x.shape, x.dtype, recipe
        # The backward runs on the forward's backends; under torch.compile the request cannot be
        # traced (a ContextVar), and the compiled ops read the one in force when they run.
        ctx.request = _backend.capture_request(None)
        return _linear.from_rows(y, x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        xq, xs, weight = ctx.saved_tensors
        _linear.refuse_double_backward(dy, weight)
        with _backend.request_scope(ctx.request):
            dx, dw = _linear.prequantized_bwd(
                _linear.as_rows(dy), xq, xs, weight._data, weight._scale, ctx.recipe, ctx.x_dtype, weight.dtype,
                ctx.needs_input_grad[0], ctx.needs_input_grad[1],
            )
        dx = _linear.from_rows(dx, ctx.x_shape[:-1], ctx.x_shape[-1]) if dx is not None else None
        return dx, dw, None


def linear_prequantized(x: torch.Tensor, weight: Float8AllGatheredWeight, recipe: str) -> torch.Tensor:
    """``x @ weight.T`` in float8 per ``recipe`` (a name of ``RECIPES`` whose config
    ``supports_fsdp_float8_all_gather``), the weight's cast being the all-gathered codes.
    x (..., K) -> (..., N) in x.dtype; differentiable in x and weight. Raises ValueError for a
    recipe the all-gathered codes cannot feed."""
    return _PrequantizedLinearFn.apply(x, weight, recipe)
