"""What every part of the Hugging Face conversion shares: the folder's file names, the error, and
the config.json fields the families read alike (integer sizes, rotary theta and scaling).

The file names and the index layout are those ``transformers``' ``save_pretrained`` writes; the
rope scaling is Llama 3.1's ('llama3': factor, low/high_freq_factor,
original_max_position_embeddings; ``titan_kernels.ops.rotary``), read from the old
``rope_theta`` + ``rope_scaling`` keys or transformers >= 5's ``rope_parameters``.
"""
from __future__ import annotations

import logging

logger = logging.getLogger("trainer")

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 2**30
# model_type of config.json -> our family.
MODEL_TYPES = {"llama": "llama3", "qwen3": "qwen3", "qwen3_moe": "qwen3"}


class HFCheckpointError(ValueError):
    """A folder is not a usable Hugging Face Llama / Qwen3 checkpoint; the message is one line."""


def _rope_from_config(cfg: dict, where: str) -> tuple[float, dict | None]:
    """(rope_theta, our rope_scaling) from a config: transformers >= 5 nests both in ``rope_parameters``."""
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    theta = cfg.get("rope_theta")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        scaling = params
    theta = 10000.0 if theta is None else float(theta)
    if not scaling:
        return theta, None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise HFCheckpointError(f"{where}: rope scaling type {kind!r} is not supported (expected none or 'llama3')")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in scaling]
    if missing:
        raise HFCheckpointError(f"{where}: rope scaling 'llama3' lacks {', '.join(missing)}")
    ours = {k: float(scaling[k]) for k in keys[:3]}
    ours["original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
    return theta, ours


def _int_fields(cfg: dict, keys: tuple[str, ...], what: str, where: str) -> None:
    missing = [k for k in keys if isinstance(cfg.get(k), bool) or not isinstance(cfg.get(k), int)]
    if missing:
        raise HFCheckpointError(f"{where}: {what} config lacks integer {', '.join(missing)}")
