"""Validation in one process: the loss is the token mean over the held-out split, computed here again
from the saved weights and the documents alone; records, TensorBoard tags, console; errors.

(Parallel layouts: tests/distributed/test_parallel_validation.py.)
"""
import json
import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from trainer import train
from trainer.checkpoint.folder import load_weights
from trainer.config import ConfigError, parse_args
from trainer.data import build_tokenizer
from trainer.registry import build_model
from tests.trainer.helpers import llama_model_args as model_args

# One intra-op thread (tests/trainer/conftest.py): the CPU is shared.
pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"), pytest.mark.usefixtures("one_thread")]
WORDS = ["thou", "art", "the", "king", "speak", "hear", "me", "good", "lord", "night", "and", "of"]


def _corpus(path: Path, n_docs: int = 48, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30))) for _ in range(n_docs)]
    path.write_text("\n\n".join(docs) + "\n")
    return docs


def _run(folder, *overrides):
    argv = ["--training.seq_len", "16", "--training.local_batch_size", "2", "--training.steps", "4",
            "--lr_scheduler.warmup_steps", "1", "--optimizer.lr", "3e-3", "--metrics.log_freq", "1",
            "--metrics.enable_color", "false", "--metrics.save_plot", "false", "--job.dump_folder", str(folder),
            *overrides]
    rc = train.main(parse_args(argv))
    lines = (Path(folder) / "metrics.jsonl").read_text().splitlines() if (Path(folder) / "metrics.jsonl").exists() else []
    recs = [json.loads(line) for line in lines]
    return rc, [r for r in recs if "loss" in r], [r for r in recs if "val_loss" in r]


def _reference_val_loss(weights: Path, docs: list[str], seq_len: int) -> tuple[float, int]:
    """Token-mean cross-entropy (float64) of the final weights on the stream of ``docs``, cut into
    seq_len + 1 windows, the last one partial: rebuilt here from the documents alone."""
    tok = build_tokenizer(None)
    model = build_model(model_args("debugmodel", tok.vocab_size, 16), device="cpu")
    model.init_weights(0)
    load_weights(model, weights)
    stream = [t for d in docs for t in [tok.bos_id, *d.encode(), tok.eos_id]]
    total, count = 0.0, 0
    with torch.no_grad():
        for lo in range(0, len(stream), seq_len + 1):
            w = torch.tensor(stream[lo:lo + seq_len + 1])
            if len(w) < 2:
                continue
            logits = model(w[None, :-1]).double()[0]
            total += F.cross_entropy(logits, w[1:], reduction="sum").item()
            count += len(w) - 1
    return total / count, count


@pytest.mark.parametrize("extra", [[], ["--training.local_batch_size", "1", "--training.global_batch_size", "2"]],
                         ids=["plain", "grad_accum"])
def test_validation_loss_is_the_token_mean_over_the_held_out_split(tmp_path, extra, capsys):
    text = tmp_path / "corpus.txt"
    docs = _corpus(text)
    rc, recs, val = _run(tmp_path / "run", "--training.dataset_path", str(text), "--validation.enable",
                         "--validation.freq", "2", "--validation.split_every", "4", "--validation.local_batch_size", "3",
                         "--validation.steps", "-1", "--checkpoint.enable", "--checkpoint.interval", "4", "--metrics.enable_tensorboard", *extra)
    assert rc == 0
    assert [r["step"] for r in val] == [2, 4] and [r["step"] for r in recs] == [1, 2, 3, 4]
    held_out = docs[3::4]
    want, n_tokens = _reference_val_loss(tmp_path / "run" / "checkpoint" / "step-4", held_out, 16)
    last = val[-1]
    assert last["val_tokens"] == n_tokens  # every token of the split once, the padding of the last window not
    assert abs(last["val_loss"] - want) <= 1e-5 * want, (last["val_loss"], want)
    assert last["val_perplexity"] == pytest.approx(math.exp(want), rel=1e-5)
    assert last["val_batches"] == math.ceil(math.ceil(n_tokens / 16) / 3)
    assert val[0]["val_loss"] > last["val_loss"]
    out = capsys.readouterr().out
    assert f"step 4  validation  loss {last['val_loss']:8.4f}" in out
    assert "validation loss" in out.split("summary:")[1]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tb"))
    events.Reload()
    assert {"validation/loss", "validation/perplexity", "train/loss"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("validation/loss")] == [2, 4]
    assert events.Scalars("validation/loss")[-1].value == pytest.approx(last["val_loss"], rel=1e-6)


def test_validation_steps_limit_and_a_dataset_of_its_own(tmp_path):
    train_text, val_text = tmp_path / "train.txt", tmp_path / "val.txt"
    _corpus(train_text, seed=1)
    val_docs = _corpus(val_text, n_docs=30, seed=2)
    rc, recs, val = _run(tmp_path / "run", "--training.dataset_path", str(train_text), "--validation.enable",
                         "--validation.dataset_path", str(val_text), "--validation.steps", "2",
                         "--validation.seq_len", "8", "--validation.freq", "3")
    assert rc == 0 and [r["step"] for r in val] == [3, 4]
    for r in val:  # 2 full batches of 2 windows of 8 labels (the split is longer)
        assert (r["val_batches"], r["val_tokens"]) == (2, 2 * 2 * 8)
    # All of the training file is trained on (no held-out part when validation has its own data).
    rc2, recs2, _ = _run(tmp_path / "plain", "--training.dataset_path", str(train_text))
    assert [r["loss"] for r in recs2] == [r["loss"] for r in recs]
    assert sum(len(d) for d in val_docs) > 4 * 8  # (the limit was what stopped it)


def test_default_validation_is_bounded_and_minus_one_reads_the_whole_split(tmp_path):
    """The default evaluates a fixed number of batches (not the whole split); -1 still means all of it."""
    assert parse_args([]).validation.steps == 10
    train_text, val_text = tmp_path / "train.txt", tmp_path / "val.txt"
    _corpus(train_text, n_docs=10, seed=1)
    _corpus(val_text, n_docs=60, seed=3)  # about 4,000 tokens: 250 windows of 8 + 1
    common = ["--training.dataset_path", str(train_text), "--training.steps", "1", "--validation.enable",
              "--validation.dataset_path", str(val_text), "--validation.seq_len", "8",
              "--validation.local_batch_size", "2"]
    _, _, bounded = _run(tmp_path / "default", *common)
    _, _, whole = _run(tmp_path / "whole", *common, "--validation.steps", "-1")
    assert (bounded[0]["val_batches"], bounded[0]["val_tokens"]) == (10, 10 * 2 * 8)
    assert whole[0]["val_batches"] > 200 and whole[0]["val_tokens"] > 10 * bounded[0]["val_tokens"]


def test_validation_does_not_change_training_without_a_split(tmp_path):
    """With its own dataset, validation between steps leaves the training losses bit for bit unchanged."""
    val_text = tmp_path / "val.txt"
    _corpus(val_text, n_docs=10)
    _, plain, _ = _run(tmp_path / "plain")
    _, with_val, val = _run(tmp_path / "val", "--validation.enable", "--validation.dataset_path", str(val_text),
                            "--validation.freq", "1")
    assert [r["loss"] for r in with_val] == [r["loss"] for r in plain]
    assert [r["grad_norm"] for r in with_val] == [r["grad_norm"] for r in plain]
    assert [r["step"] for r in val] == [1, 2, 3, 4]


def test_validation_config_errors(tmp_path):
    for argv, match in [
        (["--validation.freq", "0"], "--validation.freq: expected an integer >= 1, got 0"),
        (["--validation.steps", "0"], r"--validation.steps: expected -1 \(the whole split\) or an integer >= 1"),
        (["--validation.seq_len", "512", "--training.seq_len", "256"], r"--validation.seq_len: .*training.seq_len = 256"),
        (["--validation.split_every", "1"], "--validation.split_every: expected an integer >= 2"),
        (["--validation.dataset_path", str(tmp_path / "missing.txt")], "--validation.dataset_path: no such file"),
        (["--validation.enable", "--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4",
          "--validation.local_batch_size", "6"], "--validation.local_batch_size: 6 is not a multiple of training"),
        (["--validation.enable", "--parallelism.context_parallel_degree", "2", "--training.seq_len", "32",
          "--validation.seq_len", "6"], "--validation.seq_len: 6 is not divisible by 2 x context_parallel_degree"),
    ]:
        with pytest.raises(ConfigError, match=match):
            parse_args(argv)


def test_bad_validation_data_is_a_one_line_error_before_the_model_is_built(tmp_path, capsys):
    binary = tmp_path / "val.txt"
    binary.write_bytes(b"text\n\n\xff\xfe\x00\x01")
    rc, recs, _ = _run(tmp_path / "run", "--validation.enable", "--validation.dataset_path", str(binary))
    err = capsys.readouterr()
    assert rc == 1 and recs == []
    assert "--validation.dataset_path: " in err.err and "val.txt is not a text file: a NUL byte at byte offset 8" in err.err
    assert "Traceback" not in err.err and "model llama3" not in err.out  # before the model
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    rc, _, _ = _run(tmp_path / "run2", "--validation.enable", "--validation.dataset_path", str(empty))
    err = capsys.readouterr().err
    assert rc == 1 and "has no text to evaluate" in err and len(err.strip().splitlines()) == 1
