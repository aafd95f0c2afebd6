"""The options of a run that its model does not use, refused in one line each: an option that only
some models read (``ModelArgs.OPTIONS``: the MoE balancing keys, multi-token prediction, expert
parallel, QK-clip...) given to a model that does not read it would otherwise be accepted and ignored.

Torch-free: ``trainer.config.validate`` checks a flavor's args when the configuration is parsed, and
the trainer checks the args a Hugging Face config.json gives (``--flavor custom``) before the model is
built.
"""
from __future__ import annotations

from trainer import registry


def unused_option_errors(config, args, what: str | None = None) -> list[str]:
    """One error line per option ``config`` (a ``JobConfig``) sets that the model ``args`` does not use.

    Args:
        config: the run's configuration.
        args: the model's args, after ``configure(config.model)``.
        what: how the lines name the model (default: the family's title and the flavor).
    """
    if what is None:
        what = f"{registry.spec_of(args).title} {config.model.flavor}"
    defaults = type(config)()
    lines = []
    for key, why in args.unused_options(config):
        section, _, name = key.partition(".")
        value, default = getattr(getattr(config, section), name), getattr(getattr(defaults, section), name)
        shown = "none" if default is None else repr(default)
        lines.append(f"--{key}: {what} {why}; expected it unset ({shown}), got {value!r}")
    return lines
