"""The trainer's configuration: dataclass sections, TOML files and ``--section.key value`` overrides.

A run's configuration is built in layers, each overriding the one before:

1. the dataclass defaults (:mod:`trainer.config.sections`);
2. a TOML file: ``--config FILE.toml`` if given, otherwise the flavor's own file
   ``trainer/configs/<flavor>.toml`` (the flavor is ``--flavor``/``--model.flavor`` or ``debugmodel``);
3. command-line overrides ``--section.key value`` (also ``--section.key=value``).

Keys follow torchtitan's names where the meaning is the same (``--training.steps``,
``--lr_scheduler.warmup_steps``, ``--parallelism.data_parallel_shard_degree``...); torchtitan's other
names are aliases (``--debug.seed``) or refused with the reason (``trainer/config/torchtitan_keys.py``).
``--flavor`` is short for ``--model.flavor``. A boolean key works as a bare flag
(``--checkpoint.enable``) or with a value (``--checkpoint.enable false``). ``--help`` lists every key with its default and meaning.

Every error (unknown key, wrong type, bad value) is a :class:`ConfigError` whose message is one line
naming the key; for a misspelled key it suggests the closest existing one.

The package, imports flowing one way (each module imports only those above it):

- ``sections.py``: :class:`ConfigError` and one dataclass per ``[section]`` (defaults, help, choices);
- ``flavors.py``: which flavors have a TOML file in ``trainer/configs/`` and where it is;
- ``torchtitan_keys.py``: torchtitan's names: aliases of ours, refused ones with the reason, and
  ``model.converters``/``model.hf_assets_path``, which set other keys;
- ``fields.py``: a field's type: converting strings and TOML values to it, writing it as TOML;
- ``job.py``: :class:`JobConfig`, the sections together;
- ``validate.py``: checking a configuration: every value and the relations between them
  (:func:`validate_config`; not the validation loss, which is ``trainer.evaluate``);
- ``cli.py``: TOML files, the command line (:func:`parse_args`) and ``--help``.

Import from ``trainer.config``; the names below are its public surface. The package imports neither
torch nor the rest of the trainer, so ``--help`` and config errors are fast.
"""
from trainer.config import sections
from trainer.config.cli import all_keys, apply_toml, help_text, parse_args
from trainer.config.flavors import CONFIG_DIR, available_flavors, flavor_config_path
from trainer.config.job import JobConfig
from trainer.config.sections import *  # noqa: F403  (ConfigError and one dataclass per section: sections.__all__)
from trainer.config.validate import validate_config

__all__ = [
    "CONFIG_DIR", "JobConfig", "all_keys", "apply_toml", "available_flavors", "flavor_config_path", "help_text",
    "parse_args", "validate_config", *sections.__all__,
]
