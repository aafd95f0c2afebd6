"""Our DCP checkpoints <-> Hugging Face folders, for every registered family (``trainer.registry``):
:func:`dcp_to_hf` and :func:`hf_to_dcp`. ``python -m trainer.convert`` is their command line, and
the checkpointer's ``last_save_in_hf`` export (``trainer.checkpoint.checkpointer``) runs :func:`dcp_to_hf`.

The model arguments come from the checkpoint itself (``model_args``, recorded by every save); a
Llama 3 checkpoint older than that record names its flavor. dcp-to-hf first checks every file
against the checkpoint's ``manifest.json`` (``trainer.checkpoint.manifest``; without one it converts
with a warning) and reads one output shard at a time; hf-to-dcp holds the whole model (one copy, in
the output dtype), as ``dcp.save`` writes all tensors of a checkpoint at once, and writes a manifest.
"""
from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import torch

from trainer.checkpoint.folder import CheckpointError, model_args_record, read_model_args, resolve_step_folder
from trainer.checkpoint.manifest import ManifestError, UnverifiedCheckpoint, data_files, digest_files, verify_folder
from trainer.checkpoint.manifest import write_manifest
from trainer.hf.common import DEFAULT_MAX_SHARD_SIZE, logger
from trainer.hf.folder import HFCheckpoint, HFWriter
from trainer.hf.mapping import expected_keys, expected_shapes
from trainer.hf.tokenizer_files import write_tokenizer_files
from trainer.registry import get as _family
from trainer.registry import spec_of


def _model_tensors(path: Path) -> dict[str, object]:
    """Our parameter name -> DCP TensorStorageMetadata, for the ``model.*`` entries of checkpoint ``path``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {k[len("model."):]: v for k, v in md.items()
            if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}


def _args_for(path: Path, tensors: dict[str, object], flavor: str | None):
    """The model args recorded in checkpoint ``path``; for an older checkpoint without the record,
    the Llama 3 ``flavor`` with the embedding's vocabulary (Qwen3 checkpoints always record theirs)."""
    try:
        args, _ = read_model_args(path)
        return args
    except CheckpointError:
        if flavor is None:
            raise
    flavors = _family("llama3").flavors  # checkpoints without the record predate the other families
    if flavor not in flavors:
        raise CheckpointError(f"--flavor: expected one of {', '.join(flavors)}, got {flavor!r}")
    emb = tensors.get("tok_embeddings.weight")
    if emb is None:
        raise CheckpointError(f"checkpoint {path}: holds no model.tok_embeddings.weight; not a Llama checkpoint")
    return flavors[flavor].replace(vocab_size=int(emb.size[0]))


def dcp_to_hf(src: str | Path, out: str | Path, dtype: torch.dtype | None = None,
              max_shard_size: int = DEFAULT_MAX_SHARD_SIZE, flavor: str | None = None,
              tokenizer_path: str | None = None) -> Path:
    """Write the model of DCP checkpoint ``src`` as a Hugging Face folder ``out`` (of the family the
    recorded model arguments name), with the tokenizer files of ``tokenizer_path`` and
    generation_config.json (``trainer.hf.tokenizer_files``; "" = the byte-level tokenizer; None = no
    tokenizer files; a tokenizer that cannot be read any more is a warning: the weights are written).

    ``dtype``: of the written tensors (default: as stored). Reads one output shard's tensors at a
    time (``dcp.load`` of a subset of keys), so host memory stays near ``max_shard_size`` (at least
    one tensor: a MoE layer's stacked expert weight). The MoE layers' ``expert_bias`` is read to
    warn when it is not zero (``HFWriter``), not written.
    Raises CheckpointError (one line) when ``src`` is not a DCP checkpoint of its recorded model,
    HFCheckpointError when that model has no Hugging Face equivalent (before anything is written).
    """
    import torch.distributed.checkpoint as dcp

    path = resolve_step_folder(src, what="CHECKPOINT_DIR")
    try:
        verify_folder(path)
    except UnverifiedCheckpoint as exc:
        warnings.warn(f"{exc}; converting it unverified", stacklevel=2)
    except ManifestError as exc:
        raise CheckpointError(f"checkpoint {path} is damaged: {exc}") from None
    tensors = _model_tensors(path)
    args = _args_for(path, tensors, flavor)
    shapes = expected_shapes(args, buffers=True)
    params = expected_keys(args)
    missing = [k for k in params if k not in tensors]
    extra = sorted(set(tensors) - set(shapes))
    kind = spec_of(args).title
    if missing or extra:
        what = f"lacks model.{missing[0]}" if missing else f"has model.{extra[0]}, not a {kind} parameter"
        raise CheckpointError(f"checkpoint {path}: {what}; not a {kind} checkpoint of its recorded model arguments")
    keys = [k for k in shapes if k in tensors]  # parameters, and the expert_bias buffers it holds
    for k in keys:
        if tuple(tensors[k].size) != shapes[k]:
            raise CheckpointError(f"checkpoint {path}: model.{k} has shape {tuple(tensors[k].size)}, expected "
                                  f"{shapes[k]} from its model arguments")
    stored = {tensors[k].properties.dtype for k in params}
    out_dtype = dtype or (stored.pop() if len(stored) == 1 else torch.float32)
    writer = HFWriter(out, args, out_dtype, max_shard_size)
    # Groups of about one shard: load, convert, hand to the writer, free.
    group, group_bytes = [], 0
    for i, k in enumerate(keys):
        group.append(k)
        group_bytes += tensors[k].size.numel() * out_dtype.itemsize
        if group_bytes >= max_shard_size or i == len(keys) - 1:
            state = {"model": {g: torch.empty(tuple(tensors[g].size), dtype=tensors[g].properties.dtype)
                               for g in group}}
            # A local read (no collectives): export_hf runs this on rank 0 while the others wait.
            dcp.load(state, checkpoint_id=str(path), no_dist=True)
            writer.add_all((g, state["model"][g]) for g in group)
            group, group_bytes = [], 0
    writer.close()
    if tokenizer_path is not None and writer.adapter.tokenizer_files:
        try:
            write_tokenizer_files(out, tokenizer_path)
        except (ValueError, OSError) as exc:  # e.g. the run's tokenizer moved: the weights still count
            logger.warning("%s: the weights are written, the tokenizer files are not: %s", out, exc)
    return Path(out)


def hf_to_dcp(src: str | Path, out: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write the Hugging Face folder ``src`` (of any registered family) as a DCP checkpoint folder
    ``out`` (model + model_args; the MoE layers' ``expert_bias`` as stored, zero where Hugging Face has none).

    ``dtype``: of the written tensors (default: as stored; the bias stays float32). The folder is
    written as ``.<name>.partial`` and renamed when complete. Raises HFCheckpointError (one line)
    for a folder that is not such a checkpoint or whose tensors do not match its config.json.
    """
    import torch.distributed.checkpoint as dcp

    ckpt = HFCheckpoint(src)
    ckpt.check_names()
    sd = {}
    for k, shape in expected_shapes(ckpt.args, buffers=True).items():
        if k.endswith("feed_forward.expert_bias") and k not in ckpt.buffers:
            sd[k] = torch.zeros(shape, dtype=torch.float32)
            continue
        t = ckpt.our_tensor(k)
        sd[k] = t.to(dtype) if dtype is not None else t
    ckpt.close()
    out = Path(out)
    if (out / ".metadata").exists():
        raise CheckpointError(f"{out}: already holds a DCP checkpoint; choose another OUT_DIR")
    partial = out.with_name(f".{out.name}.partial")
    if partial.exists():
        shutil.rmtree(partial)
    dcp.save({"model": sd, "model_args": model_args_record(ckpt.args, ckpt.flavor)}, checkpoint_id=str(partial))
    write_manifest(partial, digest_files(partial, data_files(partial)))
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists() and not any(out.iterdir()):
        out.rmdir()
    partial.rename(out)
    return out
