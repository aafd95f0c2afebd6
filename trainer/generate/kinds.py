"""Which cache each attention layer gets, and installing them in a model for one generation.

``CACHE_KINDS`` is a list of rules, ``rule(module, state) -> cache or None``, first match wins: MLA
modules get the latent cache (``trainer.generate.mla_cache``); the shared ``Attention`` its kind from
its mask (``trainer.models.common.attention.layer_mask``): a chunk -> ``ChunkedCache``, a sliding window ->
``SlidingWindowCache``, else ``FullCache``. A family with an attention of its own adds its rule here.
"""
from __future__ import annotations

from typing import Callable

from trainer.generate.cache import CacheState, ChunkedCache, FullCache, SlidingWindowCache
from trainer.generate.mla_cache import MLACache
from trainer.models.deepseek_v3.attention import MLA


def _shared_kind(module, state: CacheState):
    """The shared ``Attention``'s kind from its mask (``trainer.models.common.attention.layer_mask``)."""
    mask = getattr(module, "mask", None)
    if mask is None:
        return None
    if mask.get("chunk_size"):
        return ChunkedCache(state, int(mask["chunk_size"]))
    left, right = mask.get("window_size", (-1, -1))
    if right not in (0, -1):
        raise ValueError(f"generation: a window reaching {right} tokens ahead cannot decode one token at a time")
    if left >= 0:
        return SlidingWindowCache(state, left + 1)
    return FullCache(state)


def _mla_kind(module, state: CacheState):
    return MLACache(state) if isinstance(module, MLA) else None


# Rules, first match wins: module -> a cache for it, or None. A family with its own attention kind
# appends (or prepends) its rule here; the shared kinds come last.
CACHE_KINDS: list[Callable] = [_mla_kind, _shared_kind]


def cache_kind(module, state: CacheState):
    """The cache of attention ``module`` for a generation with ``state``; ValueError if no rule takes it."""
    for rule in CACHE_KINDS:
        cache = rule(module, state)
        if cache is not None:
            return cache
    raise ValueError(f"generation: no KV cache kind for attention module {type(module).__name__}")


def attention_modules(model) -> list:
    """The attention modules of ``model``'s main layers (those holding a ``kv_cache`` attribute)."""
    return [layer.attention for layer in model.layers.values() if hasattr(layer.attention, "kv_cache")]


def install_caches(model, state: CacheState) -> list:
    """Give every attention layer of ``model`` its cache for ``state``; returns the caches."""
    caches = []
    for module in attention_modules(model):
        module.kv_cache = cache_kind(module, state)
        caches.append(module.kv_cache)
    return caches


def remove_caches(model) -> None:
    """Back to training behaviour: no attention layer keeps a cache."""
    for module in attention_modules(model):
        module.kv_cache = None
