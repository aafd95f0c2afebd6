"""``python -m trainer [--config FILE.toml] [--flavor NAME] [--section.key value ...]``.

Parses the command line (see ``trainer/config/`` and ``--help``), then runs
:func:`trainer.train.main` and exits with its return code. A configuration error prints one line on
stderr and exits with status 2; Ctrl-C exits with status 130 without a traceback.
"""
from __future__ import annotations

import sys

from trainer.config import ConfigError, parse_args


def main(argv: list[str] | None = None) -> int:
    """Run the trainer with ``argv`` (default ``sys.argv[1:]``); returns the process exit code."""
    try:
        config = parse_args(argv)
    except ConfigError as exc:
        print(f"python -m trainer: error: {exc}", file=sys.stderr)
        return 2
    if config.job.print_config:
        print(config.to_toml(), flush=True)
    # Imported here so that --help and configuration errors answer without loading torch.
    from trainer.train import main as train_main

    try:
        return int(train_main(config))
    except ConfigError as exc:  # a relation only known at run time, e.g. the batch vs. the world size
        print(f"python -m trainer: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("python -m trainer: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
