"""Float8Linear: ``nn.Linear`` with its forward, grad_input and grad_weight GEMMs in float8, the
in-place model converter ``convert_to_float8`` (torchao's ``convert_to_float8_training``: swap the
``nn.Linear`` layers a filter selects) and ``module_filter``, a filter by name and by size.

A recipe is given by name or as its ``Float8LinearConfig`` (``titan_kernels.ops.fp8.config``, where
the table ``RECIPES`` holds torchao's names and meanings): "tensorwise" (dynamic tensorwise scales,
e5m2 gradients; the fastest), "rowwise" (e4m3 everywhere, per-row scales rounded to powers of two),
"rowwise_with_gw_hp" (rowwise, with grad_weight in high precision; the most accurate). The GEMMs
are ``titan_kernels.fp8_linear``; with ``enable_fsdp_float8_all_gather`` FSDP2 all-gathers the
weight in float8 (``titan_kernels.nn.float8_all_gather``).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from titan_kernels.nn.float8_all_gather import (
    Float8AllGatheredWeight,
    WeightWithFloat8AllGather,
    is_dtensor,
    linear_prequantized,
    state_dict_hook,
)
from titan_kernels.ops.fp8.config import Float8LinearConfig, recipe_and_config
from titan_kernels.ops.fp8.linear import fp8_linear


class Float8Linear(nn.Linear):
    """Drop-in ``nn.Linear`` (same constructor, parameters and state_dict) computing its three
    GEMMs in float8 per ``recipe`` (a name of ``RECIPES`` or its ``Float8LinearConfig``; the module
    keeps both, as ``recipe`` and ``config``).

    Shapes: input (..., in_features) float32/bf16/fp16, the weight's dtype (or the autocast dtype)
    -> output (..., out_features) in that dtype. The bias (if any) is added in high precision.

    Raises ValueError for an unknown recipe or a config that is none of the named recipes; the
    forward raises as ``titan_kernels.fp8_linear``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        recipe: str | Float8LinearConfig = "tensorwise",
    ) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        self.recipe, self.config = recipe_and_config(recipe)
        self.register_state_dict_post_hook(state_dict_hook)

    @classmethod
    def from_float(
        cls, linear: nn.Linear, recipe: str | Float8LinearConfig = "tensorwise", *,
        enable_fsdp_float8_all_gather: bool = False,
    ) -> "Float8Linear":
        """A Float8Linear sharing ``linear``'s parameter objects (no copy; works on the meta device).

        enable_fsdp_float8_all_gather: wrap the weight in ``WeightWithFloat8AllGather`` so FSDP2
        all-gathers it in e4m3 (a recipe whose config ``supports_fsdp_float8_all_gather``:
        "tensorwise"; not with a tensor-parallel DTensor weight).

        Raises TypeError when ``linear`` is not an nn.Linear, ValueError for an unknown recipe or
        an unsupported float8 all-gather.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear: expected an nn.Linear, got {type(linear).__name__}")
        name, config = recipe_and_config(recipe)
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False, recipe=config)
        new.weight = linear.weight
        new.bias = linear.bias
        if enable_fsdp_float8_all_gather:
            if not config.supports_fsdp_float8_all_gather:
                raise ValueError(
                    f"enable_fsdp_float8_all_gather: needs recipe 'tensorwise' (one scale per weight), got {name!r}"
                )
            w = linear.weight
            if is_dtensor(w):
                raise ValueError(
                    "enable_fsdp_float8_all_gather: the weight is already a DTensor (tensor parallel); "
                    "float8 all-gather is supported with FSDP2 alone"
                )
            if not isinstance(w, WeightWithFloat8AllGather):
                new.weight = nn.Parameter(WeightWithFloat8AllGather(w.data), requires_grad=w.requires_grad)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if isinstance(weight, Float8AllGatheredWeight):
            y = linear_prequantized(x, weight, self.recipe)
        else:
            # A WeightWithFloat8AllGather outside FSDP2 takes the op path and unwraps itself.
            if torch.is_autocast_enabled(x.device.type):
                dtype = torch.get_autocast_dtype(x.device.type)
                x, weight = x.to(dtype), weight.to(dtype)
            y = fp8_linear(x, weight, self.recipe)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}"


def too_small_for_float8(in_features: int, out_features: int, recipe: str) -> bool:
    """Whether a Linear (in_features = K, out_features = N) is expected not to gain from float8 with
    ``recipe`` (a name of ``RECIPES`` or its config).

    A float8 layer saves about half of its three GEMMs' time, 3·M·N·K / R seconds for M tokens at
    the bf16 rate R, and pays for the casts, memory-bound passes over the M×K, M×N and N×K operands:
    roughly c·(M·K + M·N) bytes / B for M ≫ N, K (B the memory bandwidth, c ≈ 5 bytes per element
    for tensorwise: read bf16 twice for amax and cast, write fp8; about twice that for the rowwise
    recipes, which also cast colwise copies). It pays when N·K / (N + K) > c·R / (3·B), about 500 on
    an H100 (989 TFLOP/s, 3.35 TB/s). With a 2x margin for kernel overheads a layer is too small
    when N·K / (N + K) < 1024, or 2048 for a recipe that casts any operand axiswise (rowwise). Llama 3 8B's FFN and wq/wo
    pass; its 1024-wide wk/wv do not; every layer of the debugmodel is too small.
    """
    _, config = recipe_and_config(recipe)
    k, n = in_features, out_features
    return n * k / (n + k) < (2048 if config.casts_axiswise else 1024)


def module_filter(filter_fqns: list[str], auto_filter: bool, recipe: str | Float8LinearConfig
                  ) -> Callable[[nn.Module, str], bool]:
    """``fn(module, fqn) -> bool`` for ``convert_to_float8``: True when the Linear at ``fqn`` should
    become float8, i.e. its name contains none of ``filter_fqns`` and, with ``auto_filter``, it is
    not ``too_small_for_float8`` for ``recipe`` (torchtitan's filter_fqns and
    auto_filter_small_kgemms)."""

    def keep(mod: nn.Module, fqn: str) -> bool:
        if any(f and f in fqn for f in filter_fqns):
            return False
        if auto_filter and too_small_for_float8(mod.in_features, mod.out_features, recipe):
            return False
        return True

    return keep


def convert_to_float8(
    model: nn.Module,
    recipe: str | Float8LinearConfig = "tensorwise",
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
    *,
    enable_fsdp_float8_all_gather: bool = False,
) -> nn.Module:
    """Replace, in place, every ``nn.Linear`` of ``model`` for which
    ``module_filter_fn(module, fqn)`` is True (all when None) by ``Float8Linear.from_float`` with
    ``recipe`` (a name of ``RECIPES`` or its ``Float8LinearConfig``).

    Parameters are shared, not copied, so it works on the meta device and before FSDP2 /
    ``torch.compile`` are applied (convert first, then shard and compile, as torchtitan does).
    Returns the model, or a new Float8Linear when ``model`` itself is an ``nn.Linear``.

    Raises TypeError for a model that is not an nn.Module, ValueError for an unknown recipe.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    _, config = recipe_and_config(recipe)

    def convert(mod: nn.Module, fqn: str) -> nn.Module:
        if isinstance(mod, nn.Linear) and not isinstance(mod, Float8Linear):
            if module_filter_fn is None or module_filter_fn(mod, fqn):
                return Float8Linear.from_float(mod, config, enable_fsdp_float8_all_gather=enable_fsdp_float8_all_gather)
            return mod
        for name, child in list(mod.named_children()):
            new = convert(child, f"{fqn}.{name}" if fqn else name)
            if new is not child:
                setattr(mod, name, new)
        return mod

    return convert(model, "")
