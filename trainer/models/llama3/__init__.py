"""Llama 3 (``--model.name llama3``): the shared decoder with Meta's FFN sizing and Llama 3.1 rotary
scaling. ``args`` holds the hyperparameters and flavors, ``hf`` the Hugging Face ``LlamaForCausalLM``
adapter; the modules are ``trainer.models.common.decoder``'s."""
from trainer.models.llama3.args import LLAMA3_FLAVORS, Llama3Args
from trainer.registry import ModelSpec

SPEC = ModelSpec(
    name="llama3", title="Llama 3", args_cls=Llama3Args, flavors=LLAMA3_FLAVORS,
    description="Llama 3.1 / 3.2 (dense, GQA)",
    hf_adapter="trainer.models.llama3.hf:ADAPTER", hf_model_types=("llama",),
)
