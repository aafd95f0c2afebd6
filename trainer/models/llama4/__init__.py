"""Llama 4 (``--model.name llama4``): chunked-attention RoPE layers with QK norm and NoPE full-attention
layers with temperature tuning, top-1 sigmoid MoE with a shared expert interleaved with dense layers.
``args`` holds the hyperparameters and flavors, ``model`` its attention, block and model, ``hf`` the
Hugging Face ``Llama4ForCausalLM`` adapter."""
from trainer.models.llama4.args import LLAMA4_FLAVORS, Llama4Args
from trainer.registry import ModelSpec

SPEC = ModelSpec(
    name="llama4", title="Llama 4", args_cls=Llama4Args, flavors=LLAMA4_FLAVORS,
    description="Llama 4 Scout / Maverick text models (chunked + NoPE attention, top-1 MoE with a shared expert)",
    build="trainer.models.llama4.model:Llama4",
    hf_adapter="trainer.models.llama4.hf:ADAPTER", hf_model_types=("llama4_text", "llama4"),
)
