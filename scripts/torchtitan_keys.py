"""Write the command-line keys of a torchtitan source tree as JSON, read from its source with ``ast``
(nothing of it is imported, so neither torchtitan nor its dependencies need be installed).

    python scripts/torchtitan_keys.py torchtitan-0.3.0-py3-none-any.whl > tests/data/torchtitan_0.3.0_keys.json

(the argument: a wheel, read in place, which also gives the version and the wheel's sha256; or an
unpacked ``torchtitan`` package folder). Several wheels give one file with each key's releases:

    python scripts/torchtitan_keys.py torchtitan-0.1.0-*.whl torchtitan-0.2.0-*.whl torchtitan-0.2.1-*.whl \
        torchtitan-0.2.2-*.whl > tests/data/torchtitan_earlier_keys.json

The root is ``Trainer.Config`` (torchtitan/trainer.py; releases before 0.3.0: ``JobConfig`` of
torchtitan/config/job_config.py or torchtitan/config_manager.py, whose sections are plain classes). Each of its fields whose default is a config
dataclass (``field(default_factory=X.Config)``) is a section; its keys are the fields of that class and
of its bases, as ``section.key``; a field of a section that is itself a config dataclass adds
``section.field.key``. Plain fields of the root are top-level keys (``hf_assets_path``). Fields marked
``tyro.conf.Suppress`` or ``ClassVar``, or named with a leading underscore, are not on the command line
and are left out. tests/trainer/test_torchtitan_keys.py reads the output.
"""
from __future__ import annotations

import ast
import hashlib
import json
import pathlib
import sys
import zipfile


class _Class:
    def __init__(self, node: ast.ClassDef, path: str) -> None:
        self.node, self.path = node, path
        self.bases = [ast.unparse(b) for b in node.bases]
        self.fields: list[tuple[str, str, str | None]] = []  # (name, annotation, default factory)
        for stmt in node.body:
            if not isinstance(stmt, ast.AnnAssign) or not isinstance(stmt.target, ast.Name):
                continue
            ann = ast.unparse(stmt.annotation)
            name = stmt.target.id
            if name.startswith("_") or "ClassVar" in ann or "Suppress" in ann:
                continue
            factory = None
            if isinstance(stmt.value, ast.Call) and ast.unparse(stmt.value.func).endswith("field"):
                for kw in stmt.value.keywords:
                    if kw.arg == "default_factory":
                        factory = ast.unparse(kw.value)
            self.fields.append((name, ann, factory))


def _sources(root: pathlib.Path) -> dict[str, str]:
    """``{path under torchtitan/: source}`` of the package folder or wheel ``root``, without the
    experiments and tests."""
    if root.suffix == ".whl":
        with zipfile.ZipFile(root) as whl:
            files = {n: whl.read(n).decode() for n in whl.namelist() if n.startswith("torchtitan/") and n.endswith(".py")}
    else:
        files = {str(p.relative_to(root.parent)): p.read_text() for p in sorted(root.rglob("*.py"))}
    return {n: t for n, t in files.items() if "/experiments/" not in n and "/tests/" not in n}


def _index(root: pathlib.Path, only: tuple[str, ...] = ()) -> dict[str, list[_Class]]:
    """Every class of the tree by dotted qualname within its file ('Trainer.Config'), so that
    'CheckpointManager.Config' finds the class nested in CheckpointManager; ``only``: these files alone."""
    table: dict[str, list[_Class]] = {}

    def visit(node: ast.AST, prefix: str, path: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                qual = f"{prefix}{child.name}"
                table.setdefault(qual, []).append(_Class(child, path))
                visit(child, qual + ".", path)

    for rel, text in sorted(_sources(root).items()):
        if not only or rel in only:
            visit(ast.parse(text), "", rel)
    return table


def _resolve(table: dict[str, list[_Class]], name: str) -> _Class | None:
    hits = table.get(name, [])
    if len(hits) > 1:
        raise SystemExit(f"ambiguous class {name}: {[h.path for h in hits]}")
    return hits[0] if hits else None


def _all_fields(table: dict[str, list[_Class]], cls: _Class) -> list[tuple[str, str, str | None]]:
    """The fields of ``cls`` and its bases, bases first (a redefinition keeps its first place)."""
    out: dict[str, tuple[str, str, str | None]] = {}
    for base in cls.bases:
        found = _resolve(table, base)
        if found is not None:
            for f in _all_fields(table, found):
                out.setdefault(f[0], f)
    for f in cls.fields:
        out[f[0]] = f
    return list(out.values())


def _section_class(table: dict[str, list[_Class]], ann: str, factory: str | None, any_name: bool = False) -> _Class | None:
    """The config class of a field: its default factory's, else its annotation's (a known class named
    ``*Config``, or any class of the table with ``any_name``); a class without fields is a section
    without keys."""
    for name in (factory, ann):
        if name and name.replace(".", "").isidentifier() and (any_name or name.endswith("Config")):
            found = _resolve(table, name)
            if found is not None:
                return found
    return None


# Releases before 0.3.0 keep the whole configuration in one file, rooted at ``JobConfig``.
_EARLIER_ROOTS = ("torchtitan/config/job_config.py", "torchtitan/config_manager.py")


def keys(root: pathlib.Path) -> dict[str, object]:
    table = _index(root)
    trainer = _resolve(table, "Trainer.Config")
    any_name, described = False, "Trainer.Config (torchtitan/trainer.py)"
    if trainer is None:  # an earlier release: JobConfig and its sections in one file
        files = [f for f in _EARLIER_ROOTS if f in _sources(root)]
        if not files:
            raise SystemExit(f"no Trainer.Config or JobConfig under {root}")
        table = _index(root, (files[0],))
        trainer, any_name, described = _resolve(table, "JobConfig"), True, f"JobConfig ({files[0]})"
    out: dict[str, dict[str, str]] = {}

    def walk(prefix: str, cls: _Class, depth: int) -> None:
        for name, ann, factory in _all_fields(table, cls):
            sub = _section_class(table, ann, factory, any_name) if depth < 3 else None
            if sub is not None:
                walk(f"{prefix}{name}.", sub, depth + 1)
            else:
                out[f"{prefix}{name}"] = {"type": ann}

    walk("", trainer, 0)
    head: dict[str, object] = {}
    if root.suffix == ".whl":
        head = {"torchtitan": root.name.split("-")[1], "wheel_sha256": hashlib.sha256(root.read_bytes()).hexdigest()}
    return {**head, "root": described, "keys": out}


def merged(wheels: list[pathlib.Path]) -> dict[str, object]:
    """The keys of several releases' wheels: ``{"torchtitan": [versions], "wheel_sha256": {version: hash},
    "keys": {key: [the versions that have it]}}``."""
    out: dict[str, object] = {"torchtitan": [], "wheel_sha256": {}, "keys": {}}
    for wheel in wheels:
        one = keys(wheel)
        out["torchtitan"].append(one["torchtitan"])
        out["wheel_sha256"][one["torchtitan"]] = one["wheel_sha256"]
        for key in one["keys"]:
            out["keys"].setdefault(key, []).append(one["torchtitan"])
    out["keys"] = dict(sorted(out["keys"].items()))
    return out


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__.split("\n\n")[1])
    paths = [pathlib.Path(a) for a in sys.argv[1:]]
    print(json.dumps(keys(paths[0]) if len(paths) == 1 else merged(paths), indent=1))
