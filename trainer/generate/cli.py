"""``python -m trainer.generate``: text from a checkpoint, with the trainer's own flags.

    python -m trainer.generate [trainer flags] --prompt TEXT [--prompt TEXT ...] | --prompts_file FILE
        [--max_new_tokens 128] [--temperature 0] [--top_k 0] [--top_p 1] [--seed 0] [--batch_size 8]
        [--stop TEXT ...] [--json] [--no_stream]

The trainer's flags (``--model.name``, ``--flavor`` / ``--flavor custom``, ``--config`` /
``--job.config_file``, ``--checkpoint.initial_load_path``, ``--checkpoint.initial_load_in_hf``,
``--model.tokenizer_path``, ``--job.dump_folder``, ``--training.dtype``...) mean what they mean to
``python -m trainer``, so a training command becomes a generation command by changing the module
name: without ``--checkpoint.initial_load_path`` the run's own checkpoint folder is read (its newest
verified step; ``trainer.generate.load``).

Each prompt starts with BOS, as every training document does. Temperature 0 is greedy. A sequence
ends at EOS (included in ``ids``), at a ``--stop`` string (the completion ends before it) or after
``--max_new_tokens``. The first prompt's completion streams to stdout as it is generated (not with
``--json``); prefill and decode tokens/s go to stderr. ``--json`` prints one JSON object per prompt
and line: ``prompt``, ``completion``, ``prompt_ids``, ``ids``, ``logprobs`` (natural log, under the
model's distribution before temperature / top-k / top-p) and ``finish`` (eos, stop, length).

Under torchrun (WORLD_SIZE > 1) the ranks generate together with tensor parallel
(``--parallelism.tensor_parallel_degree`` = WORLD_SIZE; ``trainer.generate.tensor_parallel``); rank
0 prints. A family that is not a text decoder brings its own sampler through its ``ModelSpec.generate``
hook (``trainer.registry``), called with the configuration and these options.

Exit codes: 0 done; 1 no usable checkpoint, tokenizer or prompt (one line); 2 a bad option.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys

GEN_OPTIONS_HELP = "generation options (the other flags are the trainer's: python -m trainer --help)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer.generate", add_help=False,
                                description="Generate text from a checkpoint (DCP step, run folder or Hugging Face "
                                            "folder) with a KV cache.")
    g = p.add_argument_group(GEN_OPTIONS_HELP)
    g.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    g.add_argument("--prompts_file", default=None, help="a text file of prompts, one per line (blank lines skipped)")
    g.add_argument("--max_new_tokens", type=int, default=128, help="tokens generated per prompt at most (default 128)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top_k", type=int, default=0, help="sample among the k likeliest tokens; 0 = all (default)")
    g.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling mass; 1 = all (default)")
    g.add_argument("--seed", type=int, default=0, help="seed of the random draws (default 0)")
    g.add_argument("--batch_size", type=int, default=8, help="prompts generated together (default 8)")
    g.add_argument("--stop", action="append", default=[],
                   help="a stop string (repeatable); \\n, \\t, \\r and \\\\ in it are read as escapes")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt and line on stdout")
    g.add_argument("--no_stream", action="store_true", help="do not stream the first completion")
    g.add_argument("-h", "--help", action="store_true")
    return p


def _fail(message: str, code: int = 1) -> int:
    if os.environ.get("RANK", "0") == "0":
        print(f"python -m trainer.generate: error: {message}", file=sys.stderr)
    return code


def parse(argv: list[str]):
    """(generation options, the trainer's JobConfig). Raises ConfigError / ValueError (one line)."""
    parser = build_parser()
    ns, rest = parser.parse_known_args(argv)
    if ns.help:
        parser.print_help()
        print("\nEvery trainer flag works too (python -m trainer --help).")
        raise SystemExit(0)
    for name, ok, expected in (("max_new_tokens", ns.max_new_tokens >= 1, "an integer >= 1"),
                               ("batch_size", ns.batch_size >= 1, "an integer >= 1"),
                               ("temperature", math.isfinite(ns.temperature) and ns.temperature >= 0,
                                "a finite number >= 0 (0 = greedy)"),
                               ("top_k", ns.top_k >= 0, "an integer >= 0 (0 = all tokens)"),
                               ("top_p", 0 < ns.top_p <= 1, "a number in (0, 1]")):
        if not ok:
            raise ValueError(f"--{name}: expected {expected}, got {getattr(ns, name)!r}")
    if ns.prompts_file:
        try:
            with open(ns.prompts_file, encoding="utf-8") as fh:
                ns.prompt += [line.rstrip("\n") for line in fh if line.strip()]
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--prompts_file: cannot read {ns.prompts_file}: {exc.__class__.__name__}") from None
    # `--stop "\n\n"` (the README's) reaches us as backslash-n twice from the shell: read the escapes
    ns.stop = [re.sub(r"\\([ntr\\])", lambda m: {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}[m.group(1)], s)
               for s in ns.stop]
    if any(not s for s in ns.stop):
        raise ValueError("--stop: expected a non-empty string")
    for key, texts in (("prompt", ns.prompt), ("stop", ns.stop)):  # argv bytes that are not UTF-8 come as surrogates
        for text in texts:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(f"--{key}: expected UTF-8 text, got the byte 0x{ord(text[exc.start]) & 0xFF:02x} "
                                 f"at character {exc.start} of {text!r}") from None
    from trainer.config import parse_args

    return ns, parse_args(rest)


def family_of(argv: list[str]) -> str | None:
    """The ``--model.name`` of a command line: the flag (``--model.name X`` or ``--model.name=X``), else
    the ``[model] name`` of its ``--config`` / ``--job.config_file`` TOML; None when neither says."""
    for i, word in enumerate(argv):
        if word == "--model.name" and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith("--model.name="):
            return word.partition("=")[2]
    for i, word in enumerate(argv):
        if word in ("--config", "--job.config_file") and i + 1 < len(argv):
            import tomllib

            try:
                with open(argv[i + 1], "rb") as fh:
                    return tomllib.load(fh).get("model", {}).get("name")
            except (OSError, tomllib.TOMLDecodeError, AttributeError):
                return None  # the trainer's parser names the problem
    return None


def main(argv: list[str] | None = None) -> int:
    """Run ``python -m trainer.generate`` with ``argv``; returns the exit code."""
    from trainer import registry
    from trainer.errors import ConfigError

    argv = list(sys.argv[1:] if argv is None else argv)
    name = family_of(argv)
    if name in registry.names():
        spec = registry.get(name)
        if spec.generate is not None:  # a family that is not a text decoder: its own flags and sampler
            return int(spec.load(spec.generate)(argv))
    try:
        options, config = parse(argv)
    except (ConfigError, ValueError) as exc:
        return _fail(str(exc), 2)
    if not options.prompt:
        return _fail("no prompt: pass --prompt TEXT (repeatable) or --prompts_file FILE", 2)
    from trainer.generate.run import run_decoder

    options.family = name  # the --model.name given (None: not given), checked against the checkpoint's
    return run_decoder(config, options)


if __name__ == "__main__":
    sys.exit(main())
