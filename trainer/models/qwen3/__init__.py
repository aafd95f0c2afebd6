"""Qwen3 dense and MoE (``--model.name qwen3``): the shared decoder with QK-norm, its own head_dim
and MoE feed-forwards. ``args`` holds the hyperparameters and flavors, ``hf`` the Hugging Face
``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` adapter; the modules are ``trainer.models.common.decoder``'s."""
from trainer.models.qwen3.args import QWEN3_FLAVORS, Qwen3Args
from trainer.registry import ModelSpec

SPEC = ModelSpec(
    name="qwen3", title="Qwen3", args_cls=Qwen3Args, flavors=QWEN3_FLAVORS,
    description="Qwen3 dense and mixture-of-experts (QK-norm)",
    hf_adapter="trainer.models.qwen3.hf:ADAPTER", hf_model_types=("qwen3", "qwen3_moe"),
)
