"""Our model <-> a Hugging Face model, for any registered family: the config.json, our parameter names
and shapes, the Hugging Face tensors holding each, and whole state dicts.

Each call finds the family in ``trainer.registry`` (by the args' class, or by config.json's
``model_type``) and hands over to its adapter (``trainer.hf.adapter.HFAdapter``). Our parameter
names and shapes are those of the family's model built on the meta device (no memory), so they are
exactly the model's, whatever the family.
"""
from __future__ import annotations

import torch

from trainer.hf.common import CONFIG, HFCheckpointError, model_types
from trainer.hf.defaults import complete_config
from trainer import registry

# ------------------------------------------------------------------------------------------------
# config.json <-> args


def adapter_of(args):
    """The Hugging Face adapter of ``args``'s family; raises HFCheckpointError if it has none."""
    try:
        return registry.spec_of(args).adapter()
    except ValueError as exc:
        raise HFCheckpointError(str(exc)) from None


def hf_config(args, dtype: torch.dtype = torch.float32) -> dict:
    """The ``config.json`` of the Hugging Face model equal to our model ``args`` (the family's
    adapter). Raises HFCheckpointError for a model the Hugging Face classes cannot express."""
    return adapter_of(args).config(args, dtype)


def args_from_hf_config(cfg: dict, where: str = CONFIG):
    """Our model args for a Hugging Face ``config.json`` dict, and the flavor they match ("custom" if
    none), from the family whose adapter reads its ``model_type``.

    Fields the config leaves out take transformers' defaults for its model_type, and a value of the
    wrong type is refused naming the field (``trainer.hf.defaults.complete_config``).

    Raises HFCheckpointError for a model_type no family reads, or options the family does not have.
    """
    # transformers names the family in model_type, diffusers in _class_name (e.g. FluxTransformer2DModel)
    model_type = cfg.get("model_type") or cfg.get("_class_name")
    spec = registry.for_hf_model_type(model_type) if isinstance(model_type, str) else None
    if spec is None:
        archs = cfg.get("architectures") or []
        raise HFCheckpointError(f"{where}: not a checkpoint of a family we train (model_type {model_type!r}, "
                                f"architectures {archs}; supported: {', '.join(model_types())})")
    return spec.adapter().args_from_config(complete_config(cfg, where), where)


# ------------------------------------------------------------------------------------------------
# our parameter names and shapes, and their Hugging Face names

_SHAPES: dict[str, dict[str, tuple[int, ...]]] = {}


def expected_shapes(args, buffers: bool = False) -> dict[str, tuple[int, ...]]:
    """Our parameter names -> shapes for ``args``, in module order (the family's model built on the
    meta device). ``buffers``: also the persistent buffers (the MoE layers'
    ``feed_forward.expert_bias`` (E,)), which DCP checkpoints hold."""
    key = f"{registry.family_of(args)}:{buffers}:{args!r}"
    if key not in _SHAPES:
        model = registry.build_model(args, "meta")
        out = {name: tuple(p.shape) for name, p in model.named_parameters()}
        if buffers:
            persistent = {name for name, _ in model.state_dict(keep_vars=True).items()}
            out.update({name: tuple(b.shape) for name, b in model.named_buffers() if name in persistent})
        if len(_SHAPES) > 32:
            _SHAPES.clear()
        _SHAPES[key] = out
    return dict(_SHAPES[key])


def expected_keys(args) -> list[str]:
    """Our parameter names for ``args``, in module order."""
    return list(expected_shapes(args))


def expected_shape(args, key: str) -> tuple[int, ...]:
    """The shape of our parameter (or buffer) ``key`` for ``args``. Raises KeyError for another name."""
    return expected_shapes(args, buffers=True)[key]


def hf_names(args, key: str, fused: bool = False) -> list[str]:
    """The Hugging Face tensors holding our parameter ``key``: one, or for a routed expert weight E
    per-expert matrices (``fused``: transformers' one fused tensor); none for a buffer Hugging Face
    does not store. Raises KeyError for a key with no counterpart."""
    return adapter_of(args).hf_names(args, key, fused)


def to_hf_state_dict(state_dict: dict[str, torch.Tensor], args) -> dict[str, torch.Tensor]:
    """Our (full) state dict -> Hugging Face names and layout."""
    return adapter_of(args).to_hf(state_dict, args)


def from_hf_state_dict(state_dict: dict[str, torch.Tensor], args) -> dict[str, torch.Tensor]:
    """Hugging Face names and layout -> ours."""
    return adapter_of(args).from_hf(state_dict, args)
