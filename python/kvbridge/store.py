"""The tiered KV store (memory, disk, Redis) and its prefix match."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable, List, Optional, Union

import torch

from kvbridge import _args, _core
from kvbridge._tensors import KVCache, as_tokens, host_kv, kv_views
from kvbridge.hf import legacy_to_cache
from kvbridge._core import InvalidArgumentError


@dataclass(frozen=True)
class Match:
    """The longest cached prefix of a lookup.

    tokens: its length, a multiple of the store's chunk_tokens (0 on a miss).
    kv: that prefix's KV cache (legacy tuple form, or a transformers DynamicCache when the lookup
        asked for one; fresh tensors the caller owns), or None on a miss or when the lookup asked
        for no KV.
    converted_from, adapter: the fingerprints of the source model and the adapter behind the
        first chunk that is not the model's own prefill (entries put with a provenance); ""
        when every chunk is the model's own.
    """

    tokens: int
    kv: Optional[KVCache]
    converted_from: str = ""
    adapter: str = ""


_TIER_BITS = dict(_core.TIERS)  # the store's table of tiers: name -> erase / clear mask bit
_TIER_NAMES = ", ".join(repr(t) for t in list(_TIER_BITS)[:-1]) + f" or {list(_TIER_BITS)[-1]!r}"


def _tier_mask(tiers: Iterable[str]) -> int:
    if isinstance(tiers, str):
        tiers = (tiers,)
    mask = 0
    for t in tiers:
        if t not in _TIER_BITS:
            raise InvalidArgumentError(f"tiers: expected {_TIER_NAMES}, got {t!r}")
        mask |= _TIER_BITS[t]
    return mask


class KVStore:
    """A thread-safe, tiered KV cache keyed by a chained hash of token chunks.

    Tiers: memory (always), a disk directory (``disk_dir``) and Redis (``redis_url``). ``put``
    writes through to every configured tier before it returns; ``match`` looks each chunk up
    in memory, then disk, then Redis, verifies it and promotes it into memory. A failing disk
    or Redis is a counted miss or skipped write (see ``stats()``), never an exception.
    docs/storage.md describes the formats, costs and failure handling.

    capacity_bytes: memory budget (KV + token ids + a small per-entry overhead); never
        exceeded.
    chunk_tokens: tokens per stored chunk; only whole chunks are stored and matched.
    disk_dir: directory of the disk tier (created if missing). Any number of stores, in this
        and other processes, may share one directory at once (docs/storage.md).
    disk_capacity_bytes: disk budget in bytes of 4 KiB blocks (default 16 GiB).
    redis_url: ``redis://[[user]:password@]host[:port][/db]`` of the Redis tier.
    num_shards: lock shards (eviction is exact with 1, per shard otherwise).
    eviction: "lru" (default), "lfu" or "ttl" (oldest put first; needs ttl_seconds).
    ttl_seconds: entries expire this long after their put, in every tier (0: never).
    storage: "native" (default: the spec's dtype, bit-exact) or "int8" (int8 codes with
        float32 scales, per channel for keys and per token for values; about half the bytes of
        bfloat16; match returns them dequantized to the spec's dtype, each element within half
        a quantization step). put raises ValueError for NaN or infinite KV with "int8".
    **options: any other field of StoreOptions (include/kvbridge/store_options.h), e.g.
        disk_fsync, redis_key_prefix, redis_command_timeout_ms, redis_filter,
        redis_filter_refresh_ms.
    """

    def __init__(self, capacity_bytes: int, chunk_tokens: int = 256,
                 disk_dir: Optional[Union[str, "os.PathLike[str]"]] = None,
                 disk_capacity_bytes: Optional[int] = None, redis_url: Optional[str] = None, *,
                 num_shards: int = 16, eviction: str = "lru", ttl_seconds: int = 0,
                 storage: str = "native", **options: Any):
        o = _core.StoreOptions()
        options = dict(options, capacity_bytes=_args.size("capacity_bytes", capacity_bytes),
                       chunk_tokens=_args.size("chunk_tokens", chunk_tokens),
                       num_shards=num_shards, eviction=eviction,
                       ttl_seconds=_args.size("ttl_seconds", ttl_seconds), storage=storage)
        if disk_dir is not None:
            options["disk_dir"] = os.fspath(disk_dir)
        if disk_capacity_bytes is not None:
            options["disk_capacity_bytes"] = _args.size("disk_capacity_bytes", disk_capacity_bytes)
        if redis_url is not None:
            options["redis_url"] = redis_url
        for name, value in options.items():
            if name.startswith("_") or not hasattr(o, name):
                raise TypeError(f"KVStore: unknown option {name!r}")
            default = getattr(o, name)
            value = _args.option(name, default, value)
            try:
                setattr(o, name, value)
            except TypeError:  # an int wider than the field (a C++ int)
                raise InvalidArgumentError(
                              f"{name}: {value!r} is out of range for this option") from None
        self._store = _core.KVStore(o)

    @property
    def capacity_bytes(self) -> int:
        return self._store.capacity_bytes

    @property
    def chunk_tokens(self) -> int:
        return self._store.chunk_tokens

    @property
    def storage(self) -> str:
        """Entry storage: "native" or "int8"."""
        return self._store.storage

    def put(self, spec: _core.ModelSpec, tokens: Any, kv: KVCache,
            namespace: str = "default", *, converted_from: str = "", adapter: str = "") -> int:
        """Stores the whole chunks of `tokens` with their KV; returns the tokens now cached.

        kv: one (key, value) pair per layer, each [1, kv_heads, len(tokens), head_dim] of the
            spec's dtype, any strides, or a transformers DynamicCache holding them. Tensors on
            another device are copied to the CPU first.
        converted_from, adapter: provenance of KV that is not `spec`'s own prefill (converted
            through an adapter, or computed over a converted prefix): the source model's and
            the adapter's fingerprints (Load.converted_from, Load.adapter), recorded with the
            chunks this call creates so that invalidate_adapter(spec, adapter) removes them.
            Both empty (the model's own KV) or both fingerprints; InvalidArgumentError otherwise.
        """
        ids = as_tokens(tokens)
        ns = _args.text("namespace", namespace)
        origin = {}  # keyword arguments cost a small put measurably: passed only when given
        if converted_from != "" or adapter != "":
            origin = dict(converted_from=_args.text("converted_from", converted_from),
                          adapter=_args.text("adapter", adapter))
        # A tuple of CPU tensors is read in place by the core; anything else (caches, device
        # tensors, bad input) takes the general path, which checks it and names what is wrong.
        stored = self._store.put_kv(spec, ids, kv, ns, **origin)
        if stored is not None:
            return stored
        keys, values = kv_views(host_kv(kv))
        return self._store.put(spec, ids, keys, values, ns, **origin)

    def match(self, spec: _core.ModelSpec, tokens: Any, namespace: str = "default", *,
              return_kv: bool = True,
              device: Union[str, torch.device, None] = None, as_cache: bool = False) -> Match:
        """The longest cached prefix of `tokens` for (spec, namespace).

        return_kv: copy the prefix's KV out (False only reports its length).
        device: where the returned tensors live (default: CPU).
        as_cache: return the KV as a transformers DynamicCache instead of a legacy tuple; the
            spec's sliding-window layers (ModelSpec.layer_attention) as DynamicSlidingWindowLayer
            holding their last window - 1 tokens, as the model's own cache would.
        """
        ids = as_tokens(tokens)
        ns = _args.text("namespace", namespace)
        if not return_kv:  # the length only: nothing pinned, no Match object in between
            n, converted_from, adapter = self._store.match_length(spec, ids, ns)
            return Match(n, None, converted_from, adapter) if n else Match(0, None)
        # One call: the lookup, fresh CPU tensors and the copy into them.
        n, kv, converted_from, adapter = self._store.match_kv(spec, ids, ns)
        if n == 0:
            return Match(0, None)
        if device is not None and torch.device(device).type != "cpu":
            kv = tuple((k.to(device), v.to(device)) for k, v in kv)
        return Match(n, legacy_to_cache(kv, spec) if as_cache else kv, converted_from, adapter)

    def erase(self, spec: _core.ModelSpec, tokens: Any, namespace: str = "default",
              tiers: Iterable[str] = ("memory", "disk", "redis")) -> int:
        """Removes the entries of the whole chunks of `tokens` from `tiers`.

        Returns how many memory and disk entries were removed (Redis deletions are not
        counted)."""
        return self._store.erase(spec, as_tokens(tokens), _args.text("namespace", namespace),
                                 _tier_mask(tiers))

    def invalidate(self, spec: _core.ModelSpec) -> dict:
        """Removes every entry of the spec's fingerprint, in every namespace and tier.

        Returns {"memory": n, "disk": n, "redis": n, "redis_complete": bool}."""
        return self._store.invalidate(spec)

    def invalidate_adapter(self, target: _core.ModelSpec, adapter_fingerprint: str) -> dict:
        """Removes every entry of `target` written back from a conversion by the adapter with
        this fingerprint (LinearAdapter.fingerprint), in every namespace and tier.

        Returns {"memory": n, "disk": n, "redis": n, "redis_complete": bool}."""
        return self._store.invalidate_adapter(
            target, _args.text("adapter_fingerprint", adapter_fingerprint))

    def clear(self, tiers: Iterable[str] = ("memory", "disk")) -> None:
        """Removes every entry of `tiers`; Redis, shared with other processes, only if named."""
        self._store.clear(_tier_mask(tiers))

    def stats(self) -> dict:
        """Counters and byte accounting: see StoreStats in include/kvbridge/store_stats.h.

        Per-tier counters are under "memory", "disk" and "redis"; Redis round trips, latency
        and the filter under "remote"."""
        return self._store.stats()

    def metrics_text(self) -> str:
        """stats() in the Prometheus text format, names prefixed kvbridge_store_."""
        return self._store.metrics_text()


def prefix_hashes(spec: _core.ModelSpec, tokens: Any, namespace: str = "default",
                  chunk_tokens: int = 256) -> List[str]:
    """[h_0, h_1, ...] as 32-digit hex strings: the salt, then one hash per whole chunk."""
    return _core.prefix_hashes(spec, as_tokens(tokens), _args.text("namespace", namespace),
                               _args.size("chunk_tokens", chunk_tokens))
