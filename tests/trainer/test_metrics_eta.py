"""The ETA counts validations and checkpoint saves as measured: steps left x the training time per step,
plus each phase still to come x its mean time so far (trainer.observe.metrics.MetricsLogger)."""
import time

import pytest
import torch

from trainer.evaluate import Validator
from tests.trainer.helpers import train_records

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"), pytest.mark.usefixtures("one_thread")]


def _logger(tmp_path, total_steps=10, **phases):
    from trainer.observe.metrics import MetricsLogger

    return MetricsLogger(tmp_path, 1, torch.device("cpu"), 1, total_steps, enabled=False, phases=phases)


def test_occurrences_left_of_each_phase(tmp_path):
    m = _logger(tmp_path, validation=4, checkpoint=5, export=None, never=0)
    want_val = {1: 3, 4: 3, 5: 2, 8: 2, 9: 1, 10: 1, 11: 0}  # steps 4, 8 and the last, 10
    assert {s: m.occurrences("validation", s) for s in want_val} == want_val
    assert [m.occurrences("checkpoint", s) for s in (1, 5, 6, 10)] == [2, 2, 1, 1]  # 5 and 10 (a multiple)
    assert [m.occurrences("export", s) for s in (1, 10)] == [1, 1]  # the last step only
    assert m.occurrences("never", 1) == 0 and m.occurrences("unknown", 1) == 0
    # brute force against the schedule, for odd totals and intervals
    for total in (1, 7, 12, 13):
        for every in (1, 2, 3, 5, 13, 20):
            m = _logger(tmp_path, total, v=every)
            for s in range(1, total + 2):
                want = sum(1 for t in range(s, total + 1) if t % every == 0 or t == total)
                assert m.occurrences("v", s) == want, (total, every, s)


def test_eta_is_steps_left_at_the_training_rate_plus_phases_left_at_their_mean(tmp_path):
    m = _logger(tmp_path, validation=4, checkpoint=5)
    m.start()
    m.step(1, tokens=8, data_wait_s=0.0)  # the ETA's clock starts after step 1
    t0 = m._rate_start[1]
    assert m.eta_s(3, now=t0 + 2.0) == pytest.approx(7.0)  # 1 s per step, 7 steps left, no phase measured
    m.phase("validation", 6.0)  # (its time leaves the time per step)
    m.phase("checkpoint", 1.0)
    m.phase("checkpoint", 2.0)
    now = t0 + 4.0 + 6.0 + 3.0  # 4 training seconds for steps 2..5
    # step 5: 5 steps left x 1 s; validations at 8 and 10 x 6 s; saves at 5 and 10 x 1.5 s
    assert m.eta_s(5, now=now) == pytest.approx(5 + 2 * 6 + 2 * 1.5)
    assert m.eta_s(10, now=now + 5.0) == pytest.approx(6 + 1.5)  # the last step: its validation and save


def test_trainer_eta_counts_the_measured_validation_time(tmp_path, monkeypatch):
    """A validation batch that takes 0.5 s more: the ETA at each step counts the evaluations left."""
    batch_loss_sum = Validator._batch_loss_sum

    def slow(self, batch):
        time.sleep(0.5)
        return batch_loss_sum(self, batch)

    monkeypatch.setattr(Validator, "_batch_loss_sum", slow)
    recs = train_records(tmp_path, "--training.seq_len", "16", "--training.local_batch_size", "2",
                         "--training.steps", "6", "--validation.enable", "--validation.freq", "2",
                         "--validation.steps", "1")
    val = {r["step"]: r["val_time_s"] for r in recs if "val_loss" in r}
    train = {r["step"]: r for r in recs if "loss" in r}
    assert sorted(val) == [2, 4, 6] and min(val.values()) >= 0.5
    assert train[2]["eta_s"] < 0.5 * 3  # no evaluation measured yet
    mean = {3: val[2], 5: (val[2] + val[4]) / 2, 6: (val[2] + val[4]) / 2}
    left = {3: 2, 5: 1, 6: 1}  # evaluations at steps 4 and 6; 6; the last step's own
    for s in (3, 5, 6):
        assert train[s]["eta_s"] >= mean[s] * left[s], (s, train[s]["eta_s"])
    # and not the evaluations' time in the time per step: at step 5, one step left
    per_step = (train[5]["elapsed_s"] - train[1]["elapsed_s"] - val[2] - val[4]) / 4
    assert train[5]["eta_s"] == pytest.approx(per_step + mean[5], abs=1e-3)
