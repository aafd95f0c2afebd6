"""Convert checkpoints between our DCP format and Hugging Face folders, for every registered family
(Llama 3, Qwen3 / Qwen3-MoE, DeepSeek-V3, ...; ``trainer.models.registry``).

    python -m trainer.convert dcp-to-hf CHECKPOINT_DIR OUT_DIR [--dtype bfloat16] [--max_shard_size 5GB]
    python -m trainer.convert hf-to-dcp HF_DIR OUT_DIR [--dtype bfloat16]

CHECKPOINT_DIR is a DCP step folder (``step-<N>``, ``weights-step-<N>``; anything holding
``.metadata``) or a checkpoint folder (its newest complete step). Only the model weights are
converted; the model arguments come from the checkpoint itself (``model_args``, recorded by every
save), so no flavor is needed (``--flavor`` names one for checkpoints older than that record).
The output of dcp-to-hf loads with ``transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)``
(the family's class, e.g. ``LlamaForCausalLM``); the output of hf-to-dcp is a DCP folder for
``--checkpoint.initial_load_path`` (or, placed as ``<dump_folder>/checkpoint/step-0``, a seed
checkpoint), its MoE layers' ``expert_bias`` as the folder stores it (zero where it does not). A
MoE checkpoint trained with the auxiliary-loss-free balancing bias exports with a warning when the
family's Hugging Face model routes without the bias (Qwen3-MoE; ``trainer.hf``).

Verification: dcp-to-hf first checks every file of the checkpoint against its ``manifest.json``
(size and checksum, ``trainer.checkpoint_manifest``); a damaged file is a one-line error naming it,
and a checkpoint without a manifest (written before manifests existed) converts with a warning.
hf-to-dcp writes a manifest into its output.

Memory: dcp-to-hf reads one output shard at a time; hf-to-dcp holds the whole model (one copy, in
the output dtype), as ``dcp.save`` writes all tensors of a checkpoint at once.
Exit codes: 0 done; 1 the input is not a usable checkpoint, or a model Hugging Face cannot express
(e.g. a MoE with shared experts): a one-line message.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import warnings
from pathlib import Path

import torch

from trainer.checkpoint import CheckpointError, read_model_args, resolve_step_folder
from trainer.checkpoint_manifest import ManifestError, UnverifiedCheckpoint, data_files, digest_files, verify_folder
from trainer.checkpoint_manifest import write_manifest
from trainer.hf import (
    DEFAULT_MAX_SHARD_SIZE,
    HFCheckpoint,
    HFCheckpointError,
    HFWriter,
    expected_keys,
    expected_shapes,
    parse_size,
)
from trainer.models.registry import get as _family
from trainer.models.registry import spec_of

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
              max_shard_size: int = DEFAULT_MAX_SHARD_SIZE, flavor: str | None = None) -> Path:
    """Write the model of DCP checkpoint ``src`` as a Hugging Face folder ``out`` (of the family the
    recorded model arguments name).

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
    return writer.close()


def hf_to_dcp(src: str | Path, out: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write the Hugging Face folder ``src`` (of any registered family) as a DCP checkpoint folder
    ``out`` (model + model_args; the MoE layers' ``expert_bias`` as stored, zero where Hugging Face has none).

    ``dtype``: of the written tensors (default: as stored; the bias stays float32). The folder is
    written as ``.<name>.partial`` and renamed when complete. Raises HFCheckpointError (one line)
    for a folder that is not such a checkpoint or whose tensors do not match its config.json.
    """
    import torch.distributed.checkpoint as dcp

    from trainer.checkpoint import model_args_record

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.convert",
        description="Convert checkpoints between DCP and Hugging Face folders (every registered model family).")
    sub = parser.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("dcp-to-hf", help="DCP checkpoint -> Hugging Face folder (safetensors shards + config.json)")
    a.add_argument("checkpoint_dir", help="a step-<N> folder or a checkpoint folder (its newest step)")
    a.add_argument("out_dir")
    a.add_argument("--dtype", choices=tuple(_DTYPES), default=None, help="tensor dtype (default: as stored)")
    a.add_argument("--max_shard_size", default="5GB", help="largest shard file, e.g. 5GB, 500MB (default 5GB)")
    a.add_argument("--flavor", default=None,
                   help="only for a (Llama 3) checkpoint that does not record its model arguments")
    b = sub.add_parser("hf-to-dcp", help="Hugging Face Llama / Qwen3 folder -> DCP checkpoint folder")
    b.add_argument("hf_dir")
    b.add_argument("out_dir")
    b.add_argument("--dtype", choices=tuple(_DTYPES), default=None, help="tensor dtype (default: as stored)")
    ns = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    dtype = _DTYPES[ns.dtype] if ns.dtype else None
    try:
        if ns.cmd == "dcp-to-hf":
            try:
                size = parse_size(ns.max_shard_size)
            except ValueError as exc:
                parser.error(str(exc))
            out = dcp_to_hf(ns.checkpoint_dir, ns.out_dir, dtype, size, ns.flavor)
            files = sorted(p.name for p in out.iterdir())
            print(f"wrote {out}: {', '.join(files)}")
        else:
            out = hf_to_dcp(ns.hf_dir, ns.out_dir, dtype)
            _, flavor = read_model_args(out)
            print(f"wrote DCP checkpoint {out} (flavor {flavor})")
    except (CheckpointError, HFCheckpointError) as exc:
        print(f"python -m trainer.convert: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
