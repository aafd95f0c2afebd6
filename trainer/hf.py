"""Hugging Face Llama checkpoints: read and write folders of safetensors shards + config.json.

A Hugging Face Llama folder (as ``LlamaForCausalLM.save_pretrained`` writes it) holds
  config.json                        model_type "llama": hidden_size, num_hidden_layers, ...
  model.safetensors                  the weights, when they fit one shard; else
  model-0000k-of-0000n.safetensors   shards, and
  model.safetensors.index.json       {"metadata": {"total_size": bytes}, "weight_map": {name: shard file}}
Names and the rotary layout differ from ours (``trainer.models.llama.to_hf_state_dict``): wq/wk
rows are permuted from Meta's interleaved pairs to Hugging Face's rotate-half halves.

Reading never loads the whole model: ``HFCheckpoint.tensor`` reads one tensor from its shard
(safetensors maps the file), and ``load_into_model`` copies parameter by parameter into a model of
any parallel layout (each rank keeps its shard of every DTensor parameter, as ``init_weights`` does).
Writing streams too: ``HFWriter`` takes tensors in order and closes a shard once it holds
``max_shard_size`` bytes.

Errors: ``HFCheckpointError`` (a ValueError) with a one-line message naming the folder and what is
wrong (no config.json, not a Llama, unsupported options, a missing tensor, a shape that does not
match the config or the run's flavor).
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

from trainer.models.llama import (
    LLAMA3_FLAVORS,
    ModelArgs,
    from_hf_state_dict,
    hf_key,
    to_hf_state_dict,
)

logger = logging.getLogger("trainer")

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 2**30
# Buffers some Hugging Face checkpoints carry that are not weights (recomputed from the config).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# Fields of ModelArgs that fix the tensor shapes (a mismatch cannot load) and those that only change
# the math (a mismatch loads, but the model is not the one that was trained).
_SHAPE_FIELDS = ("dim", "n_layers", "n_heads", "kv_heads", "ffn_hidden_dim", "vocab_size", "tie_word_embeddings")
_MATH_FIELDS = ("norm_eps", "rope_theta", "rope_scaling")


class HFCheckpointError(ValueError):
    """A folder is not a usable Hugging Face Llama checkpoint; the message is one line."""


# ------------------------------------------------------------------------------------------------
# config.json <-> ModelArgs


def hf_config(args: ModelArgs, dtype: torch.dtype = torch.float32) -> dict:
    """The ``config.json`` of a Hugging Face ``LlamaForCausalLM`` equal to our model ``args``.

    Written in the long-standing layout (``rope_theta`` + ``rope_scaling``), which every
    transformers version reads. ``max_position_embeddings`` is the published 131072 for rope-scaled
    (Llama 3.1/3.2) models; it does not change the math (``original_max_position_embeddings`` does).
    """
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


def args_from_hf_config(cfg: dict, where: str = CONFIG) -> tuple[ModelArgs, str]:
    """Our ModelArgs for a Hugging Face Llama ``config.json`` dict, and the flavor it matches ("custom" if none).

    The FFN width is reproduced exactly: by a flavor's ``multiple_of``/``ffn_dim_multiplier`` when
    the shapes are a flavor's, else by ``multiple_of = intermediate_size``.
    Raises HFCheckpointError for a non-Llama config or options our model does not have (biases,
    another activation, a head_dim other than hidden_size / num_attention_heads, other rope scaling).
    """
    model_type = cfg.get("model_type")
    if model_type != "llama":
        archs = cfg.get("architectures") or []
        raise HFCheckpointError(f"{where}: not a Llama checkpoint (model_type {model_type!r}, architectures {archs})")
    need = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    missing = [k for k in need if not isinstance(cfg.get(k), int)]
    if missing:
        raise HFCheckpointError(f"{where}: Llama config lacks integer {', '.join(missing)}")
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


def differences(a: ModelArgs, b: ModelArgs, ignore_vocab: bool = False) -> list[str]:
    """``field a vs b`` for every shape or math field where ``a`` and ``b`` differ."""
    out = []
    for f in _SHAPE_FIELDS + _MATH_FIELDS:
        if f == "vocab_size" and (ignore_vocab or -1 in (a.vocab_size, b.vocab_size)):
            continue
        va, vb = getattr(a, f), getattr(b, f)
        if va != vb:
            out.append(f"{f} {va} vs {vb}")
    return out


def check_compatible(found: ModelArgs, run: ModelArgs, where: str, run_name: str) -> None:
    """Raise HFCheckpointError if ``found`` (a checkpoint's) has other shapes than ``run``; warn for other math."""
    shape = [d for d in differences(found, run) if d.split(" ", 1)[0] in _SHAPE_FIELDS]
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
# reading


class HFCheckpoint:
    """A Hugging Face Llama folder opened for reading (config parsed, shard index read; no weights yet).

    ``args``/``flavor``: our ModelArgs and the flavor they match. ``tensor(name)`` reads one tensor
    by its Hugging Face name. Raises HFCheckpointError when the folder is not a Llama checkpoint.
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

    def check_names(self) -> None:
        """Raise HFCheckpointError if a Llama tensor is missing or an unknown one is present."""
        expected = {hf_key(k) for k in expected_keys(self.args)}
        present = {k for k in self.weight_map if not k.endswith(_IGNORED_SUFFIXES)}
        if self.args.tie_word_embeddings:
            present.discard("lm_head.weight")
        missing, extra = sorted(expected - present), sorted(present - expected)
        if extra:
            raise HFCheckpointError(f"{self.path}: not a Llama checkpoint of this config: unexpected tensor "
                                    f"{extra[0]}" + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
        if missing:
            raise HFCheckpointError(f"{self.path}: tensor {missing[0]} is missing"
                                    + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))

    def our_tensor(self, key: str) -> torch.Tensor:
        """Our parameter ``key`` (our naming, interleaved rotary layout), checked against the config's shape."""
        name = hf_key(key)
        t = self.tensor(name)
        want = expected_shape(self.args, key)
        if tuple(t.shape) != want:
            raise HFCheckpointError(f"{self.path}: tensor {name} has shape {tuple(t.shape)}, expected {want} "
                                    f"from {CONFIG}")
        return from_hf_state_dict({name: t}, self.args)[key]


def expected_keys(args: ModelArgs) -> list[str]:
    """Our parameter names for ``args``, in module order."""
    per_layer = ("attention_norm.weight", "attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
                 "attention.wo.weight", "ffn_norm.weight", "feed_forward.w1.weight", "feed_forward.w2.weight",
                 "feed_forward.w3.weight")
    keys = ["tok_embeddings.weight"]
    keys += [f"layers.{i}.{k}" for i in range(args.n_layers) for k in per_layer]
    keys.append("norm.weight")
    if not args.tie_word_embeddings:
        keys.append("output.weight")
    return keys


def expected_shape(args: ModelArgs, key: str) -> tuple[int, ...]:
    """The shape of our parameter ``key`` for ``args`` (the same in Hugging Face's layout)."""
    d, kv, f = args.dim, args.kv_heads * args.head_dim, args.ffn_hidden_dim
    leaf = key.split(".", 2)[-1] if key.startswith("layers.") else key
    return {
        "tok_embeddings.weight": (args.vocab_size, d), "output.weight": (args.vocab_size, d), "norm.weight": (d,),
        "attention_norm.weight": (d,), "ffn_norm.weight": (d,), "attention.wq.weight": (d, d),
        "attention.wk.weight": (kv, d), "attention.wv.weight": (kv, d), "attention.wo.weight": (d, d),
        "feed_forward.w1.weight": (f, d), "feed_forward.w3.weight": (f, d), "feed_forward.w2.weight": (d, f),
    }[leaf]


@torch.no_grad()
def load_into_model(model: nn.Module, ckpt: HFCheckpoint) -> int:
    """Copy the checkpoint's weights into ``model``'s parameters, whatever its parallel layout.

    ``model``: a materialized Transformer or this rank's part of one (pipeline stage, FSDP2/TP
    DTensor parameters; names as in the full model). Each parameter is read whole from its shard
    (one tensor of host memory at a time), cast to the parameter's dtype, and each rank keeps its
    own piece. Returns the number of parameters loaded. Raises HFCheckpointError for a missing
    tensor or a shape mismatch.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    ckpt.check_names()
    n = 0
    for name, param in model.named_parameters():
        full = ckpt.our_tensor(name)
        if tuple(full.shape) != tuple(param.shape):
            raise HFCheckpointError(f"{ckpt.path}: tensor {hf_key(name)} has shape {tuple(full.shape)}, the model's "
                                    f"{name} has {tuple(param.shape)}")
        local = param.to_local() if isinstance(param, DTensor) else param
        full = full.to(device=local.device, dtype=param.dtype)
        if isinstance(param, DTensor):
            full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.copy_(full)
        n += 1
    ckpt.close()
    return n


# ------------------------------------------------------------------------------------------------
# writing


class HFWriter:
    """Writes a Hugging Face Llama folder: tensors in, shards of at most ``max_shard_size`` bytes out.

    ``add(our_key, tensor)`` converts a full (unsharded) parameter to the Hugging Face name and
    rotary layout and queues it; ``close()`` writes the last shard, renames the shards to
    ``model-0000k-of-0000n.safetensors`` with their index (or ``model.safetensors`` when one is
    enough, as ``save_pretrained`` does) and writes ``config.json``. Tied models store no
    ``lm_head.weight`` (transformers ties it to the embedding on load).
    """

    def __init__(self, out: str | os.PathLike, args: ModelArgs, dtype: torch.dtype,
                 max_shard_size: int = DEFAULT_MAX_SHARD_SIZE) -> None:
        if max_shard_size < 1:
            raise ValueError(f"max_shard_size: expected bytes >= 1, got {max_shard_size}")
        self.out, self.args, self.dtype, self.max_shard_size = Path(out), args, dtype, max_shard_size
        self.out.mkdir(parents=True, exist_ok=True)
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[str, list[str]]] = []
        self.total_size = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
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
        (self.out / CONFIG).write_text(json.dumps(hf_config(self.args, self.dtype), indent=2) + "\n",
                                       encoding="utf-8")
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
