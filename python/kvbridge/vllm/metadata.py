"""What the connector's scheduler side hands its worker side each engine step (vLLM's connector
metadata), and the keys of a request's kv_transfer_params the connector reads and writes."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

#: Key of a request's kv_transfer_params marking a shadow-check twin (kvbridge.vllm.scheduler).
SHADOW_KEY = "kvbridge_shadow"
#: Key of the load outcome in a finished request's kv_transfer_params.
OUTCOME_KEY = "kvbridge"


@dataclass
class LoadOp:
    """Load tokens [start, stop) of `tokens` into `block_ids` (the request's blocks)."""

    req_id: str
    tokens: List[int]
    namespace: str
    start: int
    stop: int
    block_ids: List[int]
    shadow: bool = False  # the converted twin of a shadow check


@dataclass
class SaveOp:
    """Save `tokens` (whole chunks of a computed prompt) from `block_ids`."""

    req_id: str
    tokens: List[int]
    namespace: str
    block_ids: List[int]
    # (source, adapter) fingerprints the probe saw behind the prompt's cached prefix (written-back
    # entries, or the convertible source): the worker's load, if it ran one, knows better.
    origin: Tuple[str, str] = ("", "")


@dataclass
class KVBridgeConnectorMetadata(KVConnectorMetadata):
    loads: List[LoadOp] = field(default_factory=list)
    saves: List[SaveOp] = field(default_factory=list)


__all__ = ["KVBridgeConnectorMetadata", "LoadOp", "OUTCOME_KEY", "SHADOW_KEY", "SaveOp"]
