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

from typing import Any, List, Sequence

import torch

from kvbridge._core import InvalidArgumentError
from kvbridge._tensors import KVCache, cache_layers, check_kv, is_cache_object


def is_cache(obj: Any) -> bool:
    """True for a transformers Cache object (as opposed to a legacy tuple)."""
    return is_cache_object(obj)


def to_legacy(cache: Any) -> KVCache:
    """The legacy tuple ``((key, value), ...)`` of a DynamicCache, sharing its tensors (no copy).

    A legacy tuple or list passes through as a tuple of pairs. Empty layers, and sliding-window
    layers that have dropped tokens (see full_cache), raise kvbridge.InvalidArgumentError;
    anything else TypeError.
    """
    if is_cache_object(cache):
        return tuple(cache_layers(cache))
    return tuple(check_kv(cache))


def full_cache() -> Any:
    """An empty ``transformers.DynamicCache`` whose layers keep every token, sliding-window layers
    included. Prefill with it to get a cache kvbridge can store for any prompt length: the
    model's attention masks still apply its sliding windows, so its outputs are those of its own
    cache (tests/python/test_models.py checks it for Gemma 3 past its 512-token window)."""
    from transformers import DynamicCache

    return DynamicCache()


def to_dynamic_cache(legacy: Any, config: Any = None, windows: Sequence[int] = ()) -> Any:
    """A ``transformers.DynamicCache`` holding the legacy tuple's tensors (a DynamicCache is
    returned as is).

    config: the model's config, optional; DynamicCache uses it to pick each layer's type
        (sliding-window layers for Gemma 2/3, Mistral...).
    windows: without a config, each layer's sliding window, 0 for full attention
        (ModelSpec.layer_attention's ``sliding_window``); [] for all full.
    Full-attention layers hold every token; sliding-window layers hold the last window - 1
    tokens, as the model's own cache does (all a next forward attends to). The cache's layers
    hold their own tensors: generating with it never writes into `legacy`.
    """
    if is_cache_object(legacy):
        return legacy
    from transformers import DynamicCache

    pairs = check_kv(legacy)
    if config is None and any(windows):
        if len(windows) != len(pairs):
            raise InvalidArgumentError(f"windows: expected one per layer ({len(pairs)}), got {len(windows)}")
        return DynamicCache(ddp_cache_data=[(k, v, torch.tensor(w)) if w else (k, v)
                                            for (k, v), w in zip(pairs, windows)])
    return DynamicCache(ddp_cache_data=[(k, v) for k, v in pairs], config=config)


__all__: List[str] = ["full_cache", "is_cache", "to_dynamic_cache", "to_legacy"]
