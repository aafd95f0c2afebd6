"""``python -m trainer [--config FILE.toml] [--flavor NAME] [--section.key value ...]``.

Parses the command line (see ``trainer/config/`` and ``--help``), then runs
:func:`trainer.train.main` and exits with its return code. A configuration error prints one line on
stderr and exits with status 2 (under torchrun, every rank finds the same error and rank 0 alone prints
it); Ctrl-C exits with status 130 without a traceback.
"""
from __future__ import annotations

import os
import sys

from trainer.config import ConfigError, parse_args


def _config_error(exc: ConfigError) -> int:
    # The same configuration on every rank gives the same error: one line from rank 0, not one per rank.
    if os.environ.get("RANK", "0") == "0":
        print(f"python -m trainer: error: {exc}", file=sys.stderr)
    return 2


# The README's main job is ``python -m trainer`` alone: it also leaves a model to use, the Hugging Face
# folder <dump_folder>/checkpoint/hf-step-<N> (python -m trainer.generate and transformers load it),
# and prints one sample from it at the end. Any argument makes it an ordinary run.
MAIN_JOB = ["--checkpoint.last_save_in_hf", "--validation.sample_prompts", "The module"]


def main(argv: list[str] | None = None) -> int:
    """Run the trainer with ``argv`` (default ``sys.argv[1:]``; none: the main job, ``MAIN_JOB``);
    returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv) or list(MAIN_JOB)
    try:
        config = parse_args(argv)
    except ConfigError as exc:
        return _config_error(exc)
    if config.job.print_config:
        print(config.to_toml(), flush=True)
    # Imported here so that --help and configuration errors answer without loading torch.
    from trainer.train import main as train_main

    try:
        return int(train_main(config))
    except ConfigError as exc:  # a relation only known at run time, e.g. the batch vs. the world size
        return _config_error(exc)
    except KeyboardInterrupt:
        print("python -m trainer: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
