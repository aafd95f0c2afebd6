"""Optimizer state in the memory estimate and the planner: bytes per optimizer and state dtype equal
what TitanOptimizer allocates (counted on the debug models), Muon's step buffers are counted, and
``python -m trainer.plan --compare_optimizers`` shows bf16 states or Muon fitting 405B on fewer GPUs."""
from __future__ import annotations

import pytest
import torch

from trainer.config import Optimizer as OptimizerConfig
from trainer.estimate.memory import Layout, estimate_memory, model_costs
from trainer.registry import build_model, model_args
from trainer.optim import build_optimizer
from trainer.estimate.step_time import GPUS
from trainer.estimate.plan import flavor_args, main, optimizer_comparison

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state_bytes(opt) -> int:
    return sum(v.numel() * v.element_size() for st in opt.state.values() for k, v in st.items() if k != "step")


@pytest.mark.parametrize("family,flavor", [("llama3", "debugmodel"), ("qwen3", "debugmodel_moe")])
@pytest.mark.parametrize("name,state_dtype", [("adamw", "float32"), ("adamw", "bfloat16"), ("muon", "float32"),
                                              ("muon", "bfloat16")])
def test_estimated_optimizer_state_equals_allocated(family, flavor, name, state_dtype):
    args = model_args(family, flavor, 258, 64)
    model = build_model(args, device="cpu")
    opt = build_optimizer(model, OptimizerConfig(name=name, state_dtype=state_dtype, implementation="titan",
                                                 muon_ns_steps=1))  # the state does not depend on it
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    sb = 2 if state_dtype == "bfloat16" else 4
    est = estimate_memory(args, Layout(), 1, 64, compute_bytes=4, optimizer=name, state_bytes=sb)
    assert est.optimizer == pytest.approx(_state_bytes(opt), rel=1e-9)
    if name == "muon":
        assert est.optimizer_step > 0 and est.total >= est.params + est.optimizer + est.grads + est.optimizer_step


def test_state_bytes_per_parameter_by_optimizer():
    args = flavor_args("405B", 8192)
    c = model_costs(args)
    layout = Layout(1, 64, 8)
    adamw, adamw16, muon, muon16 = (estimate_memory(c, layout, 1, 8192, ac_mode="full", optimizer=o, state_bytes=b)
                                    for o, b in (("adamw", 4), ("adamw", 2), ("muon", 4), ("muon", 2)))
    shards = 64 * 8
    assert adamw.optimizer == pytest.approx(8 * c.total_params / shards)
    assert adamw16.optimizer == pytest.approx(adamw.optimizer / 2)
    assert muon16.optimizer == pytest.approx(muon.optimizer / 2)
    # Muon keeps one state on the hidden matrices (~97% of 405B), two on the embedding, output and norms.
    assert 0.5 < muon.optimizer / adamw.optimizer < 0.53
    assert adamw.total == estimate_memory(c, layout, 1, 8192, ac_mode="full").total  # the default is AdamW fp32
    with pytest.raises(ValueError, match="optimizer"):
        estimate_memory(c, layout, 1, 8192, optimizer="sgd")


def test_plan_shows_what_bf16_states_and_muon_buy(capsys):
    lines = optimizer_comparison(flavor_args("405B", 8192), "405B", GPUS["H100"], 8192)
    counts = [int(line.split("fits on")[1].split()[0]) for line in lines[1:]]
    adamw32, adamw16, muon32, muon16 = counts
    assert adamw16 < adamw32 and muon32 < adamw32 and muon16 < adamw32
    assert main(["--flavor", "70B", "--ngpu", "64", "--top", "1", "--optimizer", "muon", "--state_dtype", "bfloat16",
                 "--compare_optimizers"]) == 0
    out = capsys.readouterr().out
    assert "Muon with bf16 states" in out and "--optimizer.name muon --optimizer.state_dtype bfloat16" in out
