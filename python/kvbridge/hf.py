"""Hugging Face transformers caches: DynamicCache <-> kvbridge's legacy tuple form.

transformers (5.x) models take and return ``transformers.DynamicCache`` objects (one layer per
decoder layer, each holding ``keys`` and ``values`` of shape ``[batch, kv_heads, tokens,
head_dim]``); kvbridge's native form is the legacy tuple ``((key, value), ...)`` of the same
tensors. Every kvbridge entry point that takes a KV cache (``LinearAdapter.convert``,
``AdapterFitter.add``, ``KVStore.put``, ``Bridge.save``) accepts either form; the ones that
return a cache give a DynamicCache when asked (``as_cache=True``; ``convert`` returns the
input's form by default).

transformers is imported only when a DynamicCache has to be built.
"""
from __future__ import annotations

from typing import Any, List

from kvbridge._tensors import KVCache, cache_layers, check_kv, is_cache_object


def is_cache(obj: Any) -> bool:
    """True for a transformers Cache object (as opposed to a legacy tuple)."""
    return is_cache_object(obj)


def to_legacy(cache: Any) -> KVCache:
    """The legacy tuple ``((key, value), ...)`` of a DynamicCache, sharing its tensors (no copy).

    A legacy tuple or list passes through as a tuple of pairs. Sliding-window and empty layers
    raise kvbridge.InvalidArgumentError; anything else TypeError.
    """
    if is_cache_object(cache):
        return tuple(cache_layers(cache))
    return tuple(check_kv(cache))


def to_dynamic_cache(legacy: Any, config: Any = None) -> Any:
    """A ``transformers.DynamicCache`` holding the legacy tuple's tensors (a DynamicCache is
    returned as is).

    config: the model's config, optional; DynamicCache uses it to pick each layer's type (all
        full-attention ``DynamicLayer`` for the models kvbridge supports).
    The cache's layers hold their own tensors: generating with it never writes into `legacy`.
    """
    if is_cache_object(legacy):
        return legacy
    from transformers import DynamicCache

    pairs = check_kv(legacy)
    return DynamicCache(ddp_cache_data=[(k, v) for k, v in pairs], config=config)


__all__: List[str] = ["is_cache", "to_dynamic_cache", "to_legacy"]
