"""The Bridge: a model's own prompt cache, or another model's converted through an adapter."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Union

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
    recompute_tail: prompt tokens before the last one that a converted load leaves for the model
        to compute itself over the converted prefix (a converted load holds at most
        len(tokens) - 1 - recompute_tail tokens; native prefixes are not cut). Default 0.
    exact_layers: when load() is given the target `model`, the first exact_layers layers of a
        load with converted tokens are the model's own KV (kvbridge.exact) instead of converted
        ones. Default 0.
    min_agreement, check_window, min_checks: the fallback floor (see kvbridge.monitor): an
        adapter whose pooled top-1 agreement over its last `check_window` quality checks is
        below `min_agreement`, once it has `min_checks` of them, is disabled (loads stop
        converting with it) and what it wrote back is purged; enable_adapter() re-enables it.
        add_adapter() with the models probes an adapter against the same floor. Defaults 0.8,
        32, 8; min_agreement=float("-inf") never disables.
    Thread-safe.
    """

    def __init__(self, store: KVStore, min_quality: float = 0.5, write_back: bool = True, *,
                 recompute_tail: int = 0, exact_layers: int = 0, min_agreement: float = 0.8,
                 check_window: int = 32, min_checks: int = 8):
        if not isinstance(store, KVStore):
            raise TypeError(f"store: expected a kvbridge.KVStore, got {type(store).__name__}")
        self._store = store
        self._exact_layers = _args.size("exact_layers", exact_layers)
        self._native = _core.Bridge(store._store, _args.number("min_quality", min_quality),
                                    _args.flag("write_back", write_back),
                                    _args.size("recompute_tail", recompute_tail),
                                    _args.number("min_agreement", min_agreement),
                                    _args.size("check_window", check_window),
                                    _args.size("min_checks", min_checks))

    @property
    def store(self) -> KVStore:
        return self._store

    @property
    def min_quality(self) -> float:
        return self._native.min_quality

    @property
    def write_back(self) -> bool:
        return self._native.write_back

    @property
    def recompute_tail(self) -> int:
        return self._native.recompute_tail

    @property
    def exact_layers(self) -> int:
        return self._exact_layers

    @property
    def min_agreement(self) -> float:
        return self._native.min_agreement

    @property
    def check_window(self) -> int:
        return self._native.check_window

    @property
    def min_checks(self) -> int:
        return self._native.min_checks

    def add_adapter(self, adapter: LinearAdapter, replace: bool = False, *,
                    source_model: Any = None, target_model: Any = None,
                    probe: Optional[Sequence[Sequence[int]]] = None) -> None:
        """Registers adapter.source -> adapter.target.

        Raises ValueError when source and target are the same model, when their tokenizer ids
        differ or are empty, or when the pair is already registered and `replace` is False.
        Replacing an adapter by a different one purges what the old one wrote back.

        source_model, target_model: the two models (Hugging Face causal LMs). Given both, the
        adapter is first probed (kvbridge.monitor.probe_adapter: prompts sampled from the source
        model with a fixed seed, or `probe`, lists of token ids) and refused with
        kvbridge.monitor.AdapterQualityError (a ValueError) when the target's top-1 agreement
        after the converted cache is below min_agreement; nothing is registered then.
        """
        if not isinstance(adapter, LinearAdapter):
            raise TypeError("adapter: expected a kvbridge.LinearAdapter, got "
                            f"{type(adapter).__name__}")
        replace = _args.flag("replace", replace)
        if (source_model is None) != (target_model is None):
            raise TypeError("add_adapter: the probe needs both source_model and target_model")
        if source_model is not None:
            from kvbridge import monitor

            monitor.require_quality(self, adapter, source_model, target_model, probe)
        self._native.add_adapter(adapter._native, replace)

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

    def record_check(self, adapter: Union[LinearAdapter, str], check: Any) -> bool:
        """Records a quality check (a kvbridge.monitor.Check) of the registered adapter (or its
        fingerprint); True when it disabled the adapter. kvbridge.NotFoundError if the adapter
        is not registered; InvalidArgumentError for a check out of range."""
        return self._native.record_check(_fingerprint(adapter), _args.size("positions",
                                         check.positions), _args.size("agreed", check.agreed),
                                         _args.number("kl_sum", check.kl_sum),
                                         _args.size("loss_positions", check.loss_positions),
                                         _args.number("loss_gap_sum", check.loss_gap_sum))

    def disable_adapter(self, adapter: Union[LinearAdapter, str]) -> bool:
        """Stops converting with the registered adapter (or fingerprint) and purges what it wrote
        back; False if it is not registered."""
        return self._native.disable_adapter(_fingerprint(adapter))

    def enable_adapter(self, adapter: Union[LinearAdapter, str]) -> bool:
        """Re-enables a disabled adapter (or fingerprint) with an empty check window; False if it
        is not registered."""
        return self._native.enable_adapter(_fingerprint(adapter))

    def adapter_health(self) -> List[dict]:
        """Per registered adapter: fingerprint ("adapter"), "source", "target", "enabled",
        "checks", "window_checks", "window_positions", rolling "agreement", "kl", "loss_gap"
        (NaN without checks), "disables" (see AdapterHealth in include/kvbridge/bridge.h)."""
        return self._native.adapter_health()

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
             device: Union[str, torch.device, None] = None, as_cache: bool = False,
             model: Any = None) -> Load:
        """The longest usable prefix of `tokens` for `spec` (see the class docstring).

        Empty and one-token prompts are misses. return_kv=False reports the length only (a
        conversion, if one is needed, still runs and is written back). device: where the returned
        tensors live (default: CPU). as_cache: return the KV as a transformers DynamicCache.
        model: the target model (spec's); with exact_layers > 0, a load holding converted tokens
        (converted now or written back by a conversion) gets its first exact_layers layers from
        the model's own forward (kvbridge.exact.exact_layers).
        """
        ids = as_tokens(tokens)
        found = self._native.load(spec, ids, _args.text("namespace", namespace))
        kv = None
        if found.tokens and return_kv:
            kv = empty_kv(spec, found.tokens)
            keys, values = kv_views(kv)
            found.copy_to(keys, values)
            if model is not None and self._exact_layers and found.adapter:
                from kvbridge import exact

                kv = exact.exact_layers(model, ids[: found.tokens], kv, self._exact_layers)
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


def _fingerprint(adapter: Union[LinearAdapter, str]) -> str:
    if isinstance(adapter, LinearAdapter):
        return adapter.fingerprint
    if isinstance(adapter, str):
        return adapter
    raise TypeError("adapter: expected a kvbridge.LinearAdapter or its fingerprint, got "
                    f"{type(adapter).__name__}")


__all__: List[str] = ["Bridge", "Load"]
