"""Flavors: the model sizes that have a TOML file in ``trainer/configs/`` and where that file is.

A flavor of Llama 3 is ``trainer/configs/<flavor>.toml``; a flavor of another family (qwen3) is
``trainer/configs/<family>_<flavor>.toml``. The file is the middle layer of a run's configuration
(:mod:`trainer.config.cli`), and a flavor without a file is refused by validation
(:mod:`trainer.config.validate`). Imports nothing else of the package.
"""
from __future__ import annotations

import pathlib

# trainer/configs/, beside this package (trainer/config/).
CONFIG_DIR = pathlib.Path(__file__).resolve().parent.parent / "configs"

_FAMILIES = ("llama3", "qwen3")


def flavor_config_path(flavor: str, model_name: str = "llama3") -> pathlib.Path:
    """``trainer/configs/<flavor>.toml`` (llama3) or ``trainer/configs/<model_name>_<flavor>.toml``.

    Args:
        flavor: the flavor name, e.g. ``debugmodel`` or ``8B``.
        model_name: the model family (``model.name``).

    Returns the path, whether the file exists or not.
    """
    return CONFIG_DIR / (f"{flavor}.toml" if model_name == "llama3" else f"{model_name}_{flavor}.toml")


def available_flavors(model_name: str = "llama3") -> tuple[str, ...]:
    """Flavor names of ``model_name`` that have a TOML file in ``trainer/configs/``: ``<flavor>.toml``
    for llama3, ``<family>_<flavor>.toml`` for the other families (qwen3).

    Args:
        model_name: the model family (``model.name``).

    Returns the names, debugmodel first, then by size (1B < 3B < 8B ...); empty for a family without files.
    """
    prefixes = tuple(f"{n}_" for n in _FAMILIES if n != "llama3")
    if model_name == "llama3":
        stems = [p.stem for p in CONFIG_DIR.glob("*.toml") if not p.stem.startswith(prefixes)]
    else:
        stems = [p.stem[len(model_name) + 1:] for p in CONFIG_DIR.glob(f"{model_name}_*.toml")]
    return tuple(sorted(stems, key=_flavor_sort_key))


def _flavor_sort_key(name: str) -> tuple[float, str]:
    # debugmodel first, then by size: 1B < 3B < 8B < 70B < 405B.
    digits = name.split("-")[0][:-1]  # 30B-A3B sorts as 30B
    try:
        return (float(digits), name) if name.split("-")[0].endswith("B") else (-1.0, name)
    except ValueError:
        return (-1.0, name)

