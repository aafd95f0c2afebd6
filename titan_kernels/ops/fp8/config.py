"""Float8 training recipes as data: ``Float8LinearConfig`` says how each operand of each of a linear
layer's three GEMMs is cast, and ``RECIPES`` names the configs the fp8 ops implement.

The shape follows torchao.float8's ``Float8LinearConfig``: one ``CastConfig`` per operand of each
GEMM and one ``Float8GemmConfig`` per GEMM,

  GEMM                      left operand                          right operand
  output       y  = x W^T   cast_config_input                     cast_config_weight
  grad_input   dx = dy W    cast_config_grad_output               cast_config_weight_for_grad_input
  grad_weight  dW = dy^T x  cast_config_grad_output_for_grad_weight  cast_config_input_for_grad_weight

(the three ``*_for_grad_*`` default to the operand's first config), and ``round_scales_to_power_of_2``
for every scale. An ``axiswise`` cast takes one scale per row or column along the reduction dim of
the GEMM it feeds, so the same tensor is scaled per row for one GEMM and per column for another; a
``CastConfig`` with ``dtype=None`` keeps the operand in high precision (torchao's
``ScalingType.DISABLED``), which both operands of that GEMM must then do.

``titan_kernels.ops.fp8.linear`` reads the config; the op's ``recipe`` argument is a name of
``RECIPES``, so only these configs run (a config equal to one of them is accepted wherever a recipe
is). The FSDP2 float8 all-gather is not part of a recipe: it changes how the weight travels, not
the numerics (``titan_kernels.nn.Float8Linear.from_float``).
"""
from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass

import torch

from titan_kernels.reference.fp8 import FP8_DTYPES

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
TENSORWISE, AXISWISE = "tensorwise", "axiswise"
SCALING_GRANULARITIES = (TENSORWISE, AXISWISE)


@dataclass(frozen=True)
class CastConfig:
    """How one operand of one GEMM is cast: to ``dtype`` (float8_e4m3fn or float8_e5m2) with
    dynamic scales over ``granularity`` groups ("tensorwise": one scale; "axiswise": one per row or
    column, along the GEMM's reduction dim), or, with ``dtype=None``, not at all (high precision)."""

    dtype: torch.dtype | None = E4M3
    granularity: str = TENSORWISE

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in FP8_DTYPES:
            raise TypeError(f"dtype: expected torch.float8_e4m3fn, torch.float8_e5m2 or None (high precision), "
                            f"got {self.dtype!r}")
        if self.granularity not in SCALING_GRANULARITIES:
            raise ValueError(f"granularity: expected one of {SCALING_GRANULARITIES}, got {self.granularity!r}")

    @property
    def high_precision(self) -> bool:
        return self.dtype is None


HIGH_PRECISION = CastConfig(dtype=None)


@dataclass(frozen=True)
class Float8GemmConfig:
    """One GEMM's options: ``use_fast_accum`` lets Hopper tensor cores accumulate in their reduced
    precision over the whole K loop (faster, slightly less accurate)."""

    use_fast_accum: bool = False


@dataclass(frozen=True)
class GemmSpec:
    """One GEMM of the linear layer as ``fp8_gemm`` computes it, out = left @ right^T with both
    operands (rows, K): each operand is a 2-D tensor of the layer ("input" x (M, K), "weight" W
    (N, K), "grad_output" dy (M, N)) used as it is when the GEMM reduces over its dim 1, transposed
    when over its dim 0; the names of its casts and GEMM options in ``Float8LinearConfig``."""

    name: str
    left: str
    left_reduce_dim: int
    right: str
    right_reduce_dim: int
    left_cast: str
    right_cast: str
    options: str


OUTPUT = GemmSpec("output", "input", 1, "weight", 1, "cast_config_input", "cast_config_weight", "gemm_config_output")
GRAD_INPUT = GemmSpec("grad_input", "grad_output", 1, "weight", 0, "cast_config_grad_output",
                      "cast_config_weight_for_grad_input", "gemm_config_grad_input")
GRAD_WEIGHT = GemmSpec("grad_weight", "grad_output", 0, "input", 0, "cast_config_grad_output_for_grad_weight",
                       "cast_config_input_for_grad_weight", "gemm_config_grad_weight")
GEMMS = (OUTPUT, GRAD_INPUT, GRAD_WEIGHT)

_DERIVED = {  # the second use of each operand -> its first (torchao's defaults)
    "cast_config_input_for_grad_weight": "cast_config_input",
    "cast_config_weight_for_grad_input": "cast_config_weight",
    "cast_config_grad_output_for_grad_weight": "cast_config_grad_output",
}


@dataclass(frozen=True)
class Float8LinearConfig:
    """The casts and GEMM options of a float8 linear layer's forward, grad_input and grad_weight
    GEMMs (module docstring). The defaults are the "tensorwise" recipe: x and W e4m3, dy e5m2, one
    scale per tensor, fast accumulation in the forward GEMM only.

    Raises TypeError for a field of the wrong type, ValueError when one operand of a GEMM is in
    float8 and the other in high precision (no kernel takes that).
    """

    cast_config_input: CastConfig = CastConfig()
    cast_config_weight: CastConfig = CastConfig()
    cast_config_grad_output: CastConfig = CastConfig(E5M2)
    cast_config_input_for_grad_weight: CastConfig | None = None
    cast_config_weight_for_grad_input: CastConfig | None = None
    cast_config_grad_output_for_grad_weight: CastConfig | None = None
    gemm_config_output: Float8GemmConfig = Float8GemmConfig(use_fast_accum=True)
    gemm_config_grad_input: Float8GemmConfig = Float8GemmConfig()
    gemm_config_grad_weight: Float8GemmConfig = Float8GemmConfig()
    round_scales_to_power_of_2: bool = False

    def __post_init__(self) -> None:
        for name, first in _DERIVED.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, getattr(self, first))  # frozen: set once, here
        for f in dataclasses.fields(self):
            want = bool if f.name == "round_scales_to_power_of_2" else (
                Float8GemmConfig if f.name.startswith("gemm_") else CastConfig)
            if not isinstance(getattr(self, f.name), want):
                raise TypeError(f"{f.name}: expected a {want.__name__}, got {type(getattr(self, f.name)).__name__}")
        for gemm in GEMMS:
            left, right = getattr(self, gemm.left_cast), getattr(self, gemm.right_cast)
            if left.high_precision != right.high_precision:
                raise ValueError(f"{gemm.left_cast} / {gemm.right_cast}: the two operands of the {gemm.name} GEMM "
                                 "must both be float8 or both high precision")

    @classmethod
    def from_recipe_name(cls, recipe_name: str) -> "Float8LinearConfig":
        """The config of a named recipe (``RECIPES``); ValueError for an unknown name."""
        if recipe_name not in RECIPES:
            raise ValueError(f"recipe: expected one of {tuple(RECIPES)}, got {recipe_name!r}")
        return RECIPES[recipe_name]

    @property
    def recipe_name(self) -> str | None:
        """The name under which ``RECIPES`` holds this config, None for any other config."""
        return _NAMES.get(self)

    @property
    def casts_axiswise(self) -> bool:
        """Whether any operand is cast axiswise (then it is cast along two axes for two GEMMs)."""
        casts = [getattr(self, name) for g in GEMMS for name in (g.left_cast, g.right_cast)]
        return any(c.granularity == AXISWISE and not c.high_precision for c in casts)

    @property
    def supports_fsdp_float8_all_gather(self) -> bool:
        """Whether the FSDP2 float8 all-gather can feed this recipe: every use of the weight is one
        e4m3 tensorwise cast without power-of-two rounding (the all-gathered codes), and the weight
        gradient reuses the forward's cast of x (that path keeps the codes of x, not x)."""
        w = CastConfig(E4M3, TENSORWISE)
        return (self.cast_config_weight == w and self.cast_config_weight_for_grad_input == w
                and not self.round_scales_to_power_of_2 and self.cast_config_input.granularity == TENSORWISE
                and self.cast_config_input_for_grad_weight == self.cast_config_input)


_E4M3_AXISWISE = CastConfig(E4M3, AXISWISE)

# torchao.float8's recipes, by its names and meanings (Float8LinearRecipeName), with our GEMM
# options: fast accumulation in the forward GEMM only, for every recipe.
RECIPES: types.MappingProxyType[str, Float8LinearConfig] = types.MappingProxyType({
    # Dynamic tensorwise scales, e5m2 gradients: the fastest, and the one the FSDP2 float8 all-gather feeds.
    "tensorwise": Float8LinearConfig(),
    # Every operand e4m3, one power-of-two scale per row or column along its GEMM's reduction dim.
    "rowwise": Float8LinearConfig(
        cast_config_input=_E4M3_AXISWISE, cast_config_weight=_E4M3_AXISWISE, cast_config_grad_output=_E4M3_AXISWISE,
        round_scales_to_power_of_2=True,
    ),
    # rowwise forward; grad_input with a tensorwise weight; grad_weight in high precision (the most accurate).
    "rowwise_with_gw_hp": Float8LinearConfig(
        cast_config_input=_E4M3_AXISWISE, cast_config_weight=_E4M3_AXISWISE, cast_config_grad_output=_E4M3_AXISWISE,
        cast_config_weight_for_grad_input=CastConfig(E4M3, TENSORWISE),
        cast_config_input_for_grad_weight=HIGH_PRECISION, cast_config_grad_output_for_grad_weight=HIGH_PRECISION,
        round_scales_to_power_of_2=True,
    ),
})
_NAMES = {config: name for name, config in RECIPES.items()}


def recipe_and_config(recipe: "str | Float8LinearConfig", arg: str = "recipe") -> tuple[str, Float8LinearConfig]:
    """(name, config) of a recipe given by its name or by its ``Float8LinearConfig``.

    Raises ValueError for an unknown name or a config that is none of ``RECIPES`` (the fp8 ops
    implement those), TypeError for anything else.
    """
    if isinstance(recipe, Float8LinearConfig):
        name = recipe.recipe_name
        if name is None:
            raise ValueError(f"{arg}: this Float8LinearConfig is none of the named recipes {tuple(RECIPES)}, which "
                             f"are the ones the fp8 ops implement; got {recipe}")
        return name, recipe
    if not isinstance(recipe, str):
        raise TypeError(f"{arg}: expected a recipe name {tuple(RECIPES)} or a Float8LinearConfig, "
                        f"got {type(recipe).__name__}")
    if recipe not in RECIPES:
        raise ValueError(f"{arg}: expected one of {tuple(RECIPES)}, got {recipe!r}")
    return recipe, RECIPES[recipe]
