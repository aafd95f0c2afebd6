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

import copy
import dataclasses
import os
import re
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
from trainer.errors import ConfigError
from trainer.config.torchtitan_keys import CONFIG_FILE_KEY, NEAR, REFUSED, alias_names, apply_model_keys, lookup
from trainer.config.validate import validate_config

# The key table: section name -> section class, and section -> key -> resolved type.
_SECTIONS: dict[str, type] = typing.get_type_hints(JobConfig)
_HINTS: dict[str, dict[str, Any]] = {name: typing.get_type_hints(cls) for name, cls in _SECTIONS.items()}


def all_keys() -> list[str]:
    """Every ``section.key`` name, in declaration order."""
    return [f"{s}.{f.name}" for s, cls in _SECTIONS.items() for f in dataclasses.fields(cls)]


def _unknown_key_message(key: str, where: str = "") -> str:
    # torchtitan's names (accepted as aliases) are candidates beside ours; refused ones are not.
    names = all_keys() + [n for n in alias_names() if n not in REFUSED] + ["config", "flavor", "help"]
    hint = NEAR.get(key) or suggest(key, names)
    msg = f"{where}unknown option --{key}"
    return msg + (f"; did you mean --{hint}?" if hint else "; see --help for the list of options")


def resolve_key(name: str, where: str = "") -> tuple[str, str, bool]:
    """``(section, key, negated)`` of our key for the option ``name`` (``section.key``, ours or a
    torchtitan alias; ``negated``: a boolean alias of the opposite meaning).

    Raises:
        ConfigError: an unknown option (with a did-you-mean suggestion) or a torchtitan option refused
            here (with the reason); the message starts with ``where``.
    """
    section, dot, key = name.partition(".")
    if dot and section in _HINTS and key in _HINTS[section]:
        return section, key, False
    try:
        found = lookup(name)
    except ConfigError as exc:
        raise ConfigError(f"{where}{exc}") from None
    if found is None:
        raise ConfigError(_unknown_key_message(name, where))
    target, negated = found
    section, _, key = target.partition(".")
    return section, key, negated


# ----------------------------------------------------------------------------------------------
# TOML files



def apply_toml(config: JobConfig, path: str | pathlib.Path, errors: list[str] | None = None) -> JobConfig:
    """Override ``config`` in place with the values of the TOML file ``path``; returns ``config``.

    ``errors``: a list that collects the error lines of the file's keys instead (the caller reports
    them with the rest); None = raise them, all at once.

    Raises:
        ConfigError: a missing file, text that is not TOML, an unknown section or key (with a
            did-you-mean suggestion) or a value of the wrong type; the message names the file and key,
            one line per error.
    """
    path = pathlib.Path(path)
    where = f"{path.name}: "
    if path.is_dir():
        raise ConfigError(f"--config: expected a TOML file, got the folder {str(path)!r}")
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"--config: file not found: {str(path)!r}") from None
    except OSError as exc:  # unreadable: permissions, a device, a folder named by a link
        raise ConfigError(f"--config: cannot read {str(path)!r} ({exc.strerror or exc})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}not valid TOML: {str(exc).splitlines()[0]}") from None
    # Every key of the file is checked before any error is raised: all of the file's errors at once.
    collect = errors is not None
    errors = [] if errors is None else errors
    for name, value in _flatten(data, where, errors):
        try:
            if name == CONFIG_FILE_KEY:
                raise ConfigError(f"{where}{name}: the TOML file is given on the command line (--config or --{name})")
            section, key, negated = resolve_key(name, where)
            value = check_value(name, value, _HINTS[section][key], where)
        except ConfigError as exc:
            errors.append(str(exc))
            continue
        setattr(getattr(config, section), key, (not value) if negated else value)
    if not collect:
        raise_all(errors)
    return config


def raise_all(errors: list[str]) -> None:
    """Raise one ConfigError for ``errors`` (configuration error lines): the line itself for one,
    a count and one indented line per error for several (each once); nothing for none."""
    errors = list(dict.fromkeys(errors))
    if len(errors) == 1:
        raise ConfigError(errors[0])
    if errors:
        raise ConfigError(f"{len(errors)} configuration errors:\n" + "\n".join(f"  {e}" for e in errors))


def _flatten(data: dict[str, Any], where: str, errors: list[str], prefix: str = "") -> list[tuple[str, Any]]:
    """``(section.key, value)`` of a TOML document. A table of one of our sections is one level
    (a table value there is the key's own, e.g. ``[optimizer.groups]``); a table of torchtitan's
    (``[debug]``, ``[validator.dataloader]``) is walked down to dotted names. A table that is none of
    these appends its error line to ``errors`` and is skipped."""
    out: list[tuple[str, Any]] = []
    # every table above a torchtitan key: quantize, quantize.linear, quantize.linear.float8
    torchtitan_tables = {n.rsplit(".", i)[0] for n in alias_names() + list(REFUSED) for i in range(1, n.count(".") + 1)}
    for name, value in data.items():
        full = prefix + name
        if not prefix and full in _SECTIONS:
            if not isinstance(value, dict):
                errors.append(f"{where}{full}: expected a [{full}] table, got {value!r}")
                continue
            for key, v in value.items():
                if isinstance(v, dict) and f"{full}.{key}" in torchtitan_tables:  # e.g. [validation.dataloader]
                    out += _flatten(v, where, errors, f"{full}.{key}.")
                else:
                    out.append((f"{full}.{key}", v))
        elif isinstance(value, dict) and full in torchtitan_tables:
            out += _flatten(value, where, errors, full + ".")
        elif isinstance(value, dict) and not prefix:
            hint = suggest(full, _SECTIONS)
            errors.append(f"{where}unknown section [{full}]" + (f"; did you mean [{hint}]?" if hint else ""))
        else:
            out.append((full, value))
    return out


# ----------------------------------------------------------------------------------------------
# Command line


# An option as given: (our section.key, the name given, raw value or None for a bare flag, negated).
_Item = tuple[str, str, "str | None", bool]


def _split_argv(argv: list[str], errors: list[str]) -> tuple[str | None, str | None, list[_Item]]:
    """Split argv into (config file, flavor, the options as :data:`_Item`); unknown or refused options
    append their error line to ``errors`` and are left out."""
    config_file: str | None = None
    flavor: str | None = None
    items: list[_Item] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"unexpected argument {arg!r}; options look like --section.key value")
        name, eq, inline = arg[2:].partition("=")
        name = name.replace("-", "_")  # --training.local-batch-size works too
        value: str | None = inline if eq else None
        if name in ("config", CONFIG_FILE_KEY, "flavor", "model.flavor"):
            if value is None:
                if i >= len(argv):
                    raise ConfigError(f"--{name}: missing value (expected a string)")
                value = argv[i]
                i += 1
            if name in ("config", CONFIG_FILE_KEY):
                config_file = value
            else:
                flavor = value
            continue
        try:
            section, key, negated = resolve_key(name)
        except ConfigError as exc:  # reported with the others; its value, if any, is skipped
            errors.append(str(exc))
            if not eq and i < len(argv) and not argv[i].startswith("--"):
                i += 1
            continue
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
        items.append((f"{section}.{key}", name, value, negated))
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
    argv_errors: list[str] = []
    config_file, flavor, items = _split_argv(argv, argv_errors)
    # The family picks the flavor's file (configs/<family>/<flavor>.toml), so it is read before the TOML layer.
    name = next((raw for key, _, raw, _ in items if key == "model.name" and raw is not None), None)
    errors: list[str] = []
    config = _base_config(config_file, flavor, name, errors)
    errors += argv_errors
    if wants_help:
        try:
            print(help_text(config), flush=True)
        except BrokenPipeError:  # `--help | head`: the reader left; no traceback, and none at exit either
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(0)
    for target, given, raw, negated in items:
        section, _, key = target.partition(".")
        try:
            value = True if raw is None else parse_str(given, raw, _HINTS[section][key])
        except ConfigError as exc:
            errors.append(str(exc))
            continue
        setattr(getattr(config, section), key, (not value) if negated else value)
    raise_all(errors + value_errors(config))
    apply_model_keys(config)
    return config


def value_errors(config: JobConfig, limit: int = 32) -> list[str]:
    """Every error :func:`validate_config` finds in ``config`` (before :func:`apply_model_keys`, which
    each check applies to a copy), not only the first: after each error the key it names is put back
    to its default and the check runs again, until the configuration passes, an error names no key,
    or ``limit`` errors. Returns the error lines."""
    config = copy.deepcopy(config)
    defaults = JobConfig()
    errors: list[str] = []
    named: set[tuple[str, str]] = set()  # the keys the errors so far name
    while len(errors) < limit:
        try:
            derived = copy.deepcopy(config)
            apply_model_keys(derived)
            validate_config(derived)
            break
        except ConfigError as exc:
            line = str(exc)
        if line in errors:  # putting the key back did not clear it: a relation of other keys
            break
        m = re.match(r"^(?:[^:]*: )?--([a-z_0-9]+)\.([a-z_0-9]+)[:\s]", line)
        if m is not None and m.groups() in named:  # about the default put back, not the user's value
            break
        errors.append(line)
        if m is None or m.group(1) not in _HINTS or m.group(2) not in _HINTS[m.group(1)]:
            break
        section, key = m.groups()
        named.add((section, key))
        if getattr(getattr(config, section), key) == getattr(getattr(defaults, section), key):
            break
        setattr(getattr(config, section), key, copy.deepcopy(getattr(getattr(defaults, section), key)))
    return errors


def _base_config(config_file: str | None, flavor: str | None, model_name: str | None = None,
                 errors: list[str] | None = None) -> JobConfig:
    """Defaults overridden by the TOML layer: ``config_file``, else the flavor's own file (of the
    family ``model_name``, default llama3). ``errors``: collects the file's key errors (see
    :func:`apply_toml`)."""
    config = JobConfig()
    if config_file is not None:
        apply_toml(config, config_file, errors)
    else:
        path = flavor_config_path(flavor or config.model.flavor, model_name or config.model.name)
        if path.is_file():
            apply_toml(config, path, errors)
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
        "  --config FILE.toml   read this TOML file instead of the flavor's (also --job.config_file)",
        "  --flavor NAME        short for --model.flavor; the flavors of each family (--model.name):",
    ]
    lines += [f"      {name}: {', '.join(family_flavors(name))}" for name in families()]
    lines.append("  --help               show this list and exit")
    lines.append("torchtitan's names of these keys are accepted too (--debug.seed, --profiler.*, --validator.*, "
                 "--dump_folder, --hf_assets_path...); one that means nothing here is refused with the reason.")
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
