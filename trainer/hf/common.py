"""What every part of the Hugging Face conversion shares: the folder's file names, the error, and
the config.json fields the families read alike (integer sizes, rotary theta and scaling).

The file names and the index layout are those ``transformers``' ``save_pretrained`` writes. Rotary
scaling is read from the old ``rope_theta`` + ``rope_scaling`` keys or transformers >= 5's
``rope_parameters``: Llama 3.1's ('llama3': factor, low/high_freq_factor,
original_max_position_embeddings) and YaRN ('yarn': factor, original_max_position_embeddings,
beta_fast, beta_slow, mscale, mscale_all_dim, attention_factor, truncate), as
``titan_kernels.rope_cos_sin`` computes them.
"""
from __future__ import annotations

import contextlib
import logging

import torch
from trainer.errors import HFCheckpointError  # noqa: F401  (defined on the ground floor)

logger = logging.getLogger("trainer")

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 2**30
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_YARN_KEYS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")


@contextlib.contextmanager
def config_errors(where: str):
    """Inside the block, the model args' own checks of a config.json's values (ValueError, TypeError)
    become one-line HFCheckpointErrors naming the file ``where``."""
    try:
        yield
    except (ValueError, TypeError) as exc:
        raise HFCheckpointError(f"{where}: {exc}") from None


def model_types() -> dict[str, str]:
    """config.json model_type -> our family, for every registered family."""
    from trainer import registry

    return registry.hf_model_types()


def _rope_from_config(cfg: dict, where: str, allowed: tuple[str, ...] = ("llama3",)) -> tuple[float, dict | None]:
    """(rope_theta, our rope_scaling) of a config; transformers >= 5 nests both in ``rope_parameters``.
    ``allowed``: the scaling types the family has. Raises HFCheckpointError for another type or a
    scaling dict that lacks its keys."""
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
    if kind not in allowed:
        raise HFCheckpointError(f"{where}: rope scaling type {kind!r} is not supported (expected none or "
                                f"{' or '.join(repr(a) for a in allowed)})")
    if kind == "llama3":
        missing = [k for k in _LLAMA3_KEYS if k not in scaling]
        if missing:
            raise HFCheckpointError(f"{where}: rope scaling 'llama3' lacks {', '.join(missing)}")
        ours = {k: float(scaling[k]) for k in _LLAMA3_KEYS[:3]}
        ours["original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
        return theta, ours
    # yarn: factor may be absent (then max_position_embeddings / original, as transformers does)
    original = scaling.get("original_max_position_embeddings")
    if not isinstance(original, int) or isinstance(original, bool):
        raise HFCheckpointError(f"{where}: rope scaling 'yarn' lacks an integer original_max_position_embeddings")
    factor = scaling.get("factor")
    if factor is None:
        factor = float(cfg.get("max_position_embeddings", original)) / original
    ours = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": original}
    for k in _YARN_KEYS:
        if scaling.get(k) is not None:
            ours[k] = scaling[k] if k == "truncate" else float(scaling[k])
    return theta, ours


def rope_to_config(theta: float, scaling: dict | None) -> dict:
    """The config.json rotary keys of ``(rope_theta, our rope_scaling)``, in the long-standing layout
    (``rope_theta`` + ``rope_scaling``) that transformers 4 and 5 both read."""
    if scaling is None:
        return {"rope_theta": theta, "rope_scaling": None}
    kind = scaling.get("rope_type", "llama3")
    return {"rope_theta": theta, "rope_scaling": {**{k: v for k, v in scaling.items() if k != "rope_type"},
                                                  "rope_type": kind}}


def _int_fields(cfg: dict, keys: tuple[str, ...], what: str, where: str) -> None:
    missing = [k for k in keys if isinstance(cfg.get(k), bool) or not isinstance(cfg.get(k), int)]
    if missing:
        raise HFCheckpointError(f"{where}: {what} config lacks integer {', '.join(missing)}")



def decoder_fields(cfg: dict, theta: float, scaling: dict | None, *, norm_eps: float, max_seq_len: int) -> dict:
    """Our args' decoder fields as transformers reads them from config.json (a null value taken as
    absent): sizes, heads (kv heads default to the heads, head_dim to hidden_size / heads), the rotary
    ``theta`` and ``scaling`` already read, tied embeddings; ``norm_eps`` and ``max_seq_len``: the
    family's defaults for ``rms_norm_eps`` and ``max_position_embeddings``."""
    def get(key, default):
        value = cfg.get(key)
        return default if value is None else value

    heads = cfg["num_attention_heads"]
    return dict(dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"], n_heads=heads,
                n_kv_heads=get("num_key_value_heads", heads), head_dim=get("head_dim", cfg["hidden_size"] // heads),
                vocab_size=cfg["vocab_size"], norm_eps=float(get("rms_norm_eps", norm_eps)), rope_theta=theta,
                rope_scaling=scaling, max_seq_len=int(get("max_position_embeddings", max_seq_len)),
                tie_word_embeddings=bool(get("tie_word_embeddings", False)))

def refuse_activation_and_quantization(cfg: dict, where: str, hint: str = "dequantize first") -> None:
    """Raise HFCheckpointError (one line naming the field) for a config.json whose ``hidden_act`` is not
    SiLU (transformers' default when absent) or that carries a ``quantization_config`` (its weights
    are not the plain tensors we load; ``hint`` says how to get those)."""
    act = cfg.get("hidden_act")
    if act is not None and act != "silu":
        raise HFCheckpointError(f"{where}: hidden_act {act!r} is not supported (expected 'silu')")
    quant = cfg.get("quantization_config")
    if quant:
        method = quant.get("quant_method", quant) if isinstance(quant, dict) else quant
        raise HFCheckpointError(f"{where}: quantization_config {method!r} is not supported: {hint}")
