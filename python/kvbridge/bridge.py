"""The Bridge: a model's own prompt cache, or another model's converted through an adapter."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Union

import torch

from kvbridge import _args, _core
from kvbridge._tensors import (KVCache, as_tokens, empty_kv, host_kv, kv_views,
                               legacy_to_cache)
from kvbridge.adapter import LinearAdapter
from kvbridge.store import KVStore


@dataclass(frozen=True)
class Load:
    """The result of Bridge.load.

    tokens: prompt tokens whose KV is returned (0 on a miss, at most len(tokens) - 1: the model
        always computes at least the last prompt token itself).
    kv: their KV cache (legacy tuple, or a transformers DynamicCache when asked for; batch 1,
        fresh tensors the caller owns), None on a miss.
    source: name of the model whose cache served it ("" on a miss).
    converted: True when any token was converted through an adapter.
    native_tokens: how many of `tokens` came from the model's own cache.
    quality: the adapter's quality when converted (see Bridge), else NaN.
    converted_from, adapter: fingerprints of the source model and of the adapter behind the
        tokens that are not the model's own prefill: set for a conversion, and also for a native
        hit on entries an earlier conversion wrote back (converted is False then); "" when every
        token is the model's own KV.
    """

    tokens: int
    kv: Optional[KVCache]
    source: str
    converted: bool
    native_tokens: int
    quality: float
    converted_from: str = ""
    adapter: str = ""


class Bridge:
    """Saves prompt KV caches and loads the longest usable prefix for a model.

    load() returns the model's own cached prefix, or, when another model sharing its tokenizer
    has a strictly longer one and an adapter from it is registered, that prefix converted (only
    the tokens past the native prefix are converted) and written back as the model's own entry,
    so the next load is a native hit. An adapter's quality is the minimum held-out R² over every
    target layer's key and value maps of its fit report; adapters under `min_quality` may be
    registered but are never used (stats()["adapters_skipped_quality"] counts each pass-over).

    store: the KVStore to use (kept alive by the bridge).
    min_quality: quality floor for adapters; float("-inf") disables the gate.
    write_back: store converted prefixes as the target's own entries.
    Thread-safe.
    """

    def __init__(self, store: KVStore, min_quality: float = 0.5, write_back: bool = True):
        if not isinstance(store, KVStore):
            raise TypeError(f"store: expected a kvbridge.KVStore, got {type(store).__name__}")
        self._store = store
        self._native = _core.Bridge(store._store, _args.number("min_quality", min_quality),
                                    _args.flag("write_back", write_back))

    @property
    def store(self) -> KVStore:
        return self._store

    @property
    def min_quality(self) -> float:
        return self._native.min_quality

    @property
    def write_back(self) -> bool:
        return self._native.write_back

    def add_adapter(self, adapter: LinearAdapter, replace: bool = False) -> None:
        """Registers adapter.source -> adapter.target.

        Raises ValueError when source and target are the same model, when their tokenizer ids
        differ or are empty, or when the pair is already registered and `replace` is False.
        Replacing an adapter by a different one purges what the old one wrote back.
        """
        if not isinstance(adapter, LinearAdapter):
            raise TypeError("adapter: expected a kvbridge.LinearAdapter, got "
                            f"{type(adapter).__name__}")
        self._native.add_adapter(adapter._native, _args.flag("replace", replace))

    def remove_adapter(self, source: _core.ModelSpec, target: _core.ModelSpec) -> bool:
        """Unregisters the adapter source -> target and purges the entries it wrote back (see
        invalidate_adapter); False if there was none."""
        return self._native.remove_adapter(source, target)

    def invalidate_adapter(self, adapter: LinearAdapter) -> dict:
        """Removes every entry `adapter` wrote back into the store, in every tier (the target's
        own entries stay); add_adapter(replace=True) and remove_adapter do it for the adapter
        they drop. Returns {"memory": n, "disk": n, "redis": n, "redis_complete": bool}."""
        if not isinstance(adapter, LinearAdapter):
            raise TypeError("adapter: expected a kvbridge.LinearAdapter, got "
                            f"{type(adapter).__name__}")
        return self._native.invalidate_adapter(adapter._native)

    def adapters(self) -> List[LinearAdapter]:
        """The registered adapters, in registration order."""
        return [LinearAdapter(a) for a in self._native.adapters()]

    @staticmethod
    def quality(adapter: LinearAdapter) -> float:
        """Minimum held-out R² over every target layer's K and V maps (what min_quality gates)."""
        return _core.Bridge.quality(adapter._native)

    def save(self, spec: _core.ModelSpec, tokens: Any, kv: KVCache,
             namespace: str = "default") -> int:
        """Stores the model's KV for `tokens` (as KVStore.put: a legacy tuple or a DynamicCache);
        returns the tokens now cached."""
        ids = as_tokens(tokens)
        pairs = host_kv(kv)
        keys, values = kv_views(pairs)
        return self._native.save(spec, ids, keys, values, _args.text("namespace", namespace))

    def load(self, spec: _core.ModelSpec, tokens: Any, namespace: str = "default", *,
             return_kv: bool = True,
             device: Union[str, torch.device, None] = None, as_cache: bool = False) -> Load:
        """The longest usable prefix of `tokens` for `spec` (see the class docstring).

        Empty and one-token prompts are misses. return_kv=False reports the length only (a
        conversion, if one is needed, still runs and is written back). device: where the returned
        tensors live (default: CPU). as_cache: return the KV as a transformers DynamicCache.
        """
        ids = as_tokens(tokens)
        found = self._native.load(spec, ids, _args.text("namespace", namespace))
        kv = None
        if found.tokens and return_kv:
            kv = empty_kv(spec, found.tokens)
            keys, values = kv_views(kv)
            found.copy_to(keys, values)
            if device is not None and torch.device(device).type != "cpu":
                kv = tuple((k.to(device), v.to(device)) for k, v in kv)
            if as_cache:
                kv = legacy_to_cache(kv)
        return Load(found.tokens, kv, found.source, found.converted, found.native_tokens,
                    found.quality, found.converted_from, found.adapter)

    def stats(self) -> dict:
        """Counters and times: see BridgeStats in include/kvbridge/bridge.h."""
        return self._native.stats()

    def metrics(self) -> str:
        """The stats in Prometheus text format (kvbridge_bridge_* families)."""
        return self._native.prometheus_text()

    prometheus_text = metrics


__all__: List[str] = ["Bridge", "Load"]
