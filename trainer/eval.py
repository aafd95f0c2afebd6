"""``python -m trainer.eval``: loss, perplexity and bits per byte of a checkpoint on a dataset.

    python -m trainer.eval [trainer flags] [--no_progress] [--json]

The trainer's flags say everything: the checkpoint (``--checkpoint.initial_load_path``, a DCP step
folder, a run's checkpoint folder or a Hugging Face folder; default the run's own
``<job.dump_folder>/<checkpoint.folder>``, its newest verified step: ``trainer.generate.load``),
the tokenizer (``--model.tokenizer_path``), and the data exactly as the in-run validation reads it
(``[validation]``: ``dataset`` / ``dataset_path``, else the held-out part of the training source
(``split_every``); ``seq_len``, ``local_batch_size``, ``steps`` (-1 = the whole split)). The figures
are those of the in-run validation (``trainer.evaluate.Validator``, the same forward and fused
loss), so a checkpoint evaluated here gives the ``val_loss`` its run logged at that step.

Reported: ``loss`` (mean token cross-entropy, nats), ``perplexity`` = exp(loss), ``bits_per_byte``
= summed loss / ln 2 / the UTF-8 bytes of the predicted text (BOS/EOS count no byte), comparable
across tokenizers; a progress bar with an ETA on stderr (when ``validation.steps`` bounds the pass).

Exit codes: 0 done; 1 no usable checkpoint, tokenizer or data (one line); 2 a bad option.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from trainer.environment import resolve_compute_dtype, setup_logging

import torch

from trainer.errors import CheckpointError
from trainer.data import build_validation_loader
from trainer.data.loader import IGNORE_INDEX
from trainer.evaluate import Validator
from trainer.generate.load import load_tokenizer, materialize, resolve_source, source_args
from trainer.step import micro_batch_loss


class Progress:
    """``done/total batches, tokens/s, ETA`` on one rewritten stderr line (total None: no ETA)."""

    def __init__(self, total: int | None, enabled: bool = True, out=None) -> None:
        self.total, self.enabled, self.out = total, enabled, out or sys.stderr
        self.done, self.tokens, self.t0 = 0, 0, time.perf_counter()

    def update(self, tokens: int) -> None:
        self.done += 1
        self.tokens += tokens
        if not self.enabled:
            return
        spent = time.perf_counter() - self.t0
        line = f"\reval: {self.done}" + (f"/{self.total}" if self.total else "") + " batches"
        if self.total:
            width = 24
            filled = int(width * self.done / self.total)
            eta = spent / self.done * (self.total - self.done)
            line = f"\reval [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}, ETA {eta:.0f}s"
        self.out.write(f"{line}, {self.tokens / max(spent, 1e-9):,.0f} tokens/s")
        self.out.flush()

    def close(self) -> None:
        if self.enabled and self.done:
            self.out.write("\n")
            self.out.flush()


def text_bytes(tokenizer, labels: torch.Tensor) -> int:
    """UTF-8 bytes of the text the non-ignored ``labels`` spell, each row decoded whole (BOS and
    EOS carry no text)."""
    total = 0
    special = {tokenizer.bos_id, tokenizer.eos_id}
    for row in labels.tolist():
        ids = [t for t in row if t != IGNORE_INDEX and t not in special]
        total += len(tokenizer.decode(ids).encode("utf-8")) if ids else 0
    return total


def evaluate_checkpoint(config, progress: bool = True) -> dict:
    """The figures of the module docstring for ``config``: ``loss``, ``perplexity``,
    ``bits_per_byte``, ``tokens``, ``bytes``, ``batches``, ``time_s``.

    Raises CheckpointError (no checkpoint), ValueError (tokenizer, data, empty split)."""
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    source = resolve_source(config)
    tokenizer = load_tokenizer(config, source)
    loader = build_validation_loader(config, tokenizer, 0, 1)
    loader.check()
    v = config.validation
    seq_len = config.training.seq_len if v.seq_len == -1 else v.seq_len
    args = source_args(config, source, tokenizer.vocab_size, seq_len)
    model = materialize(args, device, resolve_compute_dtype(config, device), source)
    model.return_hidden = True  # the fused output projection + loss, as training's default
    bar = Progress(v.steps if v.steps != -1 else None, enabled=progress)
    counted = {"bytes": 0}

    def batch_loss(inputs, labels, pos):
        loss = micro_batch_loss(model, model.token_loss, inputs, labels, pos)
        counted["bytes"] += text_bytes(tokenizer, labels)
        bar.update(int((labels != IGNORE_INDEX).sum()))
        return loss

    validator = Validator(loader, v.steps, device, batch_loss, document_masking=config.training.document_masking)
    try:
        result = validator.evaluate()
    finally:
        bar.close()
    loss_sum = result["val_loss"] * result["val_tokens"]
    n_bytes = counted["bytes"]
    return {"loss": result["val_loss"], "perplexity": result["val_perplexity"],
            "bits_per_byte": loss_sum / math.log(2) / n_bytes if n_bytes else math.nan,
            "tokens": result["val_tokens"], "bytes": n_bytes, "batches": result["val_batches"],
            "time_s": result["val_time_s"], "checkpoint": source.what}


def main(argv: list[str] | None = None) -> int:
    """Run ``python -m trainer.eval`` with ``argv``; returns the exit code."""
    from trainer.config import ConfigError, parse_args

    parser = argparse.ArgumentParser(prog="python -m trainer.eval", add_help=False)
    parser.add_argument("--no_progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="the figures as one JSON object on stdout")
    parser.add_argument("-h", "--help", action="store_true")
    ns, rest = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if ns.help:
        try:
            print(__doc__, flush=True)
        except BrokenPipeError:  # `--help | head`: the reader left
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    try:
        config = parse_args(rest)
    except ConfigError as exc:
        print(f"python -m trainer.eval: error: {exc}", file=sys.stderr)
        return 2
    # evaluating is validating: the held-out split of the training source (no [validation] dataset)
    # is read only when validation is on, so it is on here whether or not --validation.enable is passed
    config.validation.enable = True
    setup_logging(0)
    if ns.json:  # stdout is the one JSON object alone: the log goes to stderr
        import logging

        for handler in logging.getLogger("trainer").handlers:
            handler.setStream(sys.stderr)
    try:
        r = evaluate_checkpoint(config, progress=not ns.no_progress)
    except (CheckpointError, ValueError, RuntimeError, OSError) as exc:
        print(f"python -m trainer.eval: error: {exc}", file=sys.stderr)
        return 1
    if ns.json:
        print(json.dumps(r))
    else:
        print(f"{r['checkpoint']}: loss {r['loss']:.6f}, perplexity {r['perplexity']:.4f}, bits per byte "
              f"{r['bits_per_byte']:.4f} ({r['tokens']:,} tokens, {r['bytes']:,} bytes, {r['batches']} batches, "
              f"{r['time_s']:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
