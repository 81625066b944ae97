"""The process registry: within one process, the connector's scheduler-side and worker-side
instances share one store, Bridge, set of counters and save thread (a ``Shared``), keyed by the
store options, adapters and Bridge options and the served spec. The worker side leaves each
load's outcome here for the scheduler side to report when its request finishes."""
from __future__ import annotations

import atexit
import collections
import logging
import threading
from typing import Any, Dict, List, Optional

from kvbridge import _core
from kvbridge._core import InvalidArgumentError
from kvbridge.adapter import LinearAdapter
from kvbridge.bridge import Bridge
from kvbridge.store import KVStore
from kvbridge.vllm.options import ConnectorOptions
from kvbridge.vllm.saver import Saver
from kvbridge.vllm.stats import Counters
from kvbridge.vllm.tokenizer_setup import register_tokenizers

logger = logging.getLogger("kvbridge.vllm")

#: Load outcomes (and the worker's provenance records) kept per process: a bound, since with a
#: worker in another process than the scheduler nothing collects them.
MAX_OUTCOMES = 4096


class Shared:
    """One process's store, Bridge, counters and save thread for one connector config."""

    def __init__(self, options: ConnectorOptions, spec: _core.ModelSpec,
                 tokenizer_folder: Optional[str] = None):
        self.spec = spec
        self.options = options
        self.counters = Counters()
        store_kw = dict(options.store)
        capacity = store_kw.pop("capacity_bytes")
        chunk = store_kw.pop("chunk_tokens")
        try:
            self.store = KVStore(capacity, chunk, **store_kw)
        except _core.UnavailableError as e:
            # The disk directory cannot be opened (unwritable, or held by an older kvbridge):
            # serve from memory only rather than fail the engine.
            logger.error("kvbridge: store unavailable (%s); running with a memory-only store, "
                         "entries of other processes are misses", e)
            self.counters.count("store_unavailable")
            self.store = KVStore(capacity, chunk)
        # The Bridge never writes back: a converted prefix reaches the store with the request's
        # save, in the background with its provenance, not synchronously inside the engine step.
        self.bridge = Bridge(self.store, **dict(options.bridge_options(), write_back=False))
        self.adapters: List[LinearAdapter] = []
        for path in options.adapters:
            adapter = LinearAdapter.load(path)
            if adapter.target != spec:
                raise InvalidArgumentError(
                              f"KVBridgeConnector: adapter {path} converts to {adapter.target.name} "
                              f"(fingerprint {adapter.target.fingerprint}), but this engine serves "
                              f"{spec.name} (fingerprint {spec.fingerprint}); its target spec "
                              f"{_spec_fields(adapter.target)} != served {_spec_fields(spec)}")
            self.bridge.add_adapter(adapter)
            self.adapters.append(adapter)
        across = [a for a in self.adapters if a.source.tokenizer != spec.tokenizer]
        if across:
            register_tokenizers(self.bridge, spec, tokenizer_folder, across, options.tokenizers)
        # Adapters the probe may look at: those the Bridge would use (quality gate); of these,
        # the ones the Bridge has disabled are skipped at each probe (usable_adapters).
        self.gated = [a for a in self.adapters if Bridge.quality(a) >= options.min_quality]
        self._lock = threading.Lock()
        self._outcomes: "collections.OrderedDict[str, Dict[str, Any]]" = collections.OrderedDict()
        self.saver = Saver(self.bridge, spec, self.counters)

    def usable_adapters(self) -> List[LinearAdapter]:
        """The gated adapters the Bridge has not disabled (from models with the served model's
        tokenizer and from others alike)."""
        if not self.gated:
            return []
        enabled = {h["adapter"] for h in self.bridge.adapter_health() if h["enabled"]}
        return [a for a in self.gated if a.fingerprint in enabled]

    def put_outcome(self, req_id: str, outcome: Dict[str, Any]) -> None:
        with self._lock:
            self._outcomes[req_id] = outcome
            self._outcomes.move_to_end(req_id)
            while len(self._outcomes) > MAX_OUTCOMES:
                self._outcomes.popitem(last=False)

    def pop_outcome(self, req_id: str) -> Optional[Dict[str, Any]]:
        with self._lock:
            return self._outcomes.pop(req_id, None)

    def flush(self) -> None:
        """Waits until every save handed to the save thread is in the store."""
        self.saver.flush()


def _spec_fields(spec: _core.ModelSpec) -> dict:
    return {k: getattr(spec, k) for k in ("name", "num_layers", "num_kv_heads", "head_dim",
                                          "dtype", "version", "tokenizer", "rope_base",
                                          "rope_style")}


_REGISTRY: Dict[tuple, Shared] = {}
_REGISTRY_LOCK = threading.Lock()


def shared(options: ConnectorOptions, spec: _core.ModelSpec,
           tokenizer_folder: Optional[str] = None) -> Shared:
    """This process's Shared for the config, created on first use."""
    key = (options.store, options.adapters, options.tokenizers, options.min_quality,
           options.write_back, options.quality, spec.fingerprint, tokenizer_folder)
    with _REGISTRY_LOCK:
        found = _REGISTRY.get(key)
        if found is None:
            found = _REGISTRY[key] = Shared(options, spec, tokenizer_folder)
        return found


@atexit.register
def _flush_all() -> None:
    for found in list(_REGISTRY.values()):
        found.flush()


__all__ = ["MAX_OUTCOMES", "Shared", "shared"]
