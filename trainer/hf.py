"""Hugging Face Llama 3 and Qwen3 (dense and MoE) checkpoints: read and write folders of
safetensors shards + config.json.

A Hugging Face folder (as ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``
``.save_pretrained`` writes it) holds
  config.json                        model_type "llama", "qwen3" or "qwen3_moe": hidden_size, ...
  model.safetensors                  the weights, when they fit one shard; else
  model-0000k-of-0000n.safetensors   shards, and
  model.safetensors.index.json       {"metadata": {"total_size": bytes}, "weight_map": {name: shard file}}
Names and the rotary layout differ from ours (``trainer.models.llama.to_hf_state_dict``,
``trainer.models.qwen3.to_hf_state_dict``): wq/wk rows (and Qwen3's QK-norm weights) are permuted
from Meta's interleaved pairs to Hugging Face's rotate-half halves; Qwen3-MoE stores each routed
expert as three (out, in) matrices ``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``, ours
are stacked (E, in, out) (``experts.w1/w3/w2``), and the router is ``mlp.gate.weight`` (E, dim).
Our MoE layers' ``expert_bias`` (the auxiliary-loss-free balancing state, a buffer that only steers
the top-k choice) has no Hugging Face counterpart: it is zero after an import, and an export of a
model whose bias is not zero warns that transformers will route its tokens without it.

Reading never loads the whole model: ``HFCheckpoint.tensor`` reads one tensor from its shard
(safetensors maps the file), and ``load_into_model`` copies parameter by parameter into a model of
any parallel layout (each rank keeps its shard of every DTensor parameter, as ``init_weights`` does).
Writing streams too: ``HFWriter`` takes tensors in order and closes a shard once it holds
``max_shard_size`` bytes.

Errors: ``HFCheckpointError`` (a ValueError) with a one-line message naming the folder and what is
wrong (no config.json, not a Llama or Qwen3, unsupported options such as biases, sliding-window
attention, Qwen3-MoE's decoder_sparse_step != 1 or non-prefix mlp_only_layers, shared experts on
export; a missing tensor, a shape that does not match the config or the run's flavor).
"""
from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from trainer.models import qwen3 as _qwen3
from trainer.models.common import family_of
from trainer.models.llama import LLAMA3_FLAVORS, ModelArgs
from trainer.models.llama import from_hf_state_dict as _llama_from_hf
from trainer.models.llama import hf_key as _llama_hf_key
from trainer.models.llama import to_hf_state_dict as _llama_to_hf
from trainer.models.qwen3_args import QWEN3_FLAVORS, MoEArgs, Qwen3Args

logger = logging.getLogger("trainer")

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 2**30
# Buffers some Hugging Face checkpoints carry that are not weights (recomputed from the config).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# Fields of the model args that fix the tensor shapes (a mismatch cannot load) and those that only
# change the math (a mismatch loads, but the model is not the one that was trained). "moe.x" reads
# the MoEArgs field x (None for a dense model); fields a family lacks are skipped.
_SHAPE_FIELDS = ("family", "dim", "n_layers", "n_heads", "kv_heads", "head_dim", "ffn_hidden_dim", "vocab_size",
                 "tie_word_embeddings", "qk_norm", "n_dense_layers", "moe.num_experts", "moe.hidden_dim",
                 "moe.num_shared_experts")
_MATH_FIELDS = ("norm_eps", "rope_theta", "rope_scaling", "moe.top_k", "moe.score_func", "moe.route_norm",
                "moe.route_scale")
# model_type of config.json -> our family.
MODEL_TYPES = {"llama": "llama3", "qwen3": "qwen3", "qwen3_moe": "qwen3"}


class HFCheckpointError(ValueError):
    """A folder is not a usable Hugging Face Llama / Qwen3 checkpoint; the message is one line."""


# ------------------------------------------------------------------------------------------------
# config.json <-> ModelArgs


def hf_config(args, dtype: torch.dtype = torch.float32) -> dict:
    """The ``config.json`` of the Hugging Face model equal to our model ``args``: a
    ``LlamaForCausalLM`` for ModelArgs, a ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` for
    Qwen3Args (``trainer.models.qwen3.hf_config``).

    Written in the long-standing layout (``rope_theta`` + ``rope_scaling``), which every
    transformers version reads. ``max_position_embeddings`` is the published 131072 for rope-scaled
    (Llama 3.1/3.2) models; it does not change the math (``original_max_position_embeddings`` does).
    Raises HFCheckpointError for a model the Hugging Face classes cannot express (a Qwen3-MoE with
    shared experts, sigmoid routing or a route scale; no QK-norm).
    """
    if family_of(args) == "qwen3":
        try:
            return _qwen3.hf_config(args, dtype)
        except ValueError as exc:
            raise HFCheckpointError(f"cannot write a Hugging Face Qwen3 config: {exc}") from None
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": _DTYPE_NAMES.get(dtype, "float32"),
    }
    if args.rope_scaling is not None:
        cfg["rope_scaling"] = {"rope_type": "llama3", **args.rope_scaling}
        cfg["max_position_embeddings"] = max(args.max_seq_len, 131072)
    return cfg


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


def args_from_hf_config(cfg: dict, where: str = CONFIG):
    """Our model args for a Hugging Face ``config.json`` dict, and the flavor they match ("custom" if
    none): ModelArgs for model_type llama, Qwen3Args for qwen3 and qwen3_moe (``_qwen3_args``).

    Raises HFCheckpointError for another model_type or options our models do not have.
    """
    model_type = cfg.get("model_type")
    if model_type == "llama":
        return _llama_args(cfg, where)
    if model_type in ("qwen3", "qwen3_moe"):
        return _qwen3_args(cfg, where)
    archs = cfg.get("architectures") or []
    raise HFCheckpointError(f"{where}: not a Llama or Qwen3 checkpoint (model_type {model_type!r}, architectures "
                            f"{archs}; supported: {', '.join(MODEL_TYPES)})")


def _int_fields(cfg: dict, keys: tuple[str, ...], what: str, where: str) -> None:
    missing = [k for k in keys if isinstance(cfg.get(k), bool) or not isinstance(cfg.get(k), int)]
    if missing:
        raise HFCheckpointError(f"{where}: {what} config lacks integer {', '.join(missing)}")


def _llama_args(cfg: dict, where: str) -> tuple[ModelArgs, str]:
    """ModelArgs of a Llama config. The FFN width is reproduced exactly: by a flavor's
    ``multiple_of``/``ffn_dim_multiplier`` when the shapes are a flavor's, else by
    ``multiple_of = intermediate_size``. Raises HFCheckpointError for options our model does not
    have (biases, another activation, a head_dim other than hidden_size / num_attention_heads,
    other rope scaling)."""
    need = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    _int_fields(cfg, need, "Llama", where)
    if cfg.get("hidden_act", "silu") != "silu":
        raise HFCheckpointError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported (expected 'silu')")
    for bias in ("attention_bias", "mlp_bias"):
        if cfg.get(bias):
            raise HFCheckpointError(f"{where}: {bias}=true is not supported (our Llama has no biases)")
    dim, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim")
    if head_dim is not None and heads and head_dim * heads != dim:
        raise HFCheckpointError(
            f"{where}: head_dim {head_dim} x num_attention_heads {heads} != hidden_size {dim} (not supported)")
    theta, scaling = _rope_from_config(cfg, where)
    hidden = cfg["intermediate_size"]
    common = dict(dim=dim, n_layers=cfg["num_hidden_layers"], n_heads=heads,
                  n_kv_heads=cfg.get("num_key_value_heads") or heads, vocab_size=cfg["vocab_size"],
                  norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
                  max_seq_len=int(cfg.get("max_position_embeddings") or 8192),
                  tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)))
    try:
        for name, flavor in LLAMA3_FLAVORS.items():
            # The flavor's multiple_of / ffn_dim_multiplier with the config's sizes: a match gives
            # the flavor's own arguments.
            cand = flavor.replace(**common)
            if cand.ffn_hidden_dim == hidden and not differences(cand, flavor, ignore_vocab=True):
                return cand, name
        base = int(2 * (4 * dim) / 3)
        args = ModelArgs(multiple_of=hidden, ffn_dim_multiplier=hidden / base, **common)
    except ValueError as exc:  # ModelArgs' own checks (e.g. heads not dividing dim)
        raise HFCheckpointError(f"{where}: {exc}") from None
    if args.ffn_hidden_dim != hidden:  # cannot happen for hidden >= 1; kept as a guard on the arithmetic
        raise HFCheckpointError(f"{where}: cannot express intermediate_size {hidden} for hidden_size {dim}")
    return args, "custom"


def _qwen3_args(cfg: dict, where: str) -> tuple[Qwen3Args, str]:
    """Qwen3Args of a Qwen3 or Qwen3-MoE config (the fields as transformers reads them, with its
    defaults: head_dim 128 for qwen3 and hidden_size / num_attention_heads for qwen3_moe when absent,
    norm_topk_prob false, decoder_sparse_step 1, no mlp_only_layers).

    Raises HFCheckpointError for what our model does not have: biases, another activation, sliding-
    window attention, rope scaling other than none or 'llama3', and for Qwen3-MoE: no experts,
    decoder_sparse_step != 1, mlp_only_layers that are not the first k layers, shared experts, or
    num_experts_per_tok 1 with norm_topk_prob (transformers then weighs every token's expert by 1).
    """
    moe_type = cfg.get("model_type") == "qwen3_moe"
    what = "Qwen3-MoE" if moe_type else "Qwen3"
    _int_fields(cfg, ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"),
                what, where)
    if cfg.get("hidden_act", "silu") != "silu":
        raise HFCheckpointError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported (expected 'silu')")
    if cfg.get("attention_bias"):
        raise HFCheckpointError(f"{where}: attention_bias=true is not supported (our Qwen3 has no biases)")
    layer_types = cfg.get("layer_types") or []
    if cfg.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
        raise HFCheckpointError(f"{where}: sliding-window attention (use_sliding_window / layer_types) is not "
                                f"supported (our attention is full causal)")
    dim, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or (dim // heads if moe_type else 128)
    theta, scaling = _rope_from_config(cfg, where)
    moe, n_dense = None, 0
    if moe_type:
        n_exp = cfg.get("num_experts", cfg.get("num_local_experts", 128))
        top_k, hidden = cfg.get("num_experts_per_tok", 8), cfg.get("moe_intermediate_size", 768)
        bad = [f"{k} {v!r}" for k, v in (("num_experts", n_exp), ("num_experts_per_tok", top_k),
                                         ("moe_intermediate_size", hidden))
               if isinstance(v, bool) or not isinstance(v, int) or v < 1]
        if bad:
            raise HFCheckpointError(f"{where}: expected integers >= 1, got {', '.join(bad)}")
        step = cfg.get("decoder_sparse_step", 1)
        if step != 1:
            raise HFCheckpointError(f"{where}: decoder_sparse_step {step} is not supported (expected 1: every layer "
                                    f"after the mlp_only_layers is a MoE layer)")
        only = sorted(cfg.get("mlp_only_layers") or [])
        if only != list(range(len(only))):
            raise HFCheckpointError(f"{where}: mlp_only_layers {only} is not supported (only the first k layers "
                                    f"may be dense: [0, ..., k-1])")
        if cfg.get("shared_expert_intermediate_size"):
            raise HFCheckpointError(f"{where}: shared experts (shared_expert_intermediate_size) are not part of "
                                    f"Hugging Face Qwen3-MoE; not supported")
        norm = bool(cfg.get("norm_topk_prob", False))
        if norm and top_k == 1:
            raise HFCheckpointError(f"{where}: num_experts_per_tok 1 with norm_topk_prob true is not supported (every "
                                    f"routing weight would be 1; our router keeps the score)")
        try:
            moe = MoEArgs(num_experts=n_exp, top_k=top_k, hidden_dim=hidden, score_func="softmax", route_norm=norm)
        except ValueError as exc:
            raise HFCheckpointError(f"{where}: {exc}") from None
        n_dense = len(only)
    try:
        args = Qwen3Args(
            dim=dim, n_layers=cfg["num_hidden_layers"], n_heads=heads,
            n_kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=head_dim,
            hidden_dim=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
            max_seq_len=int(cfg.get("max_position_embeddings") or 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), moe=moe, n_dense_layers=n_dense)
    except ValueError as exc:  # Qwen3Args' own checks (heads, head_dim, layers)
        raise HFCheckpointError(f"{where}: {exc}") from None
    for name, flavor in QWEN3_FLAVORS.items():
        if not differences(args, flavor):
            return args, name
    return args, "custom"


def _field(args, name: str):
    if name == "family":
        return family_of(args)
    if name.startswith("moe."):
        moe = getattr(args, "moe", None)
        return None if moe is None else getattr(moe, name[4:])
    return getattr(args, name, None)


def _differing(a, b, ignore_vocab: bool = False) -> list[tuple[str, object, object]]:
    out = []
    for f in _SHAPE_FIELDS + _MATH_FIELDS:
        if f == "vocab_size" and (ignore_vocab or -1 in (a.vocab_size, b.vocab_size)):
            continue
        if f == "qk_norm":  # Llama's args have no field: no QK-norm
            va, vb = bool(_field(a, f)), bool(_field(b, f))
        elif f == "n_dense_layers":
            va, vb = _field(a, f) or 0, _field(b, f) or 0
        else:
            va, vb = _field(a, f), _field(b, f)
        if va != vb:
            out.append((f, va, vb))
    return out


def differences(a, b, ignore_vocab: bool = False) -> list[str]:
    """``field a vs b`` for every shape or math field where the model args ``a`` and ``b`` differ
    (``family llama3 vs qwen3`` first when they are of two families; ``moe.top_k 8 vs 2``...)."""
    return [f"{f} {va} vs {vb}" for f, va, vb in _differing(a, b, ignore_vocab)]


def check_compatible(found, run, where: str, run_name: str) -> None:
    """Raise HFCheckpointError if ``found`` (a checkpoint's) has other shapes than ``run``; warn for other math."""
    shape = [f"{f} {va} vs {vb}" for f, va, vb in _differing(found, run) if f in _SHAPE_FIELDS]
    if shape:
        raise HFCheckpointError(f"{where}: shapes do not match {run_name}: {'; '.join(shape)} (checkpoint vs run)")
    math_ = differences(found, run)
    if math_:
        logger.warning("%s: loads into %s, but %s (checkpoint vs run): the model is not exactly the one saved",
                       where, run_name, "; ".join(math_))


def _safetensors():
    try:
        import safetensors
        import safetensors.torch  # noqa: F401
    except ImportError:
        raise RuntimeError("Hugging Face checkpoints need the safetensors package: pip install safetensors") from None
    return safetensors


# ------------------------------------------------------------------------------------------------
# our parameter names and shapes, and their Hugging Face names


def expected_shapes(args, buffers: bool = False) -> dict[str, tuple[int, ...]]:
    """Our parameter names -> shapes for ``args`` (ModelArgs or Qwen3Args), in module order, as
    ``trainer.models.blocks.Transformer`` has them (checked against the built model in
    tests/trainer/test_hf.py). ``buffers``: also the persistent buffers (the MoE layers'
    ``feed_forward.expert_bias`` (E,)), which DCP checkpoints hold. No model is built."""
    d, hd = args.dim, args.head_dim
    q, kv = args.n_heads * hd, args.kv_heads * hd
    qk_norm = getattr(args, "qk_norm", False)
    moe_layer = getattr(args, "moe_layer", None)
    out: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (args.vocab_size, d)}
    for i in range(args.n_layers):
        p = f"layers.{i}."
        out[p + "attention_norm.weight"] = (d,)
        out.update({p + "attention.wq.weight": (q, d), p + "attention.wk.weight": (kv, d),
                    p + "attention.wv.weight": (kv, d), p + "attention.wo.weight": (d, q)})
        if qk_norm:
            out[p + "attention.q_norm.weight"] = out[p + "attention.k_norm.weight"] = (hd,)
        out[p + "ffn_norm.weight"] = (d,)
        if moe_layer is not None and moe_layer(i):
            m = args.moe
            e, h = m.num_experts, m.hidden_dim
            out[p + "feed_forward.router.gate.weight"] = (e, d)
            out.update({p + "feed_forward.experts.w1": (e, d, h), p + "feed_forward.experts.w2": (e, h, d),
                        p + "feed_forward.experts.w3": (e, d, h)})
            if m.num_shared_experts:
                hs = h * m.num_shared_experts
                out.update({p + "feed_forward.shared_experts.w1.weight": (hs, d),
                            p + "feed_forward.shared_experts.w2.weight": (d, hs),
                            p + "feed_forward.shared_experts.w3.weight": (hs, d)})
            if buffers:
                out[p + "feed_forward.expert_bias"] = (e,)
        else:
            f = args.ffn_hidden_dim
            out.update({p + "feed_forward.w1.weight": (f, d), p + "feed_forward.w2.weight": (d, f),
                        p + "feed_forward.w3.weight": (f, d)})
    out["norm.weight"] = (d,)
    if not args.tie_word_embeddings:
        out["output.weight"] = (args.vocab_size, d)
    return out


def expected_keys(args) -> list[str]:
    """Our parameter names for ``args``, in module order."""
    return list(expected_shapes(args))


def expected_shape(args, key: str) -> tuple[int, ...]:
    """The shape of our parameter (or buffer) ``key`` for ``args``. Raises KeyError for another name."""
    return expected_shapes(args, buffers=True)[key]


def hf_names(args, key: str, fused: bool = False) -> list[str]:
    """The Hugging Face tensors holding our parameter ``key``: one, or for a Qwen3-MoE expert weight
    E per-expert matrices (``fused``: transformers' one fused tensor); none for ``expert_bias``.
    Raises KeyError for a key with no counterpart."""
    if family_of(args) == "qwen3":
        return _qwen3.hf_keys(key, args, fused)
    return [_llama_hf_key(key)]


def to_hf_state_dict(state_dict: dict[str, torch.Tensor], args) -> dict[str, torch.Tensor]:
    """Our (full) state dict -> Hugging Face names and layout, for either family."""
    if family_of(args) == "qwen3":
        return _qwen3.to_hf_state_dict(state_dict, args)
    return _llama_to_hf(state_dict, args)


def from_hf_state_dict(state_dict: dict[str, torch.Tensor], args) -> dict[str, torch.Tensor]:
    """Hugging Face names and layout -> ours, for either family."""
    if family_of(args) == "qwen3":
        return _qwen3.from_hf_state_dict(state_dict, args)
    return _llama_from_hf(state_dict, args)


def _is_expert(key: str) -> bool:
    return key.endswith(("feed_forward.experts.w1", "feed_forward.experts.w2", "feed_forward.experts.w3"))


# ------------------------------------------------------------------------------------------------
# reading


class HFCheckpoint:
    """A Hugging Face Llama / Qwen3 / Qwen3-MoE folder opened for reading (config parsed, shard
    index read; no weights yet).

    ``args``/``flavor``: our ModelArgs or Qwen3Args and the flavor they match; ``family``: llama3
    or qwen3. ``tensor(name)`` reads one tensor by its Hugging Face name, ``our_tensor(key)`` one
    of our parameters (a Qwen3-MoE layer's E expert matrices stacked). Raises HFCheckpointError
    when the folder is not such a checkpoint.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        where = str(self.path)
        if not self.path.is_dir():
            raise HFCheckpointError(f"{where}: not a folder")
        cfg_path = self.path / CONFIG
        if not cfg_path.is_file():
            raise HFCheckpointError(f"{where}: no {CONFIG}; not a Hugging Face checkpoint folder")
        try:
            self.config = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise HFCheckpointError(f"{cfg_path}: not valid JSON ({exc})") from None
        if not isinstance(self.config, dict):
            raise HFCheckpointError(f"{cfg_path}: expected a JSON object")
        self.args, self.flavor = args_from_hf_config(self.config, str(cfg_path))
        self.family = family_of(self.args)
        self.shapes = expected_shapes(self.args)
        self.weight_map = self._weight_map()
        self._open: dict[str, object] = {}

    def _weight_map(self) -> dict[str, str]:
        index, single = self.path / INDEX, self.path / SINGLE
        if index.is_file():
            try:
                wm = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (ValueError, KeyError, TypeError) as exc:
                raise HFCheckpointError(f"{index}: not a safetensors index ({exc!r})") from None
            for f in sorted(set(wm.values())):
                if not (self.path / f).is_file():
                    raise HFCheckpointError(f"{index}: names shard {f}, which is missing")
            return dict(wm)
        if single.is_file():
            safe_open = _safetensors().safe_open
            with safe_open(str(single), framework="pt") as fh:
                return {k: SINGLE for k in fh.keys()}
        others = sorted(p.name for p in self.path.glob("*.bin")) + sorted(p.name for p in self.path.glob("*.pth"))
        hint = f" (found {', '.join(others[:3])}: only safetensors are read)" if others else ""
        raise HFCheckpointError(f"{self.path}: no {SINGLE} or {INDEX}{hint}")

    def _file(self, name: str):
        safe_open = _safetensors().safe_open

        f = self.weight_map[name]
        if f not in self._open:
            self._open[f] = safe_open(str(self.path / f), framework="pt", device="cpu")
        return self._open[f]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file(name).get_slice(name).get_shape())

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor ``name`` (Hugging Face naming) as stored, read from its shard."""
        if name not in self.weight_map:
            raise HFCheckpointError(f"{self.path}: tensor {name} is missing")
        return self._file(name).get_tensor(name)

    def close(self) -> None:
        self._open.clear()

    def _fused(self, key: str) -> bool:
        """Whether the experts of ``key``'s layer are stored fused (transformers' in-memory layout)."""
        return _is_expert(key) and hf_names(self.args, key, fused=True)[0] in self.weight_map

    def names_of(self, key: str) -> list[str]:
        """The Hugging Face tensors of this folder that hold our parameter ``key``."""
        return hf_names(self.args, key, self._fused(key))

    def check_names(self) -> None:
        """Raise HFCheckpointError if a tensor of the config's model is missing or an unknown one is present."""
        kind = "Llama" if self.family == "llama3" else "Qwen3"
        try:
            expected = {n for k in self.shapes for n in self.names_of(k)}
        except KeyError as exc:  # a parameter without a Hugging Face counterpart (cannot come from a config)
            raise HFCheckpointError(f"{self.path}: {exc.args[0]}") from None
        present = {k for k in self.weight_map if not k.endswith(_IGNORED_SUFFIXES)}
        if self.args.tie_word_embeddings:
            present.discard("lm_head.weight")
        missing, extra = sorted(expected - present), sorted(present - expected)
        if extra:
            raise HFCheckpointError(f"{self.path}: not a {kind} checkpoint of this config: unexpected tensor "
                                    f"{extra[0]}" + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
        if missing:
            raise HFCheckpointError(f"{self.path}: tensor {missing[0]} is missing"
                                    + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))

    def _hf_shape(self, key: str, name: str) -> tuple[int, ...]:
        """The shape the Hugging Face tensor ``name`` of our ``key`` must have (from config.json)."""
        want = self.shapes[key]
        if not _is_expert(key):
            return want  # the rotary permutation keeps the shape
        e, a, b = want  # ours (E, in, out)
        if name.endswith("gate_up_proj"):
            return (e, 2 * b, a)
        if name.endswith("experts.down_proj"):
            return (e, b, a)
        return (b, a)  # one expert's (out, in)

    def our_tensor(self, key: str) -> torch.Tensor:
        """Our parameter ``key`` (our naming, interleaved rotary layout, experts stacked (E, in, out)),
        read from its Hugging Face tensor(s), each checked against the config's shape."""
        parts = {}
        for name in self.names_of(key):
            t = self.tensor(name)
            want = self._hf_shape(key, name)
            if tuple(t.shape) != want:
                raise HFCheckpointError(f"{self.path}: tensor {name} has shape {tuple(t.shape)}, expected {want} "
                                        f"from {CONFIG}")
            parts[name] = t
        try:
            return from_hf_state_dict(parts, self.args)[key]
        except ValueError as exc:
            raise HFCheckpointError(f"{self.path}: {exc}") from None


@torch.no_grad()
def load_into_model(model: nn.Module, ckpt: HFCheckpoint) -> int:
    """Copy the checkpoint's weights into ``model``'s parameters, whatever its parallel layout.

    ``model``: a materialized Transformer or this rank's part of one (pipeline stage, FSDP2/TP/EP
    DTensor parameters; names as in the full model). Each parameter is read whole from its shard
    (one tensor of host memory at a time: a Qwen3-MoE layer's stacked (E, in, out) expert weight
    at most), cast to the parameter's dtype, and each rank keeps its own piece. The MoE layers'
    ``expert_bias`` buffers are zeroed (Hugging Face routes without one). Returns the number of
    parameters loaded. Raises HFCheckpointError for a missing tensor or a shape mismatch.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    ckpt.check_names()
    n = 0
    for name, param in model.named_parameters():
        if name not in ckpt.shapes:
            raise HFCheckpointError(f"{ckpt.path}: the model's parameter {name} has no counterpart in this "
                                    f"{ckpt.family} checkpoint")
        full = ckpt.our_tensor(name)
        if tuple(full.shape) != tuple(param.shape):
            raise HFCheckpointError(f"{ckpt.path}: tensor {ckpt.names_of(name)[0]} gives shape {tuple(full.shape)}, "
                                    f"the model's {name} has {tuple(param.shape)}")
        local = param.to_local() if isinstance(param, DTensor) else param
        full = full.to(device=local.device, dtype=param.dtype)
        if isinstance(param, DTensor):
            full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.copy_(full)
        n += 1
    for name, buf in model.named_buffers():
        if name.endswith("feed_forward.expert_bias"):
            buf.zero_()
    ckpt.close()
    return n


# ------------------------------------------------------------------------------------------------
# writing


class HFWriter:
    """Writes a Hugging Face Llama / Qwen3 / Qwen3-MoE folder: tensors in, shards of at most
    ``max_shard_size`` bytes out.

    ``add(our_key, tensor)`` converts a full (unsharded) parameter to the Hugging Face names and
    layout (a Qwen3-MoE expert weight (E, in, out) to E (out, in) matrices) and queues it;
    ``close()`` writes the last shard, renames the shards to ``model-0000k-of-0000n.safetensors``
    with their index (or ``model.safetensors`` when one is enough, as ``save_pretrained`` does) and
    writes ``config.json``. Tied models store no ``lm_head.weight`` (transformers ties it to the
    embedding on load). An ``expert_bias`` buffer is not written; ``close`` warns (logger
    "trainer") when one was not zero: transformers' Qwen3-MoE picks its top-k experts without it,
    so the exported model routes some tokens to other experts than the trained one did.

    Raises HFCheckpointError at construction for a model Hugging Face cannot express (``hf_config``).
    """

    def __init__(self, out: str | os.PathLike, args, dtype: torch.dtype,
                 max_shard_size: int = DEFAULT_MAX_SHARD_SIZE) -> None:
        if max_shard_size < 1:
            raise ValueError(f"max_shard_size: expected bytes >= 1, got {max_shard_size}")
        self.config = hf_config(args, dtype)  # refuses what Hugging Face cannot express, before any shard
        self.out, self.args, self.dtype, self.max_shard_size = Path(out), args, dtype, max_shard_size
        self.out.mkdir(parents=True, exist_ok=True)
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[str, list[str]]] = []
        self.total_size = 0
        self.biased_layers: list[tuple[str, float]] = []  # (expert_bias key, max |bias|) of non-zero ones

    def add(self, key: str, tensor: torch.Tensor) -> None:
        if key.endswith("feed_forward.expert_bias"):
            peak = float(tensor.detach().abs().max()) if tensor.numel() else 0.0
            if peak > 0:
                self.biased_layers.append((key, peak))
            return
        for name, t in to_hf_state_dict({key: tensor}, self.args).items():
            if name == "lm_head.weight" and self.args.tie_word_embeddings:
                continue
            t = t.detach().to("cpu", self.dtype).contiguous()
            size = t.numel() * t.element_size()
            if self._pending and self._pending_bytes + size > self.max_shard_size:
                self._flush()
            self._pending[name] = t
            self._pending_bytes += size
            self.total_size += size

    def add_all(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        for k, t in items:
            self.add(k, t)

    def _flush(self) -> None:
        _safetensors()
        from safetensors.torch import save_file

        tmp = f".shard-{len(self._shards):05d}.safetensors"
        save_file(self._pending, str(self.out / tmp), metadata={"format": "pt"})
        self._shards.append((tmp, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> Path:
        if self._pending or not self._shards:
            self._flush()
        n = len(self._shards)
        weight_map = {}
        for i, (tmp, names) in enumerate(self._shards):
            final = SINGLE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.out / tmp, self.out / final)
            weight_map.update(dict.fromkeys(names, final))
        if n > 1:
            index = {"metadata": {"total_size": self.total_size}, "weight_map": dict(sorted(weight_map.items()))}
            (self.out / INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        (self.out / CONFIG).write_text(json.dumps(self.config, indent=2) + "\n", encoding="utf-8")
        if self.biased_layers:
            key, peak = max(self.biased_layers, key=lambda kv: kv[1])
            logger.warning(
                "%s: %d MoE layer(s) have a non-zero load-balancing expert_bias (largest |bias| %.3g, %s); Hugging "
                "Face Qwen3-MoE has none and picks the top-k experts by the router scores alone, so the exported "
                "model routes some tokens differently from the trained one", self.out, len(self.biased_layers), peak,
                key)
        return self.out


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB', '1024' -> bytes (decimal units as Hugging Face's max_shard_size; binary with i)."""
    units = {"": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    s = text.strip().upper()
    num = s.rstrip("KMGTIB")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = math.nan
    if unit not in units or not math.isfinite(value) or value <= 0:
        raise ValueError(f"max_shard_size: expected a size such as 5GB, 500MB or 2GiB, got {text!r}")
    return int(value * units[unit])
