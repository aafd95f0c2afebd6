"""GPT-OSS (``--model.name gpt_oss``): the shared decoder with alternating sliding-window and full
attention layers, attention sinks and biases, YaRN rotary, and experts with biases and the clamped
SwiGLU. ``args`` holds the hyperparameters and flavors, ``hf`` the Hugging Face ``GptOssForCausalLM``
adapter; the modules are ``trainer.models.common.decoder``'s."""
from trainer.models.gpt_oss.args import GPT_OSS_FLAVORS, GptOssArgs
from trainer.registry import ModelSpec

SPEC = ModelSpec(
    name="gpt_oss", title="GPT-OSS", args_cls=GptOssArgs, flavors=GPT_OSS_FLAVORS,
    description="OpenAI gpt-oss (sliding/full attention with sinks, MoE with biases and the clamped SwiGLU)",
    hf_adapter="trainer.models.gpt_oss.hf:ADAPTER", hf_model_types=("gpt_oss",),
)
