"""transformers' defaults and field types of the config.json fields we read, per ``model_type``, and
``complete_config``: a config.json as transformers reads it (absent fields at their defaults, the
rotary settings resolved, each field's type checked, naming the field).

A config.json may leave any field out; transformers then uses its config class's default for that
``model_type`` (GPT-OSS without rope fields: YaRN x32 at theta 150000, DeepSeek-V3 without
``q_lora_rank``: 1536). The defaults and types come from transformers' config class when
transformers is installed, else from ``TABLE`` below (transformers 5.25's classes);
tests/trainer/test_hf_defaults.py checks the table against the installed classes.

Rotary settings follow ``PreTrainedConfig.convert_rope_params_to_dict``: ``rope_scaling`` (when not
empty), else ``rope_parameters``, else the class's default parameters; ``rope_theta`` set in them
wins, else the top-level ``rope_theta``, else the class's ``default_theta``; ``rope_type`` defaults to
"default" (or the legacy ``type``); a scaled type gets ``original_max_position_embeddings`` =
``max_position_embeddings`` when it lacks one.

A value of another type than the field's is one line naming the field (transformers' strict
dataclasses refuse it too); an integer is accepted for a float field (JSON writers differ on 7 vs
7.0) and read as a float.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import types
import typing
from typing import Any

from trainer.errors import HFCheckpointError

# model_type -> {"fields": {name: (default, types)}, "default_theta", "rope_parameters" (the class's
# default without rope_theta; None = the default type), "aliases" (a name transformers maps to the field)}.
TABLE: dict[str, dict[str, Any]] = {
    "llama": {
        "fields": {
            "attention_bias": (False, "bool"), "head_dim": (None, "int|None"), "hidden_act": ("silu", "str"),
            "hidden_size": (4096, "int"), "intermediate_size": (11008, "int"), "max_position_embeddings": (2048, "int"),
            "mlp_bias": (False, "bool"), "num_attention_heads": (32, "int"), "num_hidden_layers": (32, "int"),
            "num_key_value_heads": (None, "int|None"), "rms_norm_eps": (1e-06, "float"),
            "tie_word_embeddings": (False, "bool"), "vocab_size": (32000, "int"),
        },
        "default_theta": 10000.0, "rope_parameters": None, "aliases": {},
    },
    "qwen3": {
        "fields": {
            "attention_bias": (False, "bool"), "head_dim": (128, "int"), "hidden_act": ("silu", "str"),
            "hidden_size": (4096, "int"), "intermediate_size": (22016, "int"), "layer_types": (None, "list|None"),
            "max_position_embeddings": (32768, "int"), "max_window_layers": (28, "int"),
            "num_attention_heads": (32, "int"), "num_hidden_layers": (32, "int"),
            "num_key_value_heads": (32, "int|None"), "rms_norm_eps": (1e-06, "float"),
            "sliding_window": (4096, "int|None"), "tie_word_embeddings": (False, "bool"),
            "use_sliding_window": (False, "bool"), "vocab_size": (151936, "int"),
        },
        "default_theta": 10000.0, "rope_parameters": None, "aliases": {},
    },
    "qwen3_moe": {
        "fields": {
            "attention_bias": (False, "bool"), "decoder_sparse_step": (1, "int"), "hidden_act": ("silu", "str"),
            "hidden_size": (2048, "int"), "intermediate_size": (6144, "int"), "max_position_embeddings": (32768, "int"),
            "mlp_only_layers": (None, "list|None"), "moe_intermediate_size": (768, "int"),
            "norm_topk_prob": (False, "bool"), "num_attention_heads": (32, "int"), "num_experts": (128, "int"),
            "num_experts_per_tok": (8, "int"), "num_hidden_layers": (24, "int"), "num_key_value_heads": (4, "int"),
            "rms_norm_eps": (1e-06, "float"), "sliding_window": (4096, "int|None"),
            "tie_word_embeddings": (False, "bool"), "use_sliding_window": (False, "bool"), "vocab_size": (151936, "int"),
        },
        "default_theta": 10000.0, "rope_parameters": None, "aliases": {"num_local_experts": "num_experts"},
    },
    "deepseek_v3": {
        "fields": {
            "attention_bias": (False, "bool"), "first_k_dense_replace": (3, "int|None"), "hidden_act": ("silu", "str"),
            "hidden_size": (7168, "int"), "intermediate_size": (18432, "int"), "kv_lora_rank": (512, "int"),
            "max_position_embeddings": (4096, "int"), "moe_intermediate_size": (2048, "int"),
            "n_group": (8, "int|None"), "n_routed_experts": (256, "int"), "n_shared_experts": (1, "int"),
            "norm_topk_prob": (True, "bool|None"), "num_attention_heads": (128, "int"),
            "num_experts_per_tok": (8, "int|None"), "num_hidden_layers": (61, "int"),
            "num_key_value_heads": (128, "int|None"), "q_lora_rank": (1536, "int|None"),
            "qk_nope_head_dim": (128, "int"), "qk_rope_head_dim": (64, "int"), "rms_norm_eps": (1e-06, "float"),
            "rope_interleave": (True, "bool|None"), "routed_scaling_factor": (2.5, "float"),
            "tie_word_embeddings": (False, "bool"), "topk_group": (4, "int|None"), "v_head_dim": (128, "int|None"),
            "vocab_size": (129280, "int"),
        },
        "default_theta": 10000.0, "rope_parameters": None, "aliases": {"num_local_experts": "n_routed_experts"},
    },
    "gpt_oss": {
        "fields": {
            "attention_bias": (True, "bool"), "head_dim": (64, "int"), "hidden_act": ("silu", "str"),
            "hidden_size": (2880, "int"), "intermediate_size": (2880, "int"), "layer_types": (None, "list|None"),
            "max_position_embeddings": (131072, "int"), "num_attention_heads": (64, "int"),
            "num_experts_per_tok": (4, "int"), "num_hidden_layers": (36, "int"), "num_key_value_heads": (8, "int"),
            "num_local_experts": (128, "int"), "rms_norm_eps": (1e-05, "float"), "sliding_window": (128, "int|None"),
            "swiglu_alpha": (1.702, "float"), "swiglu_limit": (7.0, "float"), "tie_word_embeddings": (False, "bool"),
            "vocab_size": (201088, "int"),
        },
        "default_theta": 150000.0,
        "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                            "original_max_position_embeddings": 4096},
        "aliases": {"num_experts": "num_local_experts"},
    },
    "llama4_text": {
        "fields": {
            "attention_bias": (False, "bool"), "attention_chunk_size": (8192, "int|None"), "attn_scale": (0.1, "float"),
            "attn_temperature_tuning": (True, "bool"), "floor_scale": (8192, "int"), "head_dim": (128, "int"),
            "hidden_act": ("silu", "str"), "hidden_size": (5120, "int"), "interleave_moe_layer_step": (1, "int"),
            "intermediate_size": (8192, "int"), "intermediate_size_mlp": (16384, "int"),
            "layer_types": (None, "list|None"), "max_position_embeddings": (131072, "int"),
            "moe_layers": (None, "list|None"), "no_rope_layers": (None, "list|None"),
            "num_attention_heads": (40, "int"), "num_experts_per_tok": (1, "int"), "num_hidden_layers": (48, "int"),
            "num_key_value_heads": (8, "int"), "num_local_experts": (16, "int"), "rms_norm_eps": (1e-05, "float"),
            "tie_word_embeddings": (False, "bool"), "use_qk_norm": (True, "bool"), "vocab_size": (202048, "int"),
        },
        "default_theta": 500000.0, "rope_parameters": None, "aliases": {},
    },
}
# Model types transformers has no class for, read with another's (Kimi K2 ships DeepSeek-V3's code).
SAME_AS = {"kimi_k2": "deepseek_v3"}
# Model types a family reads without transformers' defaults: refused in one line by its adapter, or
# not a transformers config at all (diffusers' class names, whose defaults the family's adapter holds).
NOT_TRANSFORMERS = {"llama4": "the multimodal Llama 4 (a vision tower), refused: the text model is llama4_text",
                    "FluxTransformer2DModel": "a diffusers config (_class_name), read by the Flux adapter"}
_SCALED = ("llama3", "yarn", "longrope")
_TYPES = {"int": int, "float": float, "bool": bool, "str": str, "list": list, "dict": dict, "None": type(None)}


def _type_names(annotation: Any) -> str | None:
    """``"int|None"`` for a field annotation of transformers' config class; None for one we do not check."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        parts = [_type_names(a) for a in typing.get_args(annotation)]
        return None if None in parts else "|".join(parts)
    if annotation is type(None):
        return "None"
    origin = typing.get_origin(annotation) or annotation
    name = getattr(origin, "__name__", None)
    return name if name in _TYPES else None


@functools.lru_cache(maxsize=None)
def from_transformers(model_type: str) -> dict[str, Any] | None:
    """The ``TABLE`` entry of ``model_type`` read from the installed transformers' config class (the
    fields ``TABLE`` lists); None when transformers or its class for that type is missing, or the class
    is not a dataclass (transformers 4). Cached: callers copy what they change."""
    try:
        from transformers import CONFIG_MAPPING
        cls = CONFIG_MAPPING[model_type]
    except (ImportError, KeyError):
        return None
    table = TABLE[model_type]
    fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
    out: dict[str, Any] = {}
    for name in table["fields"]:
        f = fields.get(name)
        if f is None or f.default is dataclasses.MISSING:
            return None  # an older transformers without the strict dataclass configs: use the table
        out[name] = (f.default, _type_names(f.type))
    params = {k: v for k, v in (cls().rope_parameters or {}).items() if k != "rope_theta"}
    return {"fields": out, "default_theta": float(cls.default_theta),
            "rope_parameters": None if params in ({}, {"rope_type": "default"}) else params,
            "aliases": dict(table["aliases"])}


def defaults(model_type: str) -> dict[str, Any] | None:
    """transformers' defaults for ``model_type`` (its class when installed, else ``TABLE``); None for a
    type we do not read."""
    model_type = SAME_AS.get(model_type, model_type)
    if model_type not in TABLE:
        return None
    return from_transformers(model_type) or TABLE[model_type]


def _check_type(name: str, value: Any, kinds: str | None, where: str) -> Any:
    if kinds is None:
        return value
    allowed = kinds.split("|")
    for kind in allowed:
        t = _TYPES[kind]
        if kind == "float" and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, t) and not (kind == "int" and isinstance(value, bool)):
            return value
    expected = " or ".join({"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
                            "list": "a list", "dict": "an object", "None": "null"}[k] for k in allowed)
    raise HFCheckpointError(f"{where}: {name} {value!r} ({type(value).__name__}) is not valid: expected {expected}")


def complete_config(cfg: dict, where: str) -> dict:
    """``cfg`` (a config.json dict) as transformers reads it (module docstring): a new dict with every
    field we read present (absent ones at transformers' defaults for its model_type, an alias under
    its field's name), each of the right type, and the rotary settings resolved into
    ``rope_parameters`` (with ``rope_theta``). A model_type we do not read is returned unchanged.

    Raises HFCheckpointError naming the field: a value of the wrong type (``sliding_window: "16"``),
    rope fields that are not a number / an object.
    """
    table = defaults(cfg.get("model_type")) if isinstance(cfg.get("model_type"), str) else None
    if table is None:
        return cfg
    out = dict(cfg)
    for alias, name in table["aliases"].items():
        if alias in out and name not in out:
            out[name] = out[alias]
    for name, (default, kinds) in table["fields"].items():
        if name in out:
            out[name] = _check_type(name, out[name], kinds, where)
        else:
            out[name] = copy.deepcopy(default)
    theta = out.pop("rope_theta", None)
    if theta is not None:
        theta = _check_type("rope_theta", theta, "float", where)
    scaling, params = out.pop("rope_scaling", None), out.get("rope_parameters")
    for key, value in (("rope_scaling", scaling), ("rope_parameters", params)):
        _check_type(key, value, "dict|None", where)
    chosen = scaling or params
    if chosen is None:
        chosen = table["rope_parameters"] or {}
    chosen = copy.deepcopy(chosen)
    nested = sorted(k for k, v in chosen.items() if isinstance(v, dict))
    if nested:  # transformers' per-layer-type rotary settings: none of our families has them
        raise HFCheckpointError(f"{where}: rope_parameters per layer type ({', '.join(nested)}) is not supported "
                                f"(expected one set of rotary parameters)")
    chosen.setdefault("rope_theta", table["default_theta"] if theta is None else theta)
    if chosen["rope_theta"] is not None:
        chosen["rope_theta"] = _check_type("rope_theta", chosen["rope_theta"], "float", where)
    chosen.setdefault("rope_type", chosen.get("type", "default"))
    if chosen["rope_type"] in _SCALED:
        chosen.setdefault("original_max_position_embeddings", out["max_position_embeddings"])
    out["rope_parameters"] = chosen
    return out
