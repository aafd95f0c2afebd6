"""The training loop: accumulation equivalence, loss reporting, clipping, determinism, errors, metrics,
the Trainer as a library."""
import gc
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from trainer import step as numerics
from trainer import train
from trainer.environment import rank_zero_warnings
from trainer.config import ConfigError, parse_args
from trainer.observe.metrics import MetricsLogger, peak_flops
from trainer.models.common.losses import cross_entropy_loss
from tests.trainer.helpers import cpu_model, tiny_llama

# One intra-op thread (tests/trainer/conftest.py): the CPU is shared.
pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"), pytest.mark.usefixtures("one_thread")]
TINY = tiny_llama(dim=48, vocab_size=67, multiple_of=16, max_seq_len=32)


def _model(seed=0):
    return cpu_model(TINY, seed)


def _batch(n, seq=11, ignore_rows=()):
    ids = torch.randint(0, TINY.vocab_size, (n, seq + 1))
    labels = ids[:, 1:].clone()
    for r, upto in ignore_rows:  # rows with some ignored labels: micro-batches get unequal token counts
        labels[r, :upto] = numerics.IGNORE_INDEX
    return {"input_ids": ids[:, :-1], "labels": labels, "position_ids": torch.arange(seq).expand(n, seq)}


def _split(b, parts):
    return [{k: v.chunk(parts)[i] for k, v in b.items()} for i in range(parts)]


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_accumulation_1x8_equals_4x2_and_the_big_batch_gradient():
    big = _batch(8, ignore_rows=[(1, 9), (6, 4)])
    one = _model()
    loss1 = numerics.forward_backward(one, cross_entropy_loss, [big], torch.device("cpu"))
    four = _model()
    loss4 = numerics.forward_backward(four, cross_entropy_loss, _split(big, 4), torch.device("cpu"))
    ref = _model()
    keep = big["labels"].flatten() != numerics.IGNORE_INDEX
    logits = ref(big["input_ids"]).flatten(0, 1)
    ref_loss = F.cross_entropy(logits[keep].double(), big["labels"].flatten()[keep])  # mean over the big batch
    ref_loss.backward()
    assert abs(loss1.item() - ref_loss.item()) < 1e-6 * ref_loss.item()
    assert abs(loss4.item() - ref_loss.item()) < 1e-6 * ref_loss.item()  # mean token loss, not /4
    g1, g4, gr = _grads(one), _grads(four), _grads(ref)
    for name in g1:
        assert _rel(g4[name], g1[name]) < 1e-5, name
        assert _rel(g1[name], gr[name]) < 1e-5, name


def test_forward_backward_rejects_a_batch_without_tokens():
    b = _batch(2)
    b["labels"][:] = numerics.IGNORE_INDEX
    with pytest.raises(ValueError, match="no token"):
        numerics.forward_backward(_model(), cross_entropy_loss, [b], torch.device("cpu"))


def test_clip_grad_norm_matches_torch():
    a, b = _model(), _model()
    x = _batch(3)
    for m in (a, b):
        numerics.forward_backward(m, cross_entropy_loss, [x], torch.device("cpu"))
        for p in m.parameters():
            p.grad.mul_(50)  # make clipping bite
    norm = numerics.clip_grad_norm_(list(a.parameters()), 1.0)
    ref = torch.nn.utils.clip_grad_norm_(list(b.parameters()), 1.0)
    assert norm.item() == pytest.approx(ref.item(), rel=1e-6) and norm.item() > 1.0
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-6, atol=0), n
    total = math.sqrt(sum(p.grad.double().square().sum().item() for p in a.parameters()))
    assert total == pytest.approx(1.0, rel=1e-5)


def _run(folder, *overrides):
    argv = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", "6",
            "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1", "--job.dump_folder", str(folder),
            "--metrics.enable_color", "false", "--metrics.save_plot", "false", *overrides]
    rc = train.main(parse_args(argv))
    path = Path(folder) / "metrics.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return rc, recs


def test_run_is_deterministic_and_writes_metrics(tmp_path, capsys):
    rc1, a = _run(tmp_path / "a")
    rc2, b = _run(tmp_path / "b")
    assert rc1 == rc2 == 0
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["grad_norm"] for r in a] == [r["grad_norm"] for r in b]
    assert [r["step"] for r in a] == [1, 2, 3, 4, 5, 6]
    for r in a:
        assert {"step", "loss", "grad_norm", "lr", "tps", "mfu", "memory_gib"} <= r.keys()
        assert r["mfu"] is None and r["tps"] > 0 and r["memory_gib"] > 0 and 0 <= r["data_wait"] <= 1
    assert a[0]["loss"] == pytest.approx(math.log(258), rel=0.03)  # starts at ln(vocab)
    out = capsys.readouterr().out
    assert "mfu n/a" in out and "summary: 6 steps" in out and "\033[" not in out


def test_gradient_accumulation_in_the_loop_matches_one_big_batch(tmp_path):
    _, big = _run(tmp_path / "big", "--training.local_batch_size", "4")
    _, acc = _run(tmp_path / "acc", "--training.local_batch_size", "1", "--training.global_batch_size", "4")
    for x, y in zip(big, acc):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * x["loss"], x["step"]


def test_activation_checkpointing_gives_the_same_losses(tmp_path):
    _, plain = _run(tmp_path / "plain", "--training.steps", "3")
    for mode, opt in (("full", "2"), ("selective", "op"), ("selective", "2")):
        _, ac = _run(tmp_path / f"{mode}{opt}", "--training.steps", "3", "--activation_checkpoint.mode", mode,
                     "--activation_checkpoint.selective_ac_option", opt)
        for x, y in zip(plain, ac):
            assert abs(x["loss"] - y["loss"]) <= 1e-6 * x["loss"], (mode, opt, x["step"])


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    rc, recs = _run(tmp_path, "--optimizer.lr", "1e30", "--lr_scheduler.warmup_steps", "0",
                    "--checkpoint.enable", "--checkpoint.interval", "1")
    assert rc == 1
    err = capsys.readouterr().err
    assert "non-finite" in err and "step-1" in err and "Traceback" not in err
    assert [r["step"] for r in recs] == [1]
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-1"]


def test_batch_that_does_not_divide_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="global_batch_size"):
        train.main(parse_args(["--training.global_batch_size", "6", "--training.local_batch_size", "4",
                               "--job.dump_folder", str(tmp_path)]))


def test_metrics_logger_intervals_and_summary(tmp_path, capsys):
    log = MetricsLogger(tmp_path, log_freq=3, device=torch.device("cpu"), flops_per_token=100, total_steps=7,
                        enable_color=False, enable_tensorboard=True)
    out = [log.step(s, tokens=10, data_wait_s=0.0, loss=torch.tensor(10.0 - s), grad_norm=float(s), lr=0.1)
           for s in range(1, 8)]
    assert [r is not None for r in out] == [True, False, True, False, False, True, True]
    assert out[0]["loss"] == 9.0  # step 1 alone
    assert out[2]["loss"] == 7.5 and out[2]["grad_norm"] == 3.0  # mean loss of steps 2-3; step 3's norm
    assert out[5]["loss"] == 5.0 and out[6]["loss"] == 3.0 and out[2]["mfu"] is None
    summary = log.print_summary()
    log.close()
    assert summary["first_loss"] == 9.0 and summary["last_loss"] == 3.0 and summary["tokens_per_device"] == 70
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 3, 6, 7]
    assert any((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert "summary: 7 steps" in capsys.readouterr().out


def test_peak_flops_unknown_on_cpu():
    assert peak_flops(torch.device("cpu")) is None


def test_log_freq_error(tmp_path):
    with pytest.raises(ValueError, match="metrics.log_freq"):
        MetricsLogger(tmp_path, 0, torch.device("cpu"), 1, 1)


def test_parallel_dims_resolve_and_errors():
    from trainer.parallel.parallel_dims import ParallelDims

    d = ParallelDims(dp_replicate=1, dp_shard=-1, world_size=4)
    assert (d.dp_shard, d.dp_size, d.hsdp_enabled, d.fsdp_enabled) == (4, 4, False, True)
    d = ParallelDims(dp_replicate=2, dp_shard=-1, world_size=4)
    assert (d.dp_shard, d.dp_size, d.hsdp_enabled) == (2, 4, True)
    assert ParallelDims(1, -1, 1).build_mesh("cpu") is None and ParallelDims(1, -1, 1).dp_rank(None) == 0
    with pytest.raises(ValueError, match="data_parallel_replicate_degree: 3 does not divide"):
        ParallelDims(3, -1, 4)
    with pytest.raises(ValueError, match="1 x 3 = 3, expected the world size 4"):
        ParallelDims(1, 3, 4)
    with pytest.raises(ValueError, match="data_parallel_replicate_degree"):
        ParallelDims(0, -1, 4)


def test_layout_that_does_not_match_the_world_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="data_parallel_shard_degree"):
        train.main(parse_args(["--parallelism.data_parallel_shard_degree", "2", "--job.dump_folder", str(tmp_path)]))


def test_apply_ac_errors():
    from trainer.parallel.activation_checkpoint import apply_ac

    m = _model()
    with pytest.raises(ValueError, match="activation_checkpoint.mode"):
        apply_ac(m, "partial")
    with pytest.raises(ValueError, match="selective_ac_option"):
        apply_ac(m, "selective", "every")
    assert apply_ac(m, "selective", "2") == 1  # layers 0 of 0..1
    with pytest.raises(ValueError, match="already applied"):
        apply_ac(m, "full")


def test_bf16_mixed_precision_through_fsdp2_on_one_process(tmp_path, capsys):
    """--training.dtype bfloat16: FSDP2 on a 1-process mesh computes in bf16, keeps fp32 master weights."""
    _, fp32 = _run(tmp_path / "fp32", "--training.steps", "3")
    rc, bf16 = _run(tmp_path / "bf16", "--training.steps", "3", "--training.dtype", "bfloat16")
    assert rc == 0
    assert "compute bfloat16" in capsys.readouterr().out
    for x, y in zip(fp32, bf16):
        assert x["loss"] != y["loss"]  # really computed in bf16 ...
        assert abs(x["loss"] - y["loss"]) <= 1e-2 * x["loss"], x["step"]  # ... within bf16 tolerance


@pytest.mark.slow
def test_compiled_blocks_and_loss_match_eager(tmp_path):
    """torch.compile per block + loss (Inductor, CPU C++ codegen; minutes): same losses as eager to 1e-5."""
    _, eager = _run(tmp_path / "eager", "--training.steps", "3", "--activation_checkpoint.mode", "selective",
                    "--activation_checkpoint.selective_ac_option", "op")
    rc, compiled = _run(tmp_path / "compiled", "--training.steps", "3", "--compile.enable",
                        "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op")
    assert rc == 0
    for x, y in zip(eager, compiled):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * x["loss"], x["step"]


# ---- host syncs, non-finite policy, progress ---------------------------------------------------


def test_no_float_tensor_is_read_on_the_host_between_log_steps(tmp_path, monkeypatch):
    """Only log steps read the loss, the gradient norm or the non-finite flag (each read would wait for
    the device on a GPU). The one read left on other steps is the label count of the CPU batches (int64)."""
    import sys

    trainer_dir = str(Path(train.__file__).parent)
    reads, current = [], {"step": 0}

    def wrap(name):
        orig = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            caller = sys._getframe(1).f_code
            if caller.co_filename.startswith(trainer_dir):
                reads.append((current["step"], name, self.dtype, self.device.type, caller.co_name))
            return orig(self, *args, **kwargs)
        return read

    for name in ("item", "__bool__", "__float__", "__int__", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, wrap(name))
    forward_backward = numerics.forward_backward

    def counting(*args, **kwargs):
        current["step"] += 1
        return forward_backward(*args, **kwargs)

    monkeypatch.setattr(numerics, "forward_backward", counting)
    rc, recs = _run(tmp_path, "--training.steps", "8", "--metrics.log_freq", "4")
    assert rc == 0 and [r["step"] for r in recs] == [1, 4, 8]
    for step in (2, 3, 5, 6, 7):
        mine = [r for r in reads if r[0] == step]
        assert mine and all(r[2] == torch.int64 and r[4] in ("forward_backward", "<genexpr>") for r in mine), mine
    for step in (1, 4, 8):  # the log steps do read (the wrapper sees them)
        assert any(r[0] == step and r[2].is_floating_point for r in reads), step


def test_non_finite_step_is_caught_at_the_next_check_before_a_checkpoint(tmp_path, monkeypatch, capsys):
    """A non-finite gradient norm at step 4 (between checks) stops the run at the log step 5, before
    its update; the checkpoint of step 3 stays the newest, and step 6's is never written."""
    clip = numerics.clip_grad_norm_
    calls = []

    def clip_with_a_bad_step(*args, **kwargs):
        norm = clip(*args, **kwargs)
        calls.append(1)
        return norm * float("nan") if len(calls) == 4 else norm

    monkeypatch.setattr(numerics, "clip_grad_norm_", clip_with_a_bad_step)
    rc, recs = _run(tmp_path, "--training.steps", "8", "--metrics.log_freq", "5", "--checkpoint.enable",
                    "--checkpoint.interval", "3")
    err = capsys.readouterr().err
    assert rc == 1 and len(calls) == 5
    assert "step 4 (found at the check of step 5): non-finite loss or gradient" in err and "gradient norm nan" in err
    assert "stopping before the optimizer step of step 5" in err and "the last good checkpoint is step-3" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert [r["step"] for r in recs] == [1]
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-3"]


def test_a_bad_step_before_a_checkpoint_step_is_never_saved(tmp_path, monkeypatch, capsys):
    clip = numerics.clip_grad_norm_
    calls = []

    def clip_with_a_bad_step(*args, **kwargs):
        calls.append(1)
        norm = clip(*args, **kwargs)
        return norm * float("inf") if len(calls) == 2 else norm

    monkeypatch.setattr(numerics, "clip_grad_norm_", clip_with_a_bad_step)
    rc, _ = _run(tmp_path, "--training.steps", "8", "--metrics.log_freq", "10", "--checkpoint.enable",
                 "--checkpoint.interval", "3")
    assert rc == 1 and len(calls) == 3  # checked at step 3, the checkpoint step, before saving it
    assert "step 2 (found at the check of step 3)" in capsys.readouterr().err
    assert not (tmp_path / "checkpoint").exists() or not any((tmp_path / "checkpoint").iterdir())


def test_progress_elapsed_eta_outputs_and_the_summary_after_a_resume(tmp_path, capsys):
    ckpt = ["--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "3"]
    rc, recs = _run(tmp_path, *ckpt)
    out = capsys.readouterr().out
    assert rc == 0
    elapsed = [r["elapsed_s"] for r in recs]
    assert elapsed == sorted(elapsed) and elapsed[0] > 0  # cumulative since training started
    # (at the last step the final save is still to come: the ETA is its measured time, test_metrics_eta.py)
    assert recs[0]["eta_s"] is None and all(r["eta_s"] >= 0 for r in recs[1:])
    assert all(" elapsed " in line and " eta " in line for line in out.splitlines() if line.startswith("step"))
    assert f"metrics {tmp_path / 'metrics.jsonl'}" in out and f"checkpoints {tmp_path / 'checkpoint'}" in out
    assert "TensorBoard off (--metrics.enable_tensorboard)" in out
    assert "summary: 6 steps in" in out
    import shutil

    shutil.rmtree(tmp_path / "checkpoint" / "step-6")
    rc, recs = _run(tmp_path, *ckpt)  # resumes from step 3
    out = capsys.readouterr().out
    assert rc == 0 and "summary: 3 steps (4..6, resumed) in" in out


# ---- the Trainer as a library ---------------------------------------------------------------------


def test_trainer_runs_as_a_library_step_by_step_then_the_loop(tmp_path, monkeypatch):
    """Trainer(config): setup(), one train_step(), train() for the rest, close(); the same losses as main()."""
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    argv = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", "3",
            "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1", "--metrics.enable_color", "false",
            "--metrics.save_plot", "false", "--checkpoint.enable", "--checkpoint.interval", "2"]
    trainer = train.Trainer(parse_args([*argv, "--job.dump_folder", str(tmp_path / "lib")]))
    assert (trainer.world_size, trainer.rank, trainer.local_rank) == (1, 0, 0)
    with pytest.raises(RuntimeError, match="call setup"):
        trainer.train_step()
    try:
        assert trainer.setup() is True
        assert trainer.step == 0 and trainer.tokens_seen == 0 and trainer.device == torch.device("cpu")
        loss = trainer.train_step()
        assert isinstance(loss, torch.Tensor) and loss.dtype == torch.float32 and not loss.requires_grad
        first = float(loss)
        assert math.isfinite(first) and first == pytest.approx(math.log(258), rel=0.03)  # ln(vocab) at the start
        assert trainer.step == 1 and trainer.tokens_seen == 2 * 32
        trainer.train()
        assert trainer.step == 3 and trainer.tokens_seen == 3 * 2 * 32
        with pytest.raises(RuntimeError, match="the run is over"):
            trainer.train_step()
    finally:
        trainer.close()
    trainer.close()  # a second close does nothing
    assert gc.isenabled()  # collected by hand during the loop, back on after it
    lib = [json.loads(line) for line in (tmp_path / "lib" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lib] == [1, 2, 3] and lib[0]["loss"] == pytest.approx(first, rel=1e-6)
    assert sorted(p.name for p in (tmp_path / "lib" / "checkpoint").iterdir()) == ["step-2", "step-3"]
    assert train.main(parse_args([*argv, "--job.dump_folder", str(tmp_path / "main")])) == 0
    ref = [json.loads(line) for line in (tmp_path / "main" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in lib] == [r["loss"] for r in ref]
    assert [r["grad_norm"] for r in lib] == [r["grad_norm"] for r in ref]


def test_trainer_setup_says_when_there_is_nothing_to_train(tmp_path):
    argv = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", "2",
            "--metrics.save_plot", "false", "--checkpoint.enable", "--job.dump_folder", str(tmp_path)]
    assert train.main(parse_args(argv)) == 0
    records = (tmp_path / "metrics.jsonl").read_text()
    trainer = train.Trainer(parse_args(argv), world_size=1, rank=0, local_rank=0)
    try:
        assert trainer.setup() is False and trainer.step == 2  # resumed at the last step
        with pytest.raises(RuntimeError, match="call setup"):
            trainer.train()
    finally:
        trainer.close()
    assert (tmp_path / "metrics.jsonl").read_text() == records and trainer.metrics is None


def test_python_warnings_print_on_rank_zero_only():
    import warnings

    for rank, expected in ((0, 1), (1, 0)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with rank_zero_warnings(rank):
                warnings.warn("the same on every rank")
        assert len(seen) == expected, rank
