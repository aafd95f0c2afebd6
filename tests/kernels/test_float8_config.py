"""The float8 recipes as data (``titan_kernels.ops.fp8.config``): every named recipe round-trips
through its ``Float8LinearConfig`` (name -> config -> name, a config built afresh, Float8Linear and
convert_to_float8 given the config), and ``fp8_linear`` run from the config gives, bit for bit, the
GEMMs each recipe was written as before it became data (``_written_out`` below: torchao's recipe,
one quantize and GEMM call per operand), on every backend that runs here, forward and backward;
the config's validation errors.
"""
from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from torch import nn

import titan_kernels as tk
from titan_kernels.nn import Float8Linear, convert_to_float8
from titan_kernels.nn.float8 import module_filter, too_small_for_float8
from titan_kernels.ops.fp8.config import (
    HIGH_PRECISION, RECIPES, CastConfig, Float8GemmConfig, Float8LinearConfig, recipe_and_config,
)
from tests.kernels.test_fp8_linear import BACKENDS, randn

# torch._scaled_mm is checked wherever it runs, on the CPU too (tests/kernels/conftest.py).
pytestmark = pytest.mark.usefixtures("scaled_mm_when_available")

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def test_every_named_recipe_round_trips():
    assert tuple(RECIPES) == ("tensorwise", "rowwise", "rowwise_with_gw_hp")
    for name, config in RECIPES.items():
        assert Float8LinearConfig.from_recipe_name(name) is config and config.recipe_name == name
        fresh = Float8LinearConfig(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})
        assert fresh is not config and fresh == config and hash(fresh) == hash(config)
        assert fresh.recipe_name == name and recipe_and_config(fresh) == (name, config)
        assert recipe_and_config(name) == (name, config)
        lin = Float8Linear(16, 8, recipe=fresh)
        assert (lin.recipe, lin.config) == (name, config) and f"recipe={name}" in repr(lin)
        model = convert_to_float8(nn.Sequential(nn.Linear(16, 8)), fresh)
        assert model[0].recipe == name
        with pytest.raises(dataclasses.FrozenInstanceError):
            config.round_scales_to_power_of_2 = not config.round_scales_to_power_of_2
    with pytest.raises(TypeError):
        RECIPES["mine"] = Float8LinearConfig()  # the table is read-only
    assert Float8LinearConfig() == RECIPES["tensorwise"]  # the defaults are the tensorwise recipe


def test_table_holds_torchaos_meanings():
    tw, rw, hp = (RECIPES[n] for n in ("tensorwise", "rowwise", "rowwise_with_gw_hp"))
    # The *_for_grad_* casts default to the operand's first cast.
    assert tw.cast_config_grad_output_for_grad_weight == tw.cast_config_grad_output == CastConfig(E5, "tensorwise")
    assert rw.cast_config_weight_for_grad_input == CastConfig(E4, "axiswise")
    assert hp.cast_config_weight_for_grad_input == CastConfig(E4, "tensorwise")
    assert hp.cast_config_input_for_grad_weight.high_precision and hp.cast_config_grad_output_for_grad_weight.high_precision
    assert [c.round_scales_to_power_of_2 for c in (tw, rw, hp)] == [False, True, True]
    for c in (tw, rw, hp):  # fast accumulation in the forward GEMM only
        assert (c.gemm_config_output, c.gemm_config_grad_input, c.gemm_config_grad_weight) == (
            Float8GemmConfig(True), Float8GemmConfig(False), Float8GemmConfig(False))
    assert [n for n, c in RECIPES.items() if c.supports_fsdp_float8_all_gather] == ["tensorwise"]


def test_size_filter_reads_the_config():
    # N·K / (N + K) of 2048 x 4096 is 1365: enough for tensorwise, too small for the recipes that
    # cast axiswise (each such operand is cast along two axes: about twice the bytes).
    for name, config in RECIPES.items():
        small = too_small_for_float8(2048, 4096, name)
        assert small == (name != "tensorwise") == config.casts_axiswise
        assert too_small_for_float8(2048, 4096, config) == small
        assert not too_small_for_float8(4096, 14336, config) and too_small_for_float8(256, 768, config)
    keep = module_filter(["output"], auto_filter=True, recipe=RECIPES["rowwise"])
    model = convert_to_float8(nn.ModuleDict({"w1": nn.Linear(4096, 14336, device="meta"),
                                             "output": nn.Linear(4096, 14336, device="meta"),
                                             "wk": nn.Linear(4096, 1024, device="meta")}), "rowwise", keep)
    assert [type(m).__name__ for m in model.values()] == ["Float8Linear", "Linear", "Linear"]


def _written_out(x2, w, dy2, recipe):
    """y, dx, dW of ``recipe`` as explicit quantize / GEMM calls (the code before recipes were data)."""
    def q(t, dtype, gran, pow2):
        return tk.fp8_quantize(t, dtype=dtype, granularity=gran, round_scales_to_power_of_2=pow2)

    def mm(a, b, sa, sb, out_dtype, fast=False):
        return tk.fp8_gemm(a, b, sa, sb, out_dtype=out_dtype, use_fast_accum=fast)

    if recipe == "tensorwise":
        xq, xs = q(x2, E4, "tensorwise", False)
        wq, ws = q(w, E4, "tensorwise", False)
        dyq, dys = q(dy2, E5, "tensorwise", False)  # one cast of dy for both gradient GEMMs
        return (mm(xq, wq, xs, ws, x2.dtype, True), mm(dyq, wq.t(), dys, ws, x2.dtype),
                mm(dyq.t(), xq.t(), dys, xs, w.dtype))
    xq, xs = q(x2, E4, "rowwise", True)
    wq, ws = q(w, E4, "rowwise", True)
    y = mm(xq, wq, xs, ws, x2.dtype, True)
    dyq, dys = q(dy2, E4, "rowwise", True)
    if recipe == "rowwise":
        wcq, wcs = q(w, E4, "colwise", True)  # W's scales along N, the reduction dim of dx = dy W
        dcq, dcs = q(dy2, E4, "colwise", True)  # dW = dy^T x reduces over the tokens
        xcq, xcs = q(x2, E4, "colwise", True)
        return y, mm(dyq, wcq.t(), dys, wcs.t(), x2.dtype), mm(dcq.t(), xcq.t(), dcs.t(), xcs.t(), w.dtype)
    wtq, wts = q(w, E4, "tensorwise", True)
    return y, mm(dyq, wtq.t(), dys, wts, x2.dtype), torch.mm(dy2.t(), x2).to(w.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_recipes_from_the_config_give_the_written_out_gemms(recipe, be, dtype):
    x = randn(3, 9, 40, dtype=dtype, scale=3.0)[:, ::2]  # (3, 5, 40): odd rows, non-contiguous
    w = randn(24, 40, dtype=dtype)
    dy = randn(3, 5, 24, dtype=dtype)
    ctx = contextlib.nullcontext() if be == "auto" else tk.use_backend(be)
    with ctx:
        want = _written_out(x.reshape(15, 40), w, dy.reshape(15, 24), recipe)
        for fn in (tk.fp8_linear, torch.ops.titan.fp8_linear):  # eager fast path and op path
            xi, wi = x.detach().requires_grad_(), w.detach().requires_grad_()
            y = fn(xi, wi, recipe)
            dx, dw = torch.autograd.grad(y, (xi, wi), dy)
            for got, ref in zip((y.reshape(15, 24), dx.reshape(15, 40), dw), want):
                assert got.dtype == ref.dtype and torch.equal(got, ref), (recipe, fn)


def test_config_errors():
    with pytest.raises(TypeError, match="dtype: expected torch.float8_e4m3fn"):
        CastConfig(torch.float16)
    with pytest.raises(ValueError, match="granularity: expected one of"):
        CastConfig(E4, "rowwise")  # a recipe says axiswise: the GEMM decides rows or columns
    with pytest.raises(TypeError, match="cast_config_input: expected a CastConfig"):
        Float8LinearConfig(cast_config_input="tensorwise")
    with pytest.raises(TypeError, match="round_scales_to_power_of_2: expected a bool"):
        Float8LinearConfig(round_scales_to_power_of_2=1)
    with pytest.raises(TypeError, match="gemm_config_output: expected a Float8GemmConfig"):
        Float8LinearConfig(gemm_config_output=True)
    with pytest.raises(ValueError, match="grad_weight GEMM must both be float8 or both high precision"):
        Float8LinearConfig(cast_config_input_for_grad_weight=HIGH_PRECISION)
    with pytest.raises(ValueError, match="recipe: expected one of"):
        Float8LinearConfig.from_recipe_name("delayed")
    custom = dataclasses.replace(RECIPES["tensorwise"], round_scales_to_power_of_2=True)
    assert custom.recipe_name is None
    with pytest.raises(ValueError, match="none of the named recipes"):
        Float8Linear(16, 8, recipe=custom)
    with pytest.raises(ValueError, match="none of the named recipes"):
        convert_to_float8(nn.Linear(16, 8), custom)
    with pytest.raises(TypeError, match="recipe: expected a recipe name"):
        recipe_and_config(3)
    with pytest.raises(ValueError, match="needs recipe 'tensorwise'"):
        Float8Linear.from_float(nn.Linear(16, 8), RECIPES["rowwise"], enable_fsdp_float8_all_gather=True)
