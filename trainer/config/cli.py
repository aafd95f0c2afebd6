"""The command line and TOML files: ``parse_args`` builds a validated :class:`JobConfig` from
``--config FILE.toml``, ``--flavor NAME`` and ``--section.key value`` overrides; ``--help`` text.

Layers (each overrides the one before): the dataclass defaults, one TOML file (``--config``, else the
flavor's own ``trainer/configs/<flavor>.toml``), the command-line overrides. Every error is a
one-line :class:`ConfigError` naming the key, with a did-you-mean suggestion for a misspelled one.

The top of the package: imports :mod:`~trainer.config.job`, :mod:`~trainer.config.fields`,
:mod:`~trainer.config.flavors`, :mod:`~trainer.config.sections` and :mod:`~trainer.config.validate`;
nothing in the package imports it.
"""
from __future__ import annotations

import dataclasses
import pathlib
import sys
import typing
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

from trainer.config.fields import check_value, field_choices, parse_str, suggest, toml_value, type_name
from trainer.config.flavors import families, family_flavors, flavor_config_path
from trainer.config.job import JobConfig
from trainer.config.sections import ConfigError
from trainer.config.validate import validate_config

# The key table: section name -> section class, and section -> key -> resolved type.
_SECTIONS: dict[str, type] = typing.get_type_hints(JobConfig)
_HINTS: dict[str, dict[str, Any]] = {name: typing.get_type_hints(cls) for name, cls in _SECTIONS.items()}


def all_keys() -> list[str]:
    """Every ``section.key`` name, in declaration order."""
    return [f"{s}.{f.name}" for s, cls in _SECTIONS.items() for f in dataclasses.fields(cls)]


def _unknown_key_message(key: str, where: str = "") -> str:
    hint = suggest(key, all_keys() + ["config", "flavor", "help"])
    msg = f"{where}unknown option --{key}"
    return msg + (f"; did you mean --{hint}?" if hint else "; see --help for the list of options")


# ----------------------------------------------------------------------------------------------
# TOML files



def apply_toml(config: JobConfig, path: str | pathlib.Path) -> JobConfig:
    """Override ``config`` in place with the values of the TOML file ``path``; returns ``config``.

    Raises:
        ConfigError: a missing file, text that is not TOML, an unknown section or key (with a
            did-you-mean suggestion) or a value of the wrong type; the message names the file and key.
    """
    path = pathlib.Path(path)
    where = f"{path.name}: "
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"--config: file not found: {str(path)!r}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}not valid TOML: {str(exc).splitlines()[0]}") from None
    for section, values in data.items():
        if section not in _SECTIONS:
            hint = suggest(section, _SECTIONS)
            raise ConfigError(
                f"{where}unknown section [{section}]" + (f"; did you mean [{hint}]?" if hint else "")
            )
        if not isinstance(values, dict):
            raise ConfigError(f"{where}{section}: expected a [{section}] table, got {values!r}")
        obj = getattr(config, section)
        for key, value in values.items():
            full = f"{section}.{key}"
            if key not in _HINTS[section]:
                raise ConfigError(_unknown_key_message(full, where))
            setattr(obj, key, check_value(full, value, _HINTS[section][key], where))
    return config


# ----------------------------------------------------------------------------------------------
# Command line


def _split_argv(argv: list[str]) -> tuple[str | None, str | None, list[tuple[str, str | None]]]:
    """Split argv into (config file, flavor, [(section.key, raw value or None for a bare flag)])."""
    config_file: str | None = None
    flavor: str | None = None
    items: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"unexpected argument {arg!r}; options look like --section.key value")
        name, eq, inline = arg[2:].partition("=")
        name = name.replace("-", "_")  # --training.local-batch-size works too
        value: str | None = inline if eq else None
        if name in ("config", "flavor", "model.flavor"):
            if value is None:
                if i >= len(argv):
                    raise ConfigError(f"--{name}: missing value (expected a string)")
                value = argv[i]
                i += 1
            if name == "config":
                config_file = value
            else:
                flavor = value
            continue
        section, dot, key = name.partition(".")
        if not dot or section not in _HINTS or key not in _HINTS[section]:
            raise ConfigError(_unknown_key_message(name))
        hint = _HINTS[section][key]
        if value is None:
            nxt = argv[i] if i < len(argv) else None
            if hint is bool:
                # A bare flag means true; a following non-option word is its value.
                if nxt is not None and not nxt.startswith("--"):
                    value = nxt
                    i += 1
            elif nxt is None or (nxt.startswith("--") and not _is_number(nxt)):
                raise ConfigError(f"--{name}: missing value (expected {type_name(hint)})")
            else:
                value = nxt
                i += 1
        items.append((name, value))
    return config_file, flavor, items


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def parse_args(argv: list[str] | None = None) -> JobConfig:
    """Build and validate a :class:`JobConfig` from command-line arguments.

    Args:
        argv: the arguments without the program name; ``None`` means ``sys.argv[1:]``.

    Layers: defaults < ``--config FILE.toml`` (or, without it, ``trainer/configs/<family>/<flavor>.toml``)
    < ``--section.key value`` overrides. ``--help`` prints every key and raises ``SystemExit(0)``.

    Raises:
        ConfigError: an unknown key (with a did-you-mean suggestion), a value of the wrong type,
            a missing value, an unreadable TOML file or a value that fails
            :func:`~trainer.config.validate.validate_config`.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    wants_help = any(a in ("--help", "-h") for a in argv)
    if wants_help:
        argv = [a for a in argv if a not in ("--help", "-h")]
    config_file, flavor, items = _split_argv(argv)
    # The family picks the flavor's file (configs/<family>/<flavor>.toml), so it is read before the TOML layer.
    name = next((raw for key, raw in items if key == "model.name" and raw is not None), None)
    config = _base_config(config_file, flavor, name)
    if wants_help:
        print(help_text(config))
        raise SystemExit(0)
    for name, raw in items:
        section, _, key = name.partition(".")
        hint = _HINTS[section][key]
        value = True if raw is None else parse_str(name, raw, hint)
        setattr(getattr(config, section), key, value)
    validate_config(config)
    return config


def _base_config(config_file: str | None, flavor: str | None, model_name: str | None = None) -> JobConfig:
    """Defaults overridden by the TOML layer: ``config_file``, else the flavor's own file (of the
    family ``model_name``, default llama3)."""
    config = JobConfig()
    if config_file is not None:
        apply_toml(config, config_file)
    else:
        path = flavor_config_path(flavor or config.model.flavor, model_name or config.model.name)
        if path.is_file():
            apply_toml(config, path)
        # A flavor without a file is reported by validate_config() with the list of known flavors.
    if flavor is not None:
        config.model.flavor = flavor
    return config


def help_text(defaults: JobConfig | None = None) -> str:
    """The ``--help`` text: every option with its default and meaning.

    Args:
        defaults: the configuration whose values are shown as defaults (e.g. a flavor's TOML applied);
            None = the default flavor's.
    """
    if defaults is None:
        defaults = _base_config(None, None)
    lines = [
        "usage: python -m trainer [--config FILE.toml] [--model.name FAMILY] [--flavor NAME] [--section.key value ...]",
        "",
        "Pre-trains decoder LLMs. Values come from the defaults below, then the TOML file (--config, or",
        "trainer/configs/<family>/<flavor>.toml), then the command line. Boolean keys also work as bare flags.",
        f"Defaults shown are those of --model.name {defaults.model.name} --flavor {defaults.model.flavor}.",
        "",
        "  --config FILE.toml   read this TOML file instead of the flavor's",
        "  --flavor NAME        short for --model.flavor; the flavors of each family (--model.name):",
    ]
    lines += [f"      {name}: {', '.join(family_flavors(name))}" for name in families()]
    lines.append("  --help               show this list and exit")
    for section, cls in _SECTIONS.items():
        lines += ["", f"[{section}] {(cls.__doc__ or '').strip()}"]
        for f in dataclasses.fields(cls):
            default = getattr(getattr(defaults, section), f.name)
            shown = "none" if default is None else toml_value(default)
            if isinstance(default, list):
                shown = ",".join(default)
            choices = field_choices(f)
            extra = f" [{'|'.join(choices)}]" if choices else ""
            lines.append(f"  --{section}.{f.name} (default: {shown}){extra}")
            lines.append(f"      {f.metadata.get('help', '')}")
    return "\n".join(lines)
