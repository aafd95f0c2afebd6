"""DeepSeek-V3 and Kimi K2 (``--model.name deepseek_v3``): multi-head latent attention, DeepSeekMoE
routing and multi-token prediction on the shared decoder. ``args`` holds the hyperparameters and
flavors, ``attention`` the MLA module, ``model`` the blocks, the model and its MTP modules, ``hf``
the Hugging Face ``DeepseekV3ForCausalLM`` adapter."""
from trainer.models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS, DeepSeekV3Args
from trainer.registry import ModelSpec

SPEC = ModelSpec(
    name="deepseek_v3", title="DeepSeek-V3", args_cls=DeepSeekV3Args, flavors=DEEPSEEK_V3_FLAVORS,
    description="DeepSeek-V3 / Kimi K2 (MLA, DeepSeekMoE, multi-token prediction)",
    build="trainer.models.deepseek_v3.model:DeepSeekV3",
    hf_adapter="trainer.models.deepseek_v3.hf:ADAPTER", hf_model_types=("deepseek_v3", "kimi_k2"),
)
