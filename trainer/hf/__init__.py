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

Modules: ``common`` (file names, the error, shared config.json fields), ``compare`` (whether two
models' arguments are the same model), ``llama`` and ``qwen3`` (each family's config.json; Qwen3-MoE's
expert tensor shapes), ``mapping`` (the per-family dispatch: config, names, shapes, state dicts),
``folder`` (reading and writing the safetensors folder). Every public name is importable from here.

Errors: ``HFCheckpointError`` (a ValueError) with a one-line message naming the folder and what is
wrong (no config.json, not a Llama or Qwen3, unsupported options such as biases, sliding-window
attention, Qwen3-MoE's decoder_sparse_step != 1 or non-prefix mlp_only_layers, shared experts on
export; a missing tensor, a shape that does not match the config or the run's flavor).
"""

from __future__ import annotations

from trainer.hf.common import CONFIG, DEFAULT_MAX_SHARD_SIZE, INDEX, MODEL_TYPES, SINGLE, HFCheckpointError
from trainer.hf.compare import check_compatible, differences
from trainer.hf.folder import HFCheckpoint, HFWriter, load_into_model, parse_size
from trainer.hf.mapping import (
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
    "CONFIG", "DEFAULT_MAX_SHARD_SIZE", "INDEX", "MODEL_TYPES", "SINGLE", "HFCheckpoint", "HFCheckpointError",
    "HFWriter", "args_from_hf_config", "check_compatible", "differences", "expected_keys", "expected_shape",
    "expected_shapes", "from_hf_state_dict", "hf_config", "hf_names", "load_into_model", "parse_size",
    "to_hf_state_dict",
]
