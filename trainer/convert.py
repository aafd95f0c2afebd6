"""Convert checkpoints between our DCP format and Hugging Face folders, for every registered family
(Llama 3, Qwen3 / Qwen3-MoE, DeepSeek-V3, ...; ``trainer.registry``).

    python -m trainer.convert dcp-to-hf CHECKPOINT_DIR OUT_DIR [--dtype bfloat16] [--max_shard_size 5GB]
                                     [--tokenizer_path PATH]
    python -m trainer.convert hf-to-dcp HF_DIR OUT_DIR [--dtype bfloat16]

CHECKPOINT_DIR is a DCP step folder (``step-<N>``, ``weights-step-<N>``; anything holding
``.metadata``) or a checkpoint folder (its newest complete step). Only the model weights are
converted; the model arguments come from the checkpoint itself (``model_args``, recorded by every
save), so no flavor is needed (``--flavor`` names one for checkpoints older than that record).
The output of dcp-to-hf loads with ``transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)``
(the family's class, e.g. ``LlamaForCausalLM``) and, given ``--tokenizer_path`` (the run's
``--model.tokenizer_path``; '' = the byte-level tokenizer), with ``AutoTokenizer`` too: the
tokenizer files and generation_config.json go beside the weights (``trainer.hf.tokenizer_files``);
the output of hf-to-dcp is a DCP folder for
``--checkpoint.initial_load_path`` (or, placed as ``<dump_folder>/checkpoint/step-0``, a seed
checkpoint), its MoE layers' ``expert_bias`` as the folder stores it (zero where it does not). A
MoE checkpoint trained with the auxiliary-loss-free balancing bias exports with a warning when the
family's Hugging Face model routes without the bias (Qwen3-MoE; ``trainer.hf``).

Verification: dcp-to-hf first checks every file of the checkpoint against its ``manifest.json``
(size and checksum, ``trainer.checkpoint.manifest``); a damaged file is a one-line error naming it,
and a checkpoint without a manifest (written before manifests existed) converts with a warning.
hf-to-dcp writes a manifest into its output.

Memory: dcp-to-hf reads one output shard at a time; hf-to-dcp holds the whole model (one copy, in
the output dtype), as ``dcp.save`` writes all tensors of a checkpoint at once.
The conversions themselves are ``trainer.checkpoint.hf_convert``; this module is their command line.
Exit codes: 0 done; 1 the input is not a usable checkpoint, or a model Hugging Face cannot express
(e.g. a MoE with shared experts): a one-line message.
"""
from __future__ import annotations

import argparse
import sys
import warnings

import torch

from trainer.checkpoint.folder import CheckpointError, read_model_args
from trainer.hf import parse_size
from trainer.checkpoint.hf_convert import dcp_to_hf, hf_to_dcp

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    a.add_argument("--tokenizer_path", default=None,
                   help="the run's --model.tokenizer_path, shipped beside the weights ('' = the byte-level "
                        "tokenizer; default: none, the folder then has no tokenizer files)")
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
            if ns.tokenizer_path is not None:  # a bad tokenizer fails before any weights are written
                from trainer.data import build_tokenizer

                try:
                    build_tokenizer(ns.tokenizer_path or None)
                except ValueError as exc:
                    raise ValueError(str(exc).replace("model.tokenizer_path", "--tokenizer_path", 1)) from None
            out = dcp_to_hf(ns.checkpoint_dir, ns.out_dir, dtype, size, ns.flavor, ns.tokenizer_path)
            files = sorted(p.name for p in out.iterdir())
            print(f"wrote {out}: {', '.join(files)}")
            if ns.tokenizer_path is None:
                print(f"note: no --tokenizer_path, so {out} holds no tokenizer files and AutoTokenizer cannot load "
                      f"it; pass the run's --model.tokenizer_path ('' for the built-in byte-level tokenizer)")
        else:
            out = hf_to_dcp(ns.hf_dir, ns.out_dir, dtype)
            _, flavor = read_model_args(out)
            print(f"wrote DCP checkpoint {out} (flavor {flavor})")
    except (CheckpointError, ValueError) as exc:  # HFCheckpointError, a bad --tokenizer_path
        print(f"python -m trainer.convert: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
