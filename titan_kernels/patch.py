"""Swap PyTorch / Hugging Face RMSNorm modules in an existing model for ``titan_kernels.nn.RMSNorm``."""
from __future__ import annotations

import torch
from torch import nn

from titan_kernels.nn import RMSNorm


def _is_hf_rms_norm(module: nn.Module) -> bool:
    # Hugging Face models define their own *RMSNorm classes (LlamaRMSNorm, Qwen2RMSNorm, ...) with a
    # `weight` of shape (hidden,) and `variance_epsilon`, computing x * rsqrt(mean(x^2) + eps) * weight.
    return (
        type(module).__name__.endswith("RMSNorm")
        and not isinstance(module, RMSNorm)
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and getattr(module, "weight").dim() == 1
        and isinstance(getattr(module, "variance_epsilon", None), (int, float))
    )


def _convert(module: nn.Module) -> RMSNorm | None:
    if isinstance(module, RMSNorm):
        return None
    if isinstance(module, nn.RMSNorm):
        if len(module.normalized_shape) != 1:
            return None  # normalization over several dims is not fused; leave it to PyTorch
        weight = module.weight
        new = RMSNorm(module.normalized_shape, eps=module.eps, elementwise_affine=weight is not None, device="meta")
    elif _is_hf_rms_norm(module):
        weight = module.weight
        new = RMSNorm(weight.shape[0], eps=float(module.variance_epsilon), device="meta")
    else:
        return None
    if weight is not None:
        new.weight = weight  # the same Parameter object: optimizer state and sharding stay valid
    return new


def patch(model: nn.Module) -> int:
    """Replace every ``torch.nn.RMSNorm`` (over the last dim) and Hugging Face ``*RMSNorm`` in ``model``
    in place with ``titan_kernels.nn.RMSNorm``, keeping the same weight Parameters.

    Returns the number of modules replaced. A model that *is* an RMSNorm cannot be replaced in place:
    use ``titan_kernels.nn.RMSNorm`` directly (raises ValueError); a non-module raises TypeError.

    Note: a Hugging Face norm computes in float32 and casts back, as ours does; the output is the
    same to rounding.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    if _convert(model) is not None:
        raise ValueError("model: is itself an RMSNorm; build titan_kernels.nn.RMSNorm instead of patching")
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = _convert(child)
            if new is not None:
                setattr(parent, name, new)
                count += 1
    return count
