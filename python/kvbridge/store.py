"""The in-memory KV store and its prefix match."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Union

import torch

from kvbridge import _core
from kvbridge._tensors import KVCache, as_tokens, empty_kv, host_kv, kv_views


@dataclass(frozen=True)
class Match:
    """The longest cached prefix of a lookup.

    tokens: its length, a multiple of the store's chunk_tokens (0 on a miss).
    kv: that prefix's KV cache (legacy tuple form, fresh tensors the caller owns), or None on a
        miss or when the lookup asked for no KV.
    """

    tokens: int
    kv: Optional[KVCache]


class KVStore:
    """A thread-safe in-memory KV cache keyed by a chained hash of token chunks.

    capacity_bytes: budget for stored bytes (KV + token ids + a small per-entry overhead); never
        exceeded. Least recently used entries are evicted to make room.
    chunk_tokens: tokens per stored chunk; only whole chunks are stored and matched.
    num_shards: lock shards (eviction is exact LRU with 1, LRU per shard otherwise).
    """

    def __init__(self, capacity_bytes: int, chunk_tokens: int = 256, num_shards: int = 16):
        self._store = _core.KVStore(int(capacity_bytes), int(chunk_tokens), int(num_shards))

    @property
    def capacity_bytes(self) -> int:
        return self._store.capacity_bytes

    @property
    def chunk_tokens(self) -> int:
        return self._store.chunk_tokens

    def put(self, spec: _core.ModelSpec, tokens: Any, kv: KVCache,
            namespace: str = "default") -> int:
        """Stores the whole chunks of `tokens` with their KV; returns the tokens now cached.

        kv: one (key, value) pair per layer, each [1, kv_heads, len(tokens), head_dim] of the
            spec's dtype, any strides. Tensors on another device are copied to the CPU first.
        """
        ids = as_tokens(tokens)
        pairs = host_kv(kv)
        keys, values = kv_views(pairs)
        return self._store.put(spec, ids, keys, values, namespace)

    def match(self, spec: _core.ModelSpec, tokens: Any, namespace: str = "default", *,
              return_kv: bool = True,
              device: Union[str, torch.device, None] = None) -> Match:
        """The longest cached prefix of `tokens` for (spec, namespace).

        return_kv: copy the prefix's KV out (False only reports its length).
        device: where the returned tensors live (default: CPU).
        """
        ids = as_tokens(tokens)
        found = self._store.match(spec, ids, namespace)
        if found.tokens == 0 or not return_kv:
            return Match(found.tokens, None)
        kv = empty_kv(spec, found.tokens)
        keys, values = kv_views(kv)
        found.copy_to(keys, values)
        if device is not None and torch.device(device).type != "cpu":
            kv = tuple((k.to(device), v.to(device)) for k, v in kv)
        return Match(found.tokens, kv)

    def erase(self, spec: _core.ModelSpec, tokens: Any, namespace: str = "default") -> int:
        """Removes the entries of the whole chunks of `tokens`; returns how many were removed."""
        return self._store.erase(spec, as_tokens(tokens), namespace)

    def clear(self) -> None:
        self._store.clear()

    def stats(self) -> dict:
        """Counters and byte accounting: see StoreStats in include/kvbridge/kv_store.h."""
        return self._store.stats()


def prefix_hashes(spec: _core.ModelSpec, tokens: Any, namespace: str = "default",
                  chunk_tokens: int = 256) -> List[str]:
    """[h_0, h_1, ...] as 32-digit hex strings: the salt, then one hash per whole chunk."""
    return _core.prefix_hashes(spec, as_tokens(tokens), namespace, int(chunk_tokens))
