"""Helpers shared by the trainer tests."""
import json
from functools import partial
from pathlib import Path

import torch

from trainer.models.llama3.args import LLAMA31_ROPE_SCALING, Llama3Args
from trainer.registry import build_model
from trainer.registry import model_args as family_model_args

# The Llama 3 flavor's args for a tokenizer and sequence length: llama_model_args("8B", 128256, 8192).
llama_model_args = partial(family_model_args, "llama3")


def tiny_llama(dim: int, vocab_size: int, multiple_of: int, max_seq_len: int, **kw) -> Llama3Args:
    """A 2-layer debug Llama for in-process tests: GQA (4 heads, 2 kv heads) and Llama 3.1's rope
    scaling, at the test's own sizes (``kw``: any other Llama3Args field)."""
    return Llama3Args(dim=dim, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=vocab_size, multiple_of=multiple_of,
                      rope_scaling=LLAMA31_ROPE_SCALING, max_seq_len=max_seq_len, **kw)


def rel(a, b) -> float:
    """Relative norm error of ``a`` against ``b``, in float64 (against a zero ``b``: ``a``'s norm over 1e-30)."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_matches_float64(module, x, out, x64, want, params64: dict, tol: float = 1e-5) -> None:
    """``out`` (``module(x)``) against ``want``, its float64 reference from ``x64`` and the float64
    parameters ``params64`` (by ``module``'s names): the values, then, for one random output gradient,
    the gradients of the input and of every parameter."""
    assert rel(out, want) < tol
    dout = torch.randn_like(out)
    out.backward(dout)
    want.backward(dout.double())
    assert rel(x.grad, x64.grad) < tol
    for name, p in module.named_parameters():
        assert rel(p.grad, params64[name].grad) < tol, name


def cpu_model(args, seed: int = 0):
    """The model of ``args`` on the CPU with ``init_weights(seed)``."""
    model = build_model(args, device="cpu")
    model.init_weights(seed)
    return model


def assert_near_published(counted: tuple[float, ...], published: tuple[float, ...], rounding: float = 0.0) -> None:
    """Parameter counts (e.g. total and active) each within 1% of a published figure, or within half a
    unit of the figure's last digit (``rounding``) where that is wider."""
    for c, p in zip(counted, published, strict=True):
        assert abs(c - p) <= max(0.01 * p, rounding * 1.03), (counted, published)


def train_records(dump_folder, *argv: str) -> list[dict]:
    """``python -m trainer`` (in this process) with ``argv``, every step logged, writing into
    ``dump_folder``; returns the metrics.jsonl records after asserting exit code 0."""
    from trainer import train
    from trainer.config import parse_args

    config = parse_args([*argv, "--metrics.log_freq", "1", "--metrics.save_plot", "false",
                         "--job.dump_folder", str(dump_folder)])
    assert train.main(config) == 0
    return [json.loads(line) for line in (Path(dump_folder) / "metrics.jsonl").read_text().splitlines()]



def assert_debugmodel_learns(dump_folder, family: str, *argv: str, seq_len: int = 128) -> list[dict]:
    """8 steps of ``family``'s debugmodel (batch 4, lr 2e-3 after 2 warmup steps, ``argv`` on top): the
    loss falls by more than 0.5. Returns the steps' records."""
    records = train_records(dump_folder, "--model.name", family, "--flavor", "debugmodel", "--training.steps", "8",
                            "--training.seq_len", str(seq_len), "--training.local_batch_size", "4",
                            "--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "2e-3", *argv)
    losses = [r["loss"] for r in records]
    assert losses[-1] < losses[0] - 0.5, losses
    return records

def config_error(argv: list[str]) -> str:
    """The ConfigError message ``parse_args(argv)`` raises, checked to be one line."""
    import pytest

    from trainer.config import ConfigError, parse_args

    with pytest.raises(ConfigError) as info:
        parse_args(argv)
    msg = str(info.value)
    assert "\n" not in msg, f"error message is not one line: {msg!r}"
    return msg
