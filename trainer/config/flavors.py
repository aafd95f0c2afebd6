"""Flavors: the model sizes that have a TOML file in ``trainer/configs/<family>/`` and where that file is.

A flavor of family ``<family>`` (``--model.name``) is ``trainer/configs/<family>/<flavor>.toml``. The
file is the middle layer of a run's configuration (:mod:`trainer.config.cli`), and a flavor
without a file is refused by validation (:mod:`trainer.config.validate`). The families themselves
come from the model registry (``trainer.registry``, torch-free).
"""
from __future__ import annotations

import pathlib

# trainer/configs/, beside this package (trainer/config/).
CONFIG_DIR = pathlib.Path(__file__).resolve().parent.parent / "configs"


def families() -> tuple[str, ...]:
    """The registered model families (``--model.name`` values)."""
    from trainer import registry

    return registry.names()


def family_flavors(model_name: str) -> tuple[str, ...]:
    """The flavors family ``model_name`` registers (its published shapes), sorted as
    ``available_flavors``; empty for an unknown family."""
    from trainer import registry

    try:
        return tuple(sorted(registry.get(model_name).flavors, key=_flavor_sort_key))
    except ValueError:
        return ()


def flavor_config_path(flavor: str, model_name: str = "llama3") -> pathlib.Path:
    """``trainer/configs/<model_name>/<flavor>.toml``.

    Args:
        flavor: the flavor name, e.g. ``debugmodel`` or ``8B``.
        model_name: the model family (``model.name``).

    Returns the path, whether the file exists or not.
    """
    return CONFIG_DIR / model_name / f"{flavor}.toml"


def available_flavors(model_name: str = "llama3") -> tuple[str, ...]:
    """Flavor names of ``model_name`` that have a TOML file in ``trainer/configs/<model_name>/``.

    Args:
        model_name: the model family (``model.name``).

    Returns the names, debugmodel first, then by size (1B < 3B < 8B ...); empty for a family without files.
    """
    stems = [p.stem for p in (CONFIG_DIR / model_name).glob("*.toml")]
    return tuple(sorted(stems, key=_flavor_sort_key))


def _flavor_sort_key(name: str) -> tuple[float, str]:
    # debug flavors first, then by size: 1B < 3B < 8B < 70B < 405B (30B-A3B sorts as 30B; 1T as 1000B),
    # then the named ones (kimi_k2).
    if name.startswith("debug"):
        return (-1.0, name)
    head = name.split("-")[0]
    scale = {"B": 1.0, "T": 1000.0}.get(head[-1:], None)
    try:
        return (float(head[:-1]) * scale, name) if scale is not None else (float("inf"), name)
    except ValueError:
        return (float("inf"), name)
