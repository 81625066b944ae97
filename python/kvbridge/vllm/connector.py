"""KVBridgeConnector: kvbridge's store and Bridge as a vLLM v1 KV connector.

vLLM creates the connector once per role: in the scheduler (``KVConnectorRole.SCHEDULER``) and
in each worker (``WORKER``). This class checks the configuration, derives the served model's
ModelSpec and delegates to its role's object, one module each:

- ``kvbridge.vllm.scheduler`` (``SchedulerSide``): probes the store, promises prefixes to vLLM,
  builds each step's metadata (``kvbridge.vllm.metadata``: load and save operations) and reports
  a finished request's load outcome.
- ``kvbridge.vllm.worker`` (``WorkerSide``): loads into vLLM's paged KV cache, copies finished
  prompts out of it, and reports the blocks vLLM must recompute.
- ``kvbridge.vllm.registry``: within one process both roles share one store, Bridge, counters
  (``kvbridge.vllm.stats``) and save thread (``kvbridge.vllm.saver``), keyed by the store
  options, adapters and Bridge options.

Across tokenizers: an adapter whose source model has another tokenizer (one fitted on aligned
samples) needs both tokenizers, registered with the Bridge at start
(``kvbridge.vllm.tokenizer_setup``); loads then go through ``Bridge.load``, which aligns the two
tokenizations.

Quality (kvbridge.vllm.shadow): a request whose ``kv_transfer_params`` hold
``{"kvbridge_shadow": {"role": "own"}}`` is served by the model's own prefill (nothing is
promised); one with ``{"kvbridge_shadow": {"role": "converted", "namespace": ns, "positions": p}}``
loads from namespace `ns` at most its prompt's length minus `p` tokens. Neither is saved. A
finished request that ran a load reports ``{"kvbridge": {"namespace", "start", "tokens_loaded",
"converted", "adapter"}}`` in its output's kv_transfer_params (tokens [start, start +
tokens_loaded) were loaded; adapter: the fingerprint behind converted or written-back tokens,
"" for the model's own KV). ``record_checks`` records shadow checks in the Bridge, which
disables an adapter below its floor; ``stats()`` and ``metrics_text()`` give the figures.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                                KVConnectorMetadata,
                                                                KVConnectorRole)

from kvbridge import _core
from kvbridge._core import InvalidArgumentError
from kvbridge.bridge import Bridge
from kvbridge.vllm import registry
from kvbridge.vllm.metadata import (OUTCOME_KEY, SHADOW_KEY, KVBridgeConnectorMetadata, LoadOp,
                                    SaveOp)
from kvbridge.vllm.options import engine_spec, parse_options
from kvbridge.vllm.scheduler import SchedulerSide
from kvbridge.vllm.stats import (COUNTERS, TIMERS, KVBridgeConnectorStats,
                                 KVBridgePromMetrics)
from kvbridge.vllm.worker import (WorkerSide, check_cpu_layout, check_kv_cache_groups,
                                  load_into_blocks)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("kvbridge.vllm")


class KVBridgeConnector(KVConnectorBase_V1):
    """vLLM v1 KV connector backed by kvbridge (see the module docstring and README "vLLM")."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
            raise InvalidArgumentError("KVBridgeConnector: tensor and pipeline parallel sizes must be 1, "
                                       f"got {parallel.tensor_parallel_size} and "
                                       f"{parallel.pipeline_parallel_size}")
        tc = self._kv_transfer_config
        # A failed load must mean "recompute these blocks", never "fail the request"
        # (vLLM's default policy); the scheduler reads this after creating its connector.
        if getattr(tc, "kv_load_failure_policy", "recompute") != "recompute":
            logger.info("kvbridge: setting kv_load_failure_policy='recompute' (a failed load "
                        "is recomputed, never a failed request)")
            tc.kv_load_failure_policy = "recompute"
        block_size = int(vllm_config.cache_config.block_size)
        options = parse_options(tc.kv_connector_extra_config, block_size)
        mc = vllm_config.model_config
        self._spec = engine_spec(mc.hf_text_config, mc.model, mc.tokenizer,
                                 mc.served_model_name, mc.dtype,
                                 vllm_config.cache_config.cache_dtype, options)
        check_kv_cache_groups(kv_cache_config, getattr(mc, "max_model_len", None))
        tokenizer = mc.tokenizer if mc.tokenizer and os.path.isdir(str(mc.tokenizer)) else None
        self._shared = registry.shared(options, self._spec, tokenizer)
        self._scheduler: Optional[SchedulerSide] = None
        self._worker: Optional[WorkerSide] = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(self._shared, options, block_size)
        elif role == KVConnectorRole.WORKER:
            self._worker = WorkerSide(self._shared, options, block_size)
        logger.info("kvbridge: %s connector for %s (fingerprint %s), chunk %d tokens",
                    role.name.lower(), self._spec.name, self._spec.fingerprint,
                    self._shared.store.chunk_tokens)

    def _side(self, side: Optional[Any], name: str) -> Any:
        if side is None:
            # vLLM calls each role's methods on that role's connector only.
            raise _core.Error(f"KVBridgeConnector: {name}-side call on the "
                               f"{self.role.name.lower()} connector")
        return side

    # ----- both roles ---------------------------------------------------------------------

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a future miss

    @property
    def spec(self) -> _core.ModelSpec:
        """The served model's ModelSpec."""
        return self._spec

    @property
    def bridge(self) -> Bridge:
        return self._shared.bridge

    def stats(self) -> dict:
        """This process's connector counters and times (COUNTERS, TIMERS), with the Bridge's
        and the store's stats under "bridge" and "store"."""
        out: Dict[str, Any] = self._shared.counters.totals()
        out["bridge"] = self._shared.bridge.stats()
        out["store"] = self._shared.store.stats()
        out["adapters"] = {h["adapter"]: h for h in self._shared.bridge.adapter_health()}
        return out

    def metrics_text(self) -> str:
        """The Bridge's stats in Prometheus text format (``Bridge.metrics_text``:
        kvbridge_bridge_* families, with the per-adapter health). The connector's own counters
        reach Prometheus through vLLM's metrics (``vllm:kvbridge_<name>``,
        ``build_prom_metrics``)."""
        return self._shared.bridge.metrics_text()

    metrics = metrics_text  # the earlier name

    def record_checks(self, checks: List[Tuple[str, Any]]) -> List[str]:
        """Records shadow checks, (adapter fingerprint, kvbridge.monitor.Check) pairs, in the
        Bridge (which keeps the rolling figures and disables an adapter below the floor);
        returns the fingerprints this call disabled. Checks of adapters no longer registered
        are dropped."""
        bridge = self._shared.bridge
        count = self._shared.counters.count
        disabled: List[str] = []
        for fingerprint, check in checks:
            try:
                off = bridge.record_check(fingerprint, check)
            except _core.NotFoundError:
                logger.warning("kvbridge: shadow check of unregistered adapter %s dropped",
                               fingerprint)
                continue
            count("shadow_checks")
            if off:
                count("shadow_disables")
                disabled.append(fingerprint)
                health = {h["adapter"]: h for h in bridge.adapter_health()}.get(fingerprint, {})
                logger.warning(
                    "kvbridge: adapter %s -> %s (%s) disabled by shadow checks: rolling "
                    "agreement %.3f over %d checks is below min_agreement %s; its loads fall "
                    "back to the model's own prefill", health.get("source", "?"),
                    health.get("target", "?"), fingerprint, health.get("agreement", float("nan")),
                    health.get("window_checks", 0), bridge.min_agreement)
        return disabled

    def flush(self) -> None:
        """Waits until every save handed to the background thread is in the store."""
        self._shared.flush()

    def shutdown(self) -> None:
        self._shared.flush()

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None):
        return KVBridgeConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KVBridgePromMetrics(vllm_config, metric_types, labelnames,
                                   per_engine_labelvalues)

    def get_kv_connector_stats(self):
        if self.role != KVConnectorRole.WORKER:
            return None
        data = self._shared.counters.take_pending()
        return KVBridgeConnectorStats(data=data) if data else None

    # ----- scheduler side (kvbridge.vllm.scheduler) ---------------------------------------

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> Tuple[int, bool]:
        return self._side(self._scheduler, "scheduler").get_num_new_matched_tokens(
            request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        self._side(self._scheduler, "scheduler").update_state_after_alloc(
            request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self._side(self._scheduler, "scheduler").build_connector_meta(scheduler_output)

    def request_finished(self, request: "Request",
                         block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        return self._side(self._scheduler, "scheduler").request_finished(request, block_ids)

    # ----- worker side (kvbridge.vllm.worker) ---------------------------------------------

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        self._side(self._worker, "worker").register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self._side(self._worker, "worker").start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # whole prompts are copied once, in wait_for_save

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        self._side(self._worker, "worker").wait_for_save(self._get_connector_metadata())

    def get_block_ids_with_load_errors(self) -> Set[int]:
        return self._side(self._worker, "worker").get_block_ids_with_load_errors()


# The connector's public names, importable from here as from their own modules.
__all__ = ["COUNTERS", "KVBridgeConnector", "KVBridgeConnectorMetadata", "OUTCOME_KEY", "SHADOW_KEY",
           "KVBridgeConnectorStats", "LoadOp", "SaveOp", "TIMERS", "check_cpu_layout", "load_into_blocks"]
