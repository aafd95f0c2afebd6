"""A Hugging Face folder of safetensors shards + config.json, read and written tensor by tensor.

The layout is the one transformers' ``save_pretrained`` writes (``trainer.hf``: ``config.json``,
``model.safetensors`` or ``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``).
Reading never loads the whole model: ``HFCheckpoint.tensor`` reads one tensor from its shard
(safetensors maps the file), and ``load_into_model`` copies parameter by parameter into a model of
any parallel layout. Writing streams too: ``HFWriter`` takes tensors in order and closes a shard
once it holds ``max_shard_size`` bytes. The names and layouts come from ``trainer.hf.mapping``.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from trainer.hf.adapter import is_expert
from trainer.hf.common import CONFIG, DEFAULT_MAX_SHARD_SIZE, INDEX, SINGLE, HFCheckpointError, logger
from trainer.hf.mapping import (
    adapter_of,
    args_from_hf_config,
    expected_shapes,
    from_hf_state_dict,
    hf_config,
    hf_names,
    to_hf_state_dict,
)
from trainer.registry import family_of

# Buffers some Hugging Face checkpoints carry that are not weights (recomputed from the config).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _safetensors():
    try:
        import safetensors
        import safetensors.torch  # noqa: F401
    except ImportError:
        raise RuntimeError("Hugging Face checkpoints need the safetensors package: pip install safetensors") from None
    return safetensors


# ------------------------------------------------------------------------------------------------
# reading


def weight_files(adapter) -> tuple[str, str]:
    """(single file, shard index) names of a family's folders: ``model.safetensors`` and
    ``model.safetensors.index.json`` for transformers, the adapter's ``weights_name`` stem otherwise."""
    stem = adapter.weights_name
    return (SINGLE, INDEX) if stem == "model" else (f"{stem}.safetensors", f"{stem}.safetensors.index.json")


class HFCheckpoint:
    """A Hugging Face folder of one of our families opened for reading (config parsed, shard index
    read; no weights yet).

    ``args``/``flavor``: our model args and the flavor they match ("custom" for none); ``family``:
    its registered name. ``tensor(name)`` reads one tensor by its Hugging Face name,
    ``our_tensor(key)`` one of our parameters or persistent buffers (a MoE layer's E expert matrices
    stacked). Raises HFCheckpointError when the folder is not such a checkpoint.
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
        self.adapter = adapter_of(self.args)
        self.weight_map = self._weight_map()
        adjust = getattr(self.adapter, "args_for_weights", None)  # e.g. MTP modules a folder lacks
        if adjust is not None:
            self.args = adjust(self.args, self.weight_map)
        self.shapes = expected_shapes(self.args)
        # Buffers Hugging Face stores too (DeepSeek-V3's e_score_correction_bias is our expert_bias).
        self.buffers = {k: v for k, v in expected_shapes(self.args, buffers=True).items()
                        if k not in self.shapes and hf_names(self.args, k)}
        self._open: dict[str, object] = {}

    def _weight_map(self) -> dict[str, str]:
        single_name, index_name = weight_files(self.adapter)
        index, single = self.path / index_name, self.path / single_name
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
                return {k: single_name for k in fh.keys()}
        others = sorted(p.name for p in self.path.glob("*.bin")) + sorted(p.name for p in self.path.glob("*.pth"))
        hint = f" (found {', '.join(others[:3])}: only safetensors are read)" if others else ""
        raise HFCheckpointError(f"{self.path}: no {single_name} or {index_name}{hint}")

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
        return is_expert(key) and hf_names(self.args, key, fused=True)[0] in self.weight_map

    def names_of(self, key: str) -> list[str]:
        """The Hugging Face tensors of this folder that hold our parameter ``key``."""
        return hf_names(self.args, key, self._fused(key))

    def check_names(self) -> None:
        """Raise HFCheckpointError if a tensor of the config's model is missing or an unknown one is present."""
        kind = self.adapter.title
        try:
            expected = {n for k in (*self.shapes, *self.buffers) for n in self.names_of(k)}
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
        want = self.shapes[key] if key in self.shapes else self.buffers[key]
        return self.adapter.hf_shape(key, want, name)

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


def custom_model_args(path, family: str, vocab_size: int, seq_len: int, model_config=None):
    """``--flavor custom``: the args of the model the Hugging Face folder ``path`` describes (its
    config.json), which must be of ``family``, for sequences up to ``seq_len`` and a tokenizer of
    ``vocab_size`` tokens. Raises HFCheckpointError (a ValueError; one line naming the key) for a
    folder of another family or one we cannot reproduce, ValueError for a tokenizer larger than its
    vocabulary."""
    ckpt = HFCheckpoint(path)
    found = family_of(ckpt.args)
    if found != family:
        raise HFCheckpointError(f"--model.name: {family}, but {path} holds a {found} model (use --model.name {found})")
    if ckpt.args.vocab_size != -1 and vocab_size > ckpt.args.vocab_size:  # -1: no vocabulary of its own (Flux)
        raise ValueError(f"--model.tokenizer_path: the tokenizer has {vocab_size} tokens but {path} has an embedding "
                         f"of {ckpt.args.vocab_size}; use the model's own tokenizer")
    logger.info("flavor custom: the model of %s (%s)", path,
                f"the published flavor {ckpt.flavor}" if ckpt.flavor != "custom" else "no published flavor")
    args = ckpt.args.replace(max_seq_len=seq_len)
    return args.configure(model_config) if model_config is not None else args


@torch.no_grad()
def load_into_model(model: nn.Module, ckpt: HFCheckpoint) -> int:
    """Copy the checkpoint's weights into ``model``'s parameters, whatever its parallel layout.

    ``model``: a materialized Transformer or this rank's part of one (pipeline stage, FSDP2/TP/EP
    DTensor parameters; names as in the full model). Each parameter is read whole from its shard
    (one tensor of host memory at a time: a Qwen3-MoE layer's stacked (E, in, out) expert weight
    at most), cast to the parameter's dtype, and each rank keeps its own piece. The MoE layers'
    ``expert_bias`` buffers are read where the family stores them (DeepSeek-V3's
    ``e_score_correction_bias``), else zeroed (Hugging Face routes without one). Returns the number
    of parameters loaded. Raises HFCheckpointError for a missing tensor or a shape mismatch.
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
        if name in ckpt.buffers:
            buf.copy_(ckpt.our_tensor(name).to(device=buf.device, dtype=buf.dtype))
        elif name.endswith("feed_forward.expert_bias"):
            buf.zero_()
    ckpt.close()
    return n


# ------------------------------------------------------------------------------------------------
# writing


class HFWriter:
    """Writes a Hugging Face folder of one of our families: tensors in, shards of at most
    ``max_shard_size`` bytes out.

    ``add(our_key, tensor)`` converts a full (unsharded) parameter to the Hugging Face names and
    layout (a MoE expert weight (E, in, out) to E (out, in) matrices) and queues it; ``close()``
    writes the last shard, renames the shards to ``model-0000k-of-0000n.safetensors`` with their
    index (or ``model.safetensors`` when one is enough, as ``save_pretrained`` does) and writes
    ``config.json``. Tied models store no ``lm_head.weight`` (transformers ties it to the embedding
    on load). An ``expert_bias`` buffer is written where the family's Hugging Face model has one
    (DeepSeek-V3's ``e_score_correction_bias``); elsewhere it is not, and ``close`` warns (logger
    "trainer") when one was not zero: transformers then picks the top-k experts without it, so the
    exported model routes some tokens to other experts than the trained one did.

    Raises HFCheckpointError at construction for a model Hugging Face cannot express (``hf_config``).
    """

    def __init__(self, out: str | os.PathLike, args, dtype: torch.dtype,
                 max_shard_size: int = DEFAULT_MAX_SHARD_SIZE) -> None:
        if max_shard_size < 1:
            raise ValueError(f"max_shard_size: expected bytes >= 1, got {max_shard_size}")
        self.config = hf_config(args, dtype)  # refuses what Hugging Face cannot express, before any shard
        self.out, self.args, self.dtype, self.max_shard_size = Path(out), args, dtype, max_shard_size
        self.adapter = adapter_of(args)
        self.out.mkdir(parents=True, exist_ok=True)
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._groups: dict[str, torch.Tensor] = {}  # halves waiting for the rest of their export group
        self._shards: list[tuple[str, list[str]]] = []
        self.total_size = 0
        self.biased_layers: list[tuple[str, float]] = []  # (expert_bias key, max |bias|) of non-zero ones

    def add(self, key: str, tensor: torch.Tensor) -> None:
        if key.endswith("feed_forward.expert_bias"):
            peak = float(tensor.detach().abs().max()) if tensor.numel() else 0.0
            if peak > 0:
                self.biased_layers.append((key, peak))
        group = self.adapter.export_group(key)
        if len(group) > 1:  # keys that make one Hugging Face tensor wait for each other
            self._groups[key] = tensor
            if not all(k in self._groups for k in group):
                return
            part = {k: self._groups.pop(k) for k in group}
        else:
            part = {key: tensor}
        for name, t in to_hf_state_dict(part, self.args).items():
            if name == "lm_head.weight" and self.args.tie_word_embeddings:
                continue
            # the routing bias stays float32 (transformers keeps it in fp32 whatever the dtype)
            dtype = torch.float32 if key.endswith("feed_forward.expert_bias") else self.dtype
            t = t.detach().to("cpu", dtype).contiguous()
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
        if self._groups:
            raise HFCheckpointError(f"{self.out}: {sorted(self._groups)[0]} was given without the tensors it is "
                                    f"exported with ({', '.join(self.adapter.export_group(sorted(self._groups)[0]))})")
        if self._pending or not self._shards:
            self._flush()
        n = len(self._shards)
        single, index_name = weight_files(self.adapter)
        stem = self.adapter.weights_name
        weight_map = {}
        mode = _file_mode()
        written = set()
        for i, (tmp, names) in enumerate(self._shards):
            final = single if n == 1 else f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors"
            os.chmod(self.out / tmp, mode)  # readable as the folder's other files (the shard writer's are 0600)
            os.replace(self.out / tmp, self.out / final)
            weight_map.update(dict.fromkeys(names, final))
            written.add(final)
        if n > 1:
            index = {"metadata": {"total_size": self.total_size}, "weight_map": dict(sorted(weight_map.items()))}
            (self.out / index_name).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
            written.add(index_name)
        (self.out / CONFIG).write_text(json.dumps(self.config, indent=2) + "\n", encoding="utf-8")
        self._remove_stale_weights(written)
        warning = self.adapter.export_warning(self.biased_layers, self.out)
        if warning:
            logger.warning("%s", warning)
        return self.out


    def _remove_stale_weights(self, written: set[str]) -> None:
        # An earlier export into this folder left weight files this one did not write (another shard
        # count, or an index beside a single file): readers would mix the two exports. They go only
        # now, after the new weights are in place.
        single, index_name = weight_files(self.adapter)
        stem = self.adapter.weights_name
        for path in self.out.iterdir():
            name = path.name
            stale = name in (single, index_name) or (name.startswith(f"{stem}-") and name.endswith(".safetensors"))
            if stale and name not in written:
                path.unlink()
                logger.info("%s: removed %s of an earlier export", self.out, name)


def _file_mode() -> int:
    """0o666 under the process's umask: the mode open() gives a new file."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


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
