"""The connector's scheduler side: lookups, promises and the metadata of each engine step.

``get_num_new_matched_tokens`` probes the store (the model's own entries and those of every
usable adapter's source model) without converting or writing anything, and promises the longest
prefix past vLLM's own computed tokens (at most the prompt minus its last token). Adapters the
Bridge has disabled (its rolling shadow-check agreement fell below min_agreement) are not
probed, so their loads fall back to the model's own prefill. Across tokenizers the aligned
length depends on both tokenizations: ``Bridge.probe`` finds it as the load would, without
converting; the worker's load converts to fill the blocks.

``build_connector_meta`` turns promises into load operations and, once a request's prompt has
been computed, its whole chunks into a save operation (with the provenance the probe saw behind
its cached prefix). ``request_finished`` reports the outcome of the request's load, which the
worker side left in the process registry, in the output's kv_transfer_params
(``{OUTCOME_KEY: {"namespace", "start", "tokens_loaded", "converted", "adapter"}}``).

Shadow-check twins (kvbridge.vllm.shadow) are marked in their kv_transfer_params
(``shadow_params``): an "own" twin is promised nothing; a "converted" one loads from the given
namespace at most its prompt's length minus `positions` tokens. Neither is saved.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from kvbridge._core import InvalidArgumentError
from kvbridge.vllm import device_load
from kvbridge.vllm.metadata import (OUTCOME_KEY, SHADOW_KEY, KVBridgeConnectorMetadata, LoadOp,
                                    SaveOp)
from kvbridge.vllm.options import ConnectorOptions
from kvbridge.vllm.registry import Shared

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvbridge.vllm")


@dataclass
class RequestState:
    tokens: List[int]
    namespace: str
    native: int           # tokens of the model's own entries (probe)
    best: int             # tokens the store can serve, native or converted (probe)
    external: int = 0     # tokens promised to vLLM
    block_ids: List[int] = field(default_factory=list)
    saved: bool = False
    shadow: str = ""      # "own" / "converted" for a shadow-check twin (never saved)
    cap: int = 0          # most tokens that may be promised
    origin: Tuple[str, str] = ("", "")  # provenance behind the cached prefix (probe)


def shadow_params(request: Any) -> Tuple[str, Optional[str], int]:
    """(role, namespace, positions) of a shadow-check twin, from its kv_transfer_params under
    SHADOW_KEY; ("", None, 0) for any other request. Raises InvalidArgumentError on a malformed
    marker."""
    params = getattr(request, "kv_transfer_params", None) or {}
    shadow = params.get(SHADOW_KEY)
    if shadow is None:
        return "", None, 0
    if not isinstance(shadow, dict):
        shadow = {}
    role = shadow.get("role")
    if role == "own":
        return role, None, 0
    ns, positions = shadow.get("namespace"), shadow.get("positions", 1)
    if (role != "converted" or not isinstance(ns, str) or not ns
            or not isinstance(positions, int) or isinstance(positions, bool)
            or positions < 1):
        raise InvalidArgumentError(f"KVBridgeConnector: bad {SHADOW_KEY} kv_transfer_params "
                                   f"{shadow!r}: expected role 'own', or role 'converted' "
                                   "with a namespace and positions >= 1")
    return role, ns, positions


class SchedulerSide:
    """The scheduler role's state: one RequestState per request it has probed."""

    def __init__(self, shared: Shared, options: ConnectorOptions, block_size: int):
        self._shared = shared
        self._spec = shared.spec
        self._options = options
        self._block_size = block_size
        self._chunk = shared.store.chunk_tokens
        self._count = shared.counters.count
        self._reqs: Dict[str, RequestState] = {}

    def _namespace(self, request: "Request") -> str:
        params = getattr(request, "kv_transfer_params", None) or {}
        ns = params.get("namespace") or self._options.namespace
        salt = getattr(request, "cache_salt", None)
        return f"{ns}\x1fsalt={salt}" if salt else str(ns)

    @staticmethod
    def _keyable_tokens(request: "Request") -> Optional[List[int]]:
        if (request.prompt_token_ids is None or getattr(request, "mm_features", None)
                or getattr(request, "lora_request", None) is not None):
            return None
        return list(request.prompt_token_ids)

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> Tuple[int, bool]:
        state = self._reqs.get(request.request_id)
        if state is None:
            tokens = self._keyable_tokens(request)
            if tokens is None:
                self._count("requests_skipped")
                return 0, False
            role, shadow_ns, positions = shadow_params(request)
            if role == "own":  # the model's own prefill: nothing promised, nothing saved
                state = self._reqs[request.request_id] = RequestState(tokens, "", 0, 0,
                                                                      shadow=role)
                return 0, False
            t0 = time.perf_counter()
            ns = shadow_ns or self._namespace(request)
            native, best, origin = self._probe(request.request_id, tokens, ns)
            self._count("lookups")
            self._count("lookup_seconds", time.perf_counter() - t0)
            if best > native:
                self._count("lookup_hits_converted")
            elif native:
                self._count("lookup_hits_native")
            # vLLM computes at least the last prompt token itself; a converted twin leaves its
            # last `positions` tokens to be computed over the loaded prefix.
            cap = len(tokens) - max(1, positions)
            state = self._reqs[request.request_id] = RequestState(tokens, ns, native, best,
                                                                  shadow=role, cap=cap,
                                                                  origin=origin)
        usable = min(state.best, state.cap)
        return max(0, usable - num_computed_tokens), False

    def _probe(self, req_id: str, tokens: List[int],
               ns: str) -> Tuple[int, int, Tuple[str, str]]:
        """(native, best, origin) of a prompt: the tokens the model's own entries serve, the
        most any usable source serves, and the (source, adapter) fingerprints behind the best."""
        native = best = 0
        origin = ("", "")
        if len(tokens) <= 1:
            return native, best, origin
        store = self._shared.store
        bridge = self._shared.bridge
        found = store.match(self._spec, tokens, ns, return_kv=False)
        # Entries naming a dropped adapter are not served: promise none of a prefix holding one
        # (the load serves what comes before it, if anything).
        native = best = 0 if bridge.adapter_dropped(found.adapter) else found.tokens
        limit = len(tokens) - 1
        if found.adapter and native:
            # Written-back entries keep their adapter's tail, as the worker's load
            # (device_load.load) cuts them: promise no more than it will load.
            tail = device_load.tail_of(bridge, found.adapter, len(tokens))
            if tail > 0:
                native = best = max(0, min(native, limit - tail))
        origin = (found.converted_from, found.adapter) if native else ("", "")
        usable = self._shared.usable_adapters()
        for adapter in usable:
            if adapter.source.tokenizer != self._spec.tokenizer:
                continue  # another tokenizer's ids: probed below
            source = store.match(adapter.source, tokens, ns, return_kv=False)
            length = 0 if bridge.adapter_dropped(source.adapter) else source.tokens
            tail = bridge.recompute_tail_for(adapter, len(tokens))
            if tail > 0:  # the adapter's tail stays with the engine
                length = min(length, limit - tail)
            if length > best:
                best = length
                origin = (adapter.source.fingerprint, adapter.fingerprint)
        if any(a.source.tokenizer != self._spec.tokenizer for a in usable):
            # Across tokenizers the aligned length depends on the text's tokenization under
            # each source tokenizer and on the adapter's alignment: the Bridge's probe finds it
            # as its load would, without converting (the worker's load converts). It tokenizes
            # nothing when no such adapter could beat the own entries (a repeated prompt).
            try:
                found = bridge.probe(self._spec, tokens, ns)
                if found.tokens > best:
                    best = found.tokens
                    origin = (found.converted_from, found.adapter)
            except Exception as e:  # a probe never fails the request
                logger.warning("kvbridge: probe across tokenizers of request %s failed: %s",
                               req_id, e)
        return native, best, origin

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        state = self._reqs.get(request.request_id)
        if state is not None and num_external_tokens > 0:
            state.external = int(num_external_tokens)
            self._count("tokens_promised", num_external_tokens)

    def _plan(self, meta: KVBridgeConnectorMetadata, req_id: str, state: RequestState,
              num_computed: int, num_scheduled: int) -> None:
        if state.external:
            stop = num_computed  # computed = vLLM's own prefix + the promised tokens
            meta.loads.append(LoadOp(req_id, state.tokens, state.namespace,
                                     stop - state.external, stop, list(state.block_ids),
                                     shadow=bool(state.shadow)))
            state.external = 0
        save_len = len(state.tokens) // self._chunk * self._chunk
        if (not state.saved and not state.shadow and save_len > state.native
                and num_computed + num_scheduled >= len(state.tokens)):
            nblocks = -(-save_len // self._block_size)
            meta.saves.append(SaveOp(req_id, state.tokens[:save_len], state.namespace,
                                     state.block_ids[:nblocks], state.origin))
            state.saved = True

    def build_connector_meta(self, scheduler_output: "SchedulerOutput"
                             ) -> KVBridgeConnectorMetadata:
        meta = KVBridgeConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._reqs.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            self._plan(meta, new.req_id, state, new.num_computed_tokens,
                       scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._reqs.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                state.block_ids.extend(new_ids[0])
            self._plan(meta, req_id, state, cached.num_computed_tokens[i],
                       scheduled.get(req_id, 0))
        return meta

    def request_finished(self, request: "Request",
                         block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        state = self._reqs.pop(request.request_id, None)
        outcome = self._shared.pop_outcome(request.request_id)
        if state is None or outcome is None:
            return False, None
        return False, {OUTCOME_KEY: dict(outcome, namespace=state.namespace)}


__all__ = ["RequestState", "SchedulerSide", "shadow_params"]
