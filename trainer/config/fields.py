"""The field-level rules that validation and the command line share: a field's type in words,
converting a command-line string or a TOML value to that type, writing a value as TOML, walking
every field of a configuration, and the did-you-mean suggestion of error messages.

Every conversion error is a :class:`ConfigError` naming the key. Imports only
:mod:`trainer.config.sections` of the package.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from typing import Any, Iterator

from trainer.errors import ConfigError

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


@functools.lru_cache(maxsize=None)
def field_hints(cls: type) -> dict[str, Any]:
    """The resolved type of every field of the dataclass ``cls`` (its annotations are strings)."""
    return typing.get_type_hints(cls)


def iter_fields(config: Any) -> Iterator[tuple[str, dataclasses.Field, Any, Any]]:
    """Every key of ``config`` (a :class:`trainer.config.JobConfig`) in declaration order.

    Yields ``(section, field, type, value)``: the section's name, the ``dataclasses.Field`` declared
    for the key (its ``metadata`` holds the help text and the choices), the key's resolved type and
    its current value.
    """
    for section, cls in field_hints(type(config)).items():
        obj = getattr(config, section)
        hints = field_hints(cls)
        declared = {f.name: f for f in dataclasses.fields(cls)}
        for f in dataclasses.fields(obj):
            yield section, declared[f.name], hints[f.name], getattr(obj, f.name)


def toml_value(value: Any) -> str:
    """``value`` (bool, int, float, str or a list of them) written as a TOML value.

    Raises TypeError for any other type.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def suggest(name: str, candidates: typing.Iterable[str]) -> str | None:
    """The closest candidate to ``name`` whose meaning is plausibly the same, or None.

    Plain names (values, section names) match on the whole text. For ``section.key`` candidates the
    key part must be close (a key named like another of a different meaning is not suggested): within
    the same section (spelled alike) a key ratio >= 0.6 will do; from another section, or for a name
    without a section (``--steps``), the key must match closely (>= 0.75) and be specific, i.e. not a
    word that more than three sections use (``enable``, ``folder``, ``freq``...).
    """
    def ratio(a: str, b: str) -> float:
        return difflib.SequenceMatcher(None, a.lower(), b.lower()).ratio()

    candidates = list(candidates)
    sections: dict[str, set[str]] = {}
    for cand in candidates:
        sec, dot, key = cand.partition(".")
        if dot:
            sections.setdefault(key, set()).add(sec)
    section, dot, leaf = name.rpartition(".") if "." in name else ("", "", name)
    best, best_score = None, 0.0
    for cand in candidates:
        if "." not in cand:
            score = ratio(name, cand) if "." not in name else 0.0
            score = score if score >= 0.6 else 0.0
        else:
            cand_section, cand_leaf = cand.rsplit(".", 1)
            key_score = ratio(leaf, cand_leaf)
            same_section = bool(section) and ratio(section, cand_section) >= 0.8
            if same_section:
                score = key_score + 0.05 if key_score >= 0.6 else 0.0
            else:
                specific = len(sections.get(cand.partition(".")[2], ())) <= 3
                score = key_score if key_score >= 0.75 and specific else 0.0
        if score > best_score:
            best, best_score = cand, score
    return best


def suggest_value(value: str, choices: typing.Iterable[str]) -> str | None:
    """The allowed value closest in spelling to ``value`` (ratio >= 0.6, case ignored), or None. Values
    are matched whole: a dot in one (``1.7B``) is part of it, not a section."""
    best, best_score = None, 0.6
    for choice in choices:
        score = difflib.SequenceMatcher(None, value.lower(), choice.lower()).ratio()
        if score >= best_score and (best is None or score > best_score):
            best, best_score = choice, score
    return best


def field_choices(f: dataclasses.Field) -> tuple[str, ...] | None:
    """The allowed values of a string field (its ``choices`` metadata, called when a function)."""
    choices = f.metadata.get("choices")
    return tuple(choices()) if callable(choices) else choices


def choice_message(key: str, value: Any, choices: typing.Iterable[str]) -> str:
    """The one-line error for ``value`` of ``key`` not being one of ``choices``, with a suggestion."""
    choices = list(choices)
    msg = f"--{key}: expected one of {', '.join(choices)}, got {value!r}"
    hint = suggest_value(str(value), choices)
    return msg + (f" (did you mean {hint!r}?)" if hint else "")


def type_name(hint: Any) -> str:
    """A field type in the words of error messages: ``an integer``, ``true/false``..."""
    if hint is bool:
        return "true/false"
    if hint is int:
        return "an integer"
    if hint is float:
        return "a number"
    if hint is str:
        return "a string"
    if _is_optional(hint):
        return f"none or {type_name(_optional_inner(hint))}"
    if typing.get_origin(hint) is list:
        return "a comma-separated list"
    return str(hint)


def _is_optional(hint: Any) -> bool:
    return typing.get_origin(hint) is typing.Union and type(None) in typing.get_args(hint)


def _optional_inner(hint: Any) -> Any:
    return next(a for a in typing.get_args(hint) if a is not type(None))


def parse_str(key: str, text: str, hint: Any) -> Any:
    """Convert a command-line string to the field's type, or raise ConfigError naming the key.

    Args:
        key: ``section.key``, for the message.
        text: the string as given (``true``/``1``/``yes``/``on`` and their opposites for booleans,
            ``none`` for an optional, comma-separated items for a list).
        hint: the field's resolved type.
    """
    bad = ConfigError(f"--{key}: expected {type_name(hint)}, got {text!r}")
    if _is_optional(hint):
        if text.strip().lower() in ("none", "null", ""):
            return None
        try:
            return parse_str(key, text, _optional_inner(hint))
        except ConfigError:
            raise bad from None
    if hint is bool:
        low = text.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise bad
    if hint is int:
        try:
            return int(text.strip())
        except ValueError:
            raise bad from None
    if hint is float:
        try:
            return float(text.strip())
        except ValueError:
            raise bad from None
    if hint is str:
        return text
    if typing.get_origin(hint) is list:
        return [part.strip() for part in text.split(",") if part.strip()]
    raise bad


def check_value(key: str, value: Any, hint: Any, where: str) -> Any:
    """Check a value read from TOML (or set in code) against the field's type; ints are accepted for
    floats (and returned as floats), a string for a list (split as on the command line).

    Args:
        key: ``section.key``, for the message.
        value: the value.
        hint: the field's resolved type.
        where: the start of the message: ``"<file>.toml: "`` or ``"--"``.

    A list field also takes a table of inline tables (``[optimizer.groups]``), one item per entry.
    Returns the value in the field's type. Raises ConfigError naming the key.
    """
    bad = ConfigError(f"{where}{key}: expected {type_name(hint)}, got {value!r} ({type(value).__name__})")
    if _is_optional(hint):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        try:
            return check_value(key, value, _optional_inner(hint), where)
        except ConfigError:
            raise bad from None
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise bad
    if hint is str:
        if isinstance(value, str):
            return value
        raise bad
    if typing.get_origin(hint) is list:
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
        if isinstance(value, str):
            return parse_str(key, value, hint)
        if isinstance(value, dict) and all(isinstance(v, dict) for v in value.values()):
            # A TOML table of inline tables ([optimizer.groups]): each entry NAME = {k = v, ...} is the
            # item "NAME: k=v ...", the form the command line gives.
            return [f"{name}: " + " ".join(f"{k}={_plain(v)}" for k, v in entries.items())
                    for name, entries in value.items()]
        raise bad
    raise bad


def _plain(value: Any) -> str:
    """A TOML scalar as the command line writes it (true/false, numbers, bare strings)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
