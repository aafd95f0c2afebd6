"""AdamW construction and the LR schedule: values at every step, and resume at every step."""
import math

import pytest
import torch
from torch import nn

from trainer.config import Optimizer as OptimizerConfig
from trainer.optim import LRSchedule, WarmupDecayLR, build_lr_scheduler, build_optimizer


def _expected_factor(step, steps, warmup, decay_type, decay_ratio, min_f):
    """The schedule written out case by case (module docstring of trainer.optim)."""
    if step <= warmup:
        return step / warmup
    if decay_ratio is None:
        decay = steps - warmup if decay_type != "wsd" else round(0.2 * steps)
    else:
        decay = round(decay_ratio * steps)
    decay = min(decay, steps - warmup)
    start = steps - decay
    if step <= start:
        return 1.0
    p = (step - start) / decay
    shape = {"linear": 1 - p, "cosine": (1 + math.cos(math.pi * p)) / 2, "wsd": 1 - math.sqrt(p)}[decay_type]
    return min_f + (1 - min_f) * shape


def test_linear_schedule_by_hand():
    s = LRSchedule(steps=7, warmup_steps=3, decay_type="linear", min_lr_factor=0.1)
    got = [s.factor(i) for i in range(1, 8)]
    # warmup 1/3, 2/3, 1; then 4 decay steps to 0.1: 1 - 0.9 * k/4
    want = [1 / 3, 2 / 3, 1.0, 1 - 0.9 / 4, 1 - 0.9 / 2, 1 - 0.9 * 3 / 4, 0.1]
    assert got == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("decay_type", ["linear", "cosine", "wsd"])
@pytest.mark.parametrize("steps,warmup,ratio", [(1, 0, None), (1, 1, None), (13, 4, None), (13, 13, None),
                                                (13, 0, None), (20, 3, 0.25), (20, 15, 0.5), (10, 2, 0.0)])
def test_schedule_every_step(decay_type, steps, warmup, ratio):
    s = LRSchedule(steps=steps, warmup_steps=warmup, decay_type=decay_type, decay_ratio=ratio, min_lr_factor=0.05)
    got = [s.factor(i) for i in range(1, steps + 1)]
    want = [_expected_factor(i, steps, warmup, decay_type, ratio, 0.05) for i in range(1, steps + 1)]
    assert got == pytest.approx(want, abs=1e-12)
    assert got[0] > 0
    assert all(0.05 - 1e-12 <= f <= 1 + 1e-12 for f in got)
    if warmup == steps:
        assert got[-1] == 1.0  # warmup over the whole run ends at the peak
    elif s.decay_steps > 0:
        assert got[-1] == pytest.approx(0.05)  # decays to min_lr_factor


def test_wsd_is_stable_then_decays_over_last_fifth():
    s = LRSchedule(steps=100, warmup_steps=10, decay_type="wsd", min_lr_factor=0.0)
    assert s.decay_steps == 20
    assert all(s.factor(i) == 1.0 for i in range(10, 81))
    assert s.factor(90) == pytest.approx(1 - math.sqrt(0.5))
    assert s.factor(100) == 0.0


def _opt_and_sched(schedule, lr=0.5):
    p = nn.Parameter(torch.randn(3))
    opt = torch.optim.AdamW([p], lr=lr)
    return p, opt, build_lr_scheduler(opt, schedule)


@pytest.mark.parametrize("decay_type", ["linear", "cosine", "wsd"])
def test_scheduler_drives_optimizer_and_resumes_at_every_step(decay_type):
    schedule = LRSchedule(steps=12, warmup_steps=3, decay_type=decay_type, min_lr_factor=0.1)
    lr = 0.5
    _, opt, sched = _opt_and_sched(schedule, lr)
    straight = []
    for step in range(1, 13):
        straight.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert straight == pytest.approx([lr * schedule.factor(i) for i in range(1, 13)], abs=1e-15)
    for k in range(0, 13):  # interrupt after k steps
        _, opt1, sched1 = _opt_and_sched(schedule, lr)
        for _ in range(k):
            opt1.step()
            sched1.step()
        state = sched1.state_dict()
        _, opt2, sched2 = _opt_and_sched(schedule, lr)  # a fresh process: LR of step 1 until loaded
        sched2.load_state_dict(state)
        resumed = []
        for _ in range(k, 12):
            resumed.append(opt2.param_groups[0]["lr"])
            opt2.step()
            sched2.step()
        assert resumed == straight[k:], k


def test_scheduler_state_is_plain_and_small():
    _, opt, sched = _opt_and_sched(LRSchedule(steps=5, warmup_steps=1))
    opt.step()
    sched.step()
    # The schedule's own settings ride along, so a resume can tell a changed schedule (run_history).
    assert sched.state_dict() == {"last_epoch": 1, "base_lrs": [0.5], "schedule": {
        "steps": 5, "warmup_steps": 1, "decay_type": "linear", "decay_ratio": None, "min_lr_factor": 0.1}}


@pytest.mark.parametrize("kwargs,key", [
    (dict(steps=0, warmup_steps=0), "training.steps"),
    (dict(steps=5, warmup_steps=6), "warmup_steps"),
    (dict(steps=5, warmup_steps=-1), "warmup_steps"),
    (dict(steps=5, warmup_steps=1, decay_type="exp"), "decay_type"),
    (dict(steps=5, warmup_steps=1, decay_ratio=1.5), "decay_ratio"),
    (dict(steps=5, warmup_steps=1, min_lr_factor=-0.1), "min_lr_factor"),
])
def test_schedule_errors(kwargs, key):
    with pytest.raises(ValueError, match=key):
        LRSchedule(**kwargs)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3, bias=True)
        self.norm = nn.RMSNorm(3)
        self.frozen = nn.Parameter(torch.ones(2), requires_grad=False)


@pytest.mark.parametrize("impl,flags", [
    ("auto", {"fused": True}), ("fused", {"fused": True}), ("foreach", {"foreach": True}), ("for-loop", {}),
])
def test_build_optimizer_groups_and_implementation(impl, flags):
    cfg = OptimizerConfig(lr=3e-3, beta1=0.8, beta2=0.9, eps=1e-7, weight_decay=0.2, implementation=impl)
    net = _Net()
    opt = build_optimizer(net, cfg)
    decay, no_decay = opt.param_groups
    assert [p.shape for p in decay["params"]] == [torch.Size([3, 4])] and decay["weight_decay"] == 0.2
    assert {p.shape for p in no_decay["params"]} == {torch.Size([3])} and no_decay["weight_decay"] == 0.0
    assert len(no_decay["params"]) == 2  # bias and norm weight; the frozen parameter is left out
    assert decay["lr"] == 3e-3 and decay["betas"] == (0.8, 0.9) and decay["eps"] == 1e-7
    for key, value in flags.items():
        assert decay[key] is value
    if impl == "for-loop":
        assert not decay["foreach"] and not decay["fused"]


def test_build_optimizer_matches_torch_adamw_update():
    net = _Net()
    ref = _Net()
    ref.load_state_dict(net.state_dict())
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1, implementation="foreach")
    opt = build_optimizer(net, cfg)
    ref_opt = torch.optim.AdamW([
        {"params": [ref.lin.weight], "weight_decay": 0.1},
        {"params": [ref.lin.bias, ref.norm.weight], "weight_decay": 0.0},
    ], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    x = torch.randn(5, 4)
    for m, o in ((net, opt), (ref, ref_opt)):
        for _ in range(3):
            o.zero_grad()
            m.norm(m.lin(x)).square().sum().backward()
            o.step()
    for (n, a), (_, b) in zip(net.named_parameters(), ref.named_parameters()):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), n


def test_build_optimizer_errors():
    with pytest.raises(ValueError, match="optimizer.name"):
        build_optimizer(_Net(), OptimizerConfig(name="SGD"))
    with pytest.raises(ValueError, match="optimizer.implementation"):
        build_optimizer(_Net(), OptimizerConfig(implementation="magic"))
    frozen = nn.Linear(2, 2)
    frozen.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable"):
        build_optimizer(frozen, OptimizerConfig())


def test_warmup_decay_lr_is_a_torch_scheduler():
    _, _, sched = _opt_and_sched(LRSchedule(steps=4, warmup_steps=2))
    assert isinstance(sched, (WarmupDecayLR, torch.optim.lr_scheduler.LRScheduler))
    assert sched.get_last_lr() == [0.25]
