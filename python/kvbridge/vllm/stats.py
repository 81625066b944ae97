"""The connector's counters: their names (COUNTERS, TIMERS), one process's running figures
(Counters, which both connector roles count into) and their export to vLLM (the per-interval
KVBridgeConnectorStats the worker reports, and one Prometheus counter per name)."""
from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING, Any, Dict

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (KVConnectorPromMetrics,
                                                                   KVConnectorStats)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: The connector's counters (stats(), vLLM's connector stats and Prometheus).
COUNTERS = (
    "lookups",             # scheduler probes
    "lookup_hits_native",  # probes answered from the model's own entries
    "lookup_hits_converted",  # probes answered from another model's entries (to convert)
    "tokens_promised",     # tokens promised to vLLM past its own computed prefix
    "loads",               # load operations run by the worker
    "loads_native",
    "loads_converted",
    "tokens_loaded",       # tokens written into vLLM's blocks
    "load_errors",         # load operations that delivered less than promised
    "failed_blocks",       # blocks reported to vLLM for recomputation
    "saves",               # prompts handed to the store
    "tokens_saved",        # tokens the store took
    "save_errors",         # saves that raised (the request is unaffected)
    "saves_skipped_derived",  # prompts over converted KV not saved (write_back off)
    "saves_purged",        # saves not stored: their adapter was dropped (disabled, removed)
    "requests_skipped",    # requests kvbridge cannot key (prompt embeds, multimodal, LoRA)
    "store_unavailable",   # 1 when the configured store could not be opened
    "shadow_loads",        # loads of the converted twins of shadow checks
    "shadow_checks",       # shadow checks recorded in the Bridge (kvbridge.vllm.shadow)
    "shadow_disables",     # adapters a shadow check disabled
)
#: The connector's times in seconds, summed like the counters.
TIMERS = ("lookup_seconds", "load_seconds", "save_copy_seconds", "save_seconds")


class Counters:
    """COUNTERS and TIMERS of one process: totals since it started, and the deltas since the
    last take_pending() (what the worker reports to vLLM). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: Dict[str, float] = {k: 0 for k in COUNTERS + TIMERS}
        self._pending: Dict[str, float] = {k: 0 for k in COUNTERS + TIMERS}

    def count(self, name: str, value: float = 1) -> None:
        with self._lock:
            self._totals[name] += value
            self._pending[name] += value

    def totals(self) -> Dict[str, float]:
        with self._lock:
            return dict(self._totals)

    def take_pending(self) -> Dict[str, float]:
        """The non-zero deltas since the last call; resets them."""
        with self._lock:
            out = {k: v for k, v in self._pending.items() if v}
            for k in self._pending:
                self._pending[k] = 0
        return out


@dataclasses.dataclass
class KVBridgeConnectorStats(KVConnectorStats):
    """Counter deltas of one interval (COUNTERS and TIMERS by name)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KVBridgeConnectorStats":
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> Dict[str, float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVBridgePromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per connector counter: ``vllm:kvbridge_<name>``."""

    def __init__(self, vllm_config: "VllmConfig", metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: Dict[str, Dict[int, Any]] = {}
        for name in COUNTERS + TIMERS:
            counter = self._counter_cls(name=f"vllm:kvbridge_{name}",
                                        documentation=f"kvbridge connector: {name}",
                                        labelnames=labelnames)
            self._counters[name] = {idx: counter.labels(*values)
                                    for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: Dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self._counters.get(name)
            if per_engine is not None and value > 0 and engine_idx in per_engine:
                per_engine[engine_idx].inc(value)


__all__ = ["COUNTERS", "Counters", "KVBridgeConnectorStats", "KVBridgePromMetrics", "TIMERS"]
