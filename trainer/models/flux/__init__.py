"""Flux (``--model.name flux``): Black Forest Labs' FLUX.1 rectified-flow MMDiT. ``args`` holds the
hyperparameters and flavors, ``layers`` and ``model`` the transformer, ``hf`` the diffusers
``FluxTransformer2DModel`` adapter."""
from trainer.models.flux.args import FLUX_FLAVORS, FluxArgs
from trainer.registry import ModelSpec

SPEC = ModelSpec(
    name="flux", title="Flux", args_cls=FluxArgs, flavors=FLUX_FLAVORS,
    description="Black Forest Labs FLUX.1 (rectified-flow MMDiT over T5 + CLIP text encodings)",
    build="trainer.models.flux.model:FluxTransformer",
    hf_adapter="trainer.models.flux.hf:ADAPTER", hf_model_types=("FluxTransformer2DModel",),
    parallelize="trainer.models.flux.parallelize:parallelize_flux",
    task="trainer.models.flux.task:FluxTask",
    generate="trainer.models.flux.sample:generate_main",
)
