"""Hugging Face checkpoints of every registered family: read and write folders of safetensors
shards + config.json.

A Hugging Face folder (as ``save_pretrained`` writes it) holds
  config.json                        model_type (e.g. "llama", "qwen3", "qwen3_moe", "deepseek_v3"), sizes...
  model.safetensors                  the weights, when they fit one shard; else
  model-0000k-of-0000n.safetensors   shards, and
  model.safetensors.index.json       {"metadata": {"total_size": bytes}, "weight_map": {name: shard file}}
Names and layouts differ from ours; each family's adapter (``trainer/models/<family>/hf.py``, an
``trainer.hf.adapter.HFAdapter``) maps them: config.json <-> args, our names <-> Hugging Face's, the
rotary row permutation of Meta's interleaved pairs to rotate-half halves, and the routed experts
(ours stacked (E, in, out), Hugging Face's one (out, in) matrix per expert). A family without a
stored load-balancing bias imports a zero ``expert_bias`` and warns on export when it was not zero.

Reading never loads the whole model: ``HFCheckpoint.tensor`` reads one tensor from its shard
(safetensors maps the file), and ``load_into_model`` copies parameter by parameter into a model of
any parallel layout (each rank keeps its shard of every DTensor parameter, as ``init_weights`` does).
Writing streams too: ``HFWriter`` takes tensors in order and closes a shard once it holds
``max_shard_size`` bytes.

Modules: ``common`` (file names, the error, shared config.json fields), ``compare`` (whether two
models' arguments are the same model), ``adapter`` (the families' common mapping), ``mapping``
(dispatch to a family through ``trainer.registry``: config, names, shapes, state dicts),
``folder`` (reading and writing the safetensors folder). Every public name of those is importable
from here. ``convert`` (our DCP checkpoints <-> Hugging Face folders: ``dcp_to_hf``, ``hf_to_dcp``)
stands on the checkpoint modules too, and is imported as ``trainer.checkpoint.hf_convert``.

Errors: ``HFCheckpointError`` (a ValueError) with a one-line message naming the folder and what is
wrong (no config.json, a model_type no family reads, a field we cannot reproduce exactly; a missing
tensor, a shape that does not match the config or the run's flavor).
"""

from __future__ import annotations

from trainer.hf.common import CONFIG, DEFAULT_MAX_SHARD_SIZE, INDEX, SINGLE, HFCheckpointError, model_types
from trainer.hf.compare import check_compatible, differences
from trainer.hf.folder import HFCheckpoint, HFWriter, custom_model_args, load_into_model, parse_size
from trainer.hf.mapping import (
    adapter_of,
    args_from_hf_config,
    expected_keys,
    expected_shape,
    expected_shapes,
    from_hf_state_dict,
    hf_config,
    hf_names,
    to_hf_state_dict,
)

__all__ = [
    "CONFIG", "DEFAULT_MAX_SHARD_SIZE", "INDEX", "SINGLE", "HFCheckpoint", "HFCheckpointError",
    "HFWriter", "adapter_of", "custom_model_args", "args_from_hf_config", "check_compatible", "differences", "expected_keys",
    "expected_shape", "expected_shapes", "from_hf_state_dict", "hf_config", "hf_names", "load_into_model",
    "model_types", "parse_size", "to_hf_state_dict",
]
