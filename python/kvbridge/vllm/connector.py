"""KVBridgeConnector: kvbridge's store and Bridge as a vLLM v1 KV connector.

Scheduler side: ``get_num_new_matched_tokens`` probes the store (the model's own entries and
those of every usable adapter's source model) without converting or writing anything, and
promises the longest prefix past vLLM's own computed tokens (at most the prompt minus its last
token). ``build_connector_meta`` turns promises into load operations and, once a request's
prompt has been computed, its whole chunks into a save operation.

Worker side: ``start_load_kv`` (before the forward) loads each promised prefix through
``Bridge.load`` (native or converted; the connector's Bridge writes nothing back, so no store
write runs inside the engine step) and writes the promised token range into the request's
blocks; whatever it could not deliver is reported through ``get_block_ids_with_load_errors``
so that vLLM recomputes it. ``wait_for_save`` (after the forward) copies each finished
prompt's whole chunks out of the paged cache, the only work decode waits for, and hands the
copy to a background thread that writes it to the store. A prompt whose load held KV that is
not the model's own prefill (converted, or written back from a conversion) is saved with that
load's provenance (source and adapter fingerprints), since everything computed over it derives
from the adapter: ``invalidate_adapter`` and a disabled adapter purge it; with
``write_back: false`` such a prompt is not saved at all. Saves go through ``Bridge.save``, so
they follow the Bridge's rules: a save naming an adapter the Bridge has dropped (disabled,
removed, replaced) stores nothing, a drop waits for a save of its adapter under way and then
purges it, and KV holding a NaN or an infinity is refused (counted in ``save_errors``). Loads
follow them too: entries naming a dropped adapter are not served, and a conversion that gives a
non-finite value is not used (the blocks are recomputed).

Within one process, the scheduler-side and worker-side instances share one store and Bridge
(a registry keyed by the store options, adapters and Bridge options).

KV cache groups (``check_kv_cache_groups``): the connector reads and writes every layer of a
request through one block table, and kvbridge stores every layer's KV for every prompt token. So
it needs vLLM's KV cache in one group whose layers keep every token's blocks. For models mixing
sliding-window and full-attention layers (Gemma 2/3) vLLM 0.32 does that by itself: the
connector does not declare hybrid-allocator support (``SupportsHMA``), so vLLM turns its hybrid
KV cache manager off, allocates the sliding-window layers like full-attention ones (their
kernels still attend within the window) and puts all layers in one group. A configuration with
several groups (``--no-disable-hybrid-kv-cache-manager``, which vLLM refuses with this connector
anyway) or with every layer sliding below max_model_len is refused at start.

Across tokenizers: an adapter whose source model has another tokenizer (one fitted on aligned
samples) needs both tokenizers: the engine's (its tokenizer folder) and the source's (the
``tokenizers`` option, or the folder kvbridge.models converted the source into), registered
with the Bridge (``register_tokenizers``). Loads then go through ``Bridge.load``, which decodes
the engine's token ids to text, tokenizes it with the source tokenizer, finds the source's
cached prefix and converts the aligned target tokens. The scheduler probes such a load by
running it (``Bridge.load`` without KV: it converts, writes nothing), since the aligned length
depends on both tokenizations; the worker converts again to fill the blocks.

Quality (kvbridge.vllm.shadow): a request whose ``kv_transfer_params`` hold
``{"kvbridge_shadow": {"role": "own"}}`` is served by the model's own prefill (nothing is
promised); one with ``{"kvbridge_shadow": {"role": "converted", "namespace": ns, "positions": p}}``
loads from namespace `ns` at most its prompt's length minus `p` tokens. Neither is saved. A
finished request that ran a load reports ``{"kvbridge": {"namespace", "start", "tokens_loaded",
"converted", "adapter"}}`` in its output's kv_transfer_params (tokens [start, start +
tokens_loaded) were loaded; adapter: the fingerprint behind converted or written-back tokens,
"" for the model's own KV). Adapters the Bridge has disabled (its rolling shadow-check agreement fell
below min_agreement) are not probed, so their loads fall back to the model's own prefill.
"""
from __future__ import annotations

import atexit
import collections
import os
import dataclasses
import logging
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                                KVConnectorMetadata,
                                                                KVConnectorRole)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (KVConnectorPromMetrics,
                                                                   KVConnectorStats)

from kvbridge import _core, specs
from kvbridge.adapter import LinearAdapter
from kvbridge.bridge import Bridge
from kvbridge.store import KVStore
from kvbridge.vllm import device_load, paged
from kvbridge.vllm.options import ConnectorOptions, engine_spec, parse_options
from kvbridge._core import InvalidArgumentError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("kvbridge.vllm")

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
#: Key of a request's kv_transfer_params marking a shadow-check twin (module docstring).
SHADOW_KEY = "kvbridge_shadow"
#: Key of the load outcome in a finished request's kv_transfer_params.
OUTCOME_KEY = "kvbridge"
#: Load outcomes kept for the scheduler to report (a bound: with a worker in another process
#: nothing collects them).
_MAX_OUTCOMES = 4096
TIMERS = ("lookup_seconds", "load_seconds", "save_copy_seconds", "save_seconds")


class _Shared:
    """One process's store, Bridge, counters and save thread for one connector config."""

    def __init__(self, options: ConnectorOptions, spec: _core.ModelSpec,
                 tokenizer_folder: Optional[str] = None):
        self.spec = spec
        self.options = options
        self.lock = threading.Lock()
        self.totals: Dict[str, float] = {k: 0 for k in COUNTERS + TIMERS}
        self.pending: Dict[str, float] = {k: 0 for k in COUNTERS + TIMERS}
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
            self.count("store_unavailable")
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
        self.outcomes: "collections.OrderedDict[str, Dict[str, Any]]" = collections.OrderedDict()
        self._saves: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._saver = threading.Thread(target=self._save_loop, name="kvbridge-save",
                                       daemon=True)
        self._saver.start()

    def count(self, name: str, value: float = 1) -> None:
        with self.lock:
            self.totals[name] += value
            self.pending[name] += value

    def usable_adapters(self) -> List[LinearAdapter]:
        """The gated adapters the Bridge has not disabled (from models with the served model's
        tokenizer and from others alike)."""
        if not self.gated:
            return []
        enabled = {h["adapter"] for h in self.bridge.adapter_health() if h["enabled"]}
        return [a for a in self.gated if a.fingerprint in enabled]

    def put_outcome(self, req_id: str, outcome: Dict[str, Any]) -> None:
        with self.lock:
            self.outcomes[req_id] = outcome
            self.outcomes.move_to_end(req_id)
            while len(self.outcomes) > _MAX_OUTCOMES:
                self.outcomes.popitem(last=False)

    def pop_outcome(self, req_id: str) -> Optional[Dict[str, Any]]:
        with self.lock:
            return self.outcomes.pop(req_id, None)

    def take_pending(self) -> Dict[str, float]:
        with self.lock:
            out = {k: v for k, v in self.pending.items() if v}
            for k in self.pending:
                self.pending[k] = 0
        return out

    def submit_save(self, tokens: List[int], kv: tuple, namespace: str,
                    origin: Tuple[str, str] = ("", "")) -> None:
        """Queues a save; origin: (source, adapter) fingerprints of KV that derives from a
        conversion, ("", "") for the model's own."""
        self._saves.put((tokens, kv, namespace, origin))

    def flush(self) -> None:
        """Waits until every submitted save has been written."""
        self._saves.join()

    def _save_loop(self) -> None:
        while True:
            item = self._saves.get()
            try:
                tokens, kv, namespace, (converted_from, adapter) = item
                t0 = time.perf_counter()
                # The Bridge refuses a dropped adapter's KV, and a drop waits for this put.
                saved = self.bridge.save(self.spec, tokens, kv, namespace,
                                         converted_from=converted_from, adapter=adapter)
                if adapter and saved == 0 and self.bridge.adapter_dropped(adapter):
                    self.count("saves_purged")
                self.count("save_seconds", time.perf_counter() - t0)
                self.count("tokens_saved", saved)
            except Exception as e:  # a save never affects the request
                self.count("save_errors")
                logger.warning("kvbridge: save failed: %s", e)
            finally:
                self._saves.task_done()


def _spec_fields(spec: _core.ModelSpec) -> dict:
    return {k: getattr(spec, k) for k in ("name", "num_layers", "num_kv_heads", "head_dim",
                                          "dtype", "version", "tokenizer", "rope_base",
                                          "rope_style")}


def _load_tokenizer(folder: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def source_tokenizers(adapters: List[LinearAdapter], folders: Tuple[str, ...]) -> Dict[str, str]:
    """The tokenizer folder of each adapter source, by tokenizer id: the given `folders`
    (the ``tokenizers`` option), then the folder kvbridge.models converted the source into
    (``models_dir()/<source name>``), each taken for the tokenizer id of its files
    (kvbridge.specs.tokenizer_id), so a folder is used only for the tokenizer it really holds.
    Raises InvalidArgumentError naming the option for a source with no folder found."""
    from kvbridge import models

    found: Dict[str, str] = {}
    candidates = list(folders) + [str(models.models_dir() / a.source.name) for a in adapters]
    for folder in candidates:
        tid = specs.tokenizer_id(folder)
        if tid is not None:
            found.setdefault(tid, folder)
    out: Dict[str, str] = {}
    for a in adapters:
        folder = found.get(a.source.tokenizer)
        if folder is None:
            raise InvalidArgumentError(
                f"KVBridgeConnector: adapter {a.source.name} -> {a.target.name} converts from "
                f"another tokenizer (id {a.source.tokenizer!r}); give the folder holding "
                f"{a.source.name}'s tokenizer files in the 'tokenizers' option (searched: "
                f"{candidates})")
        out[a.source.tokenizer] = folder
    return out


def register_tokenizers(bridge: Bridge, spec: _core.ModelSpec, tokenizer_folder: Optional[str],
                        adapters: List[LinearAdapter], folders: Tuple[str, ...]) -> None:
    """Registers (Bridge.add_tokenizer) the served model's tokenizer, from the engine's
    tokenizer folder, and the sources' of `adapters` (adapters from another tokenizer; see
    source_tokenizers), so that Bridge.load serves the engine's token ids from their caches:
    the prompt's text is the engine tokenizer's decoding, and the source tokenization is found
    as Bridge.load does (kvbridge.bridge). Raises InvalidArgumentError when the engine's
    tokenizer folder is missing or holds another tokenizer than the spec's."""
    own = specs.tokenizer_id(tokenizer_folder) if tokenizer_folder else None
    if own is None:
        raise InvalidArgumentError(
            f"KVBridgeConnector: adapters from other tokenizers need the served model's tokenizer "
            f"files; the engine's tokenizer {tokenizer_folder!r} is not a local folder holding them")
    if own != spec.tokenizer:
        raise InvalidArgumentError(
            f"KVBridgeConnector: the engine's tokenizer folder {tokenizer_folder} has tokenizer id "
            f"{own!r}, but the served spec says {spec.tokenizer!r} (a 'tokenizer' override?); "
            "loads across tokenizers need the tokenizer the spec names")
    bridge.add_tokenizer(spec, _load_tokenizer(tokenizer_folder))
    found = source_tokenizers(adapters, folders)
    loaded = {tid: _load_tokenizer(folder) for tid, folder in found.items()}
    for a in adapters:
        bridge.add_tokenizer(a.source, loaded[a.source.tokenizer])
    logger.info("kvbridge: tokenizers registered for loads across tokenizers: %s",
                {a.source.name: found[a.source.tokenizer] for a in adapters})


_REGISTRY: Dict[tuple, _Shared] = {}
_REGISTRY_LOCK = threading.Lock()


def _shared(options: ConnectorOptions, spec: _core.ModelSpec,
            tokenizer_folder: Optional[str] = None) -> _Shared:
    key = (options.store, options.adapters, options.tokenizers, options.min_quality,
           options.write_back, options.quality, spec.fingerprint, tokenizer_folder)
    with _REGISTRY_LOCK:
        found = _REGISTRY.get(key)
        if found is None:
            found = _REGISTRY[key] = _Shared(options, spec, tokenizer_folder)
        return found


@atexit.register
def _flush_all() -> None:
    for shared in list(_REGISTRY.values()):
        shared.flush()


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


@dataclass
class _ReqState:
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


_LAYER_INDEX = re.compile(r"(\d+)")


def _layer_index(name: str) -> int:
    found = _LAYER_INDEX.findall(name)
    if not found:
        raise InvalidArgumentError(f"KVBridgeConnector: no layer index in attention layer name {name!r}")
    return int(found[-1])


def load_into_blocks(bridge: Bridge, spec: _core.ModelSpec,
                     layers: Optional[List[Tuple[torch.Tensor, torch.Tensor]]], block_size: int,
                     op: LoadOp, hit_info: Optional[Dict[str, Any]] = None
                     ) -> Tuple[int, bool, Set[int]]:
    """Loads op.tokens' prefix through `bridge` and writes tokens [op.start, op.stop) into
    op.block_ids of `layers` (one paged.kv_views pair per layer).

    Returns (tokens written, whether converted, ids of the blocks holding promised tokens that
    were not written: every block from the first missing token's to op.stop's). Never raises:
    a failing store, a corrupt entry, a failed conversion or a shorter prefix than promised
    is a partial or empty load. hit_info, if given, receives the load's "converted_from" and
    "adapter" fingerprints (Load's: set for converted tokens and for written-back ones, ""
    otherwise).
    """
    got, converted = 0, False
    try:
        if layers is None:
            raise RuntimeError("no KV caches registered")
        if (device_load.wants_device_load(layers)  # convert on the cache's device
                and not device_load.across_tokenizers(bridge, spec)):
            hit = device_load.load(bridge, spec, op.tokens, op.namespace, layers[0][0].device)
        else:
            hit = bridge.load(spec, op.tokens, op.namespace)
        got, converted = min(hit.tokens, op.stop), hit.converted
        if hit_info is not None:
            hit_info.update(converted_from=hit.converted_from, adapter=hit.adapter)
        if got > op.start:
            for (keys, values), (k, v) in zip(layers, hit.kv):
                paged.scatter(keys, values, op.block_ids, op.start, k[:, :, op.start:got],
                              v[:, :, op.start:got])
    except Exception as e:  # any failure: the blocks are recomputed
        logger.warning("kvbridge: load of request %s failed: %s", op.req_id, e)
        got = 0
    if got >= op.stop:
        return op.stop - op.start, converted, set()
    first = max(got, op.start) // block_size
    failed = set(op.block_ids[first:-(-op.stop // block_size)])
    logger.warning("kvbridge: request %s: %d of %d promised tokens loaded; %d blocks reported "
                   "for recomputation", op.req_id, max(0, got - op.start), op.stop - op.start,
                   len(failed))
    return max(0, got - op.start), converted, failed


def check_kv_cache_groups(kv_cache_config: Any, max_model_len: Optional[int] = None) -> None:
    """Refuses a KV cache configuration the connector cannot copy whole prompts out of and into.

    The rule: one KV cache group (one block table for every attention layer), whose layers keep
    the blocks of every token of a request. kvbridge stores and serves every layer's KV for
    every prompt token (a prefix of any length is then loadable, and a converted one as well),
    so a layer that drops the blocks of tokens outside its sliding window cannot be saved and
    one block table must address every layer. vLLM gives exactly that for hybrid models such as
    Gemma 3 (sliding-window and full-attention layers): with a connector that does not declare
    hybrid-allocator support (``SupportsHMA``), as this one, it turns the hybrid KV cache
    manager off, every sliding-window layer is then allocated as a full-attention one (its
    kernel still attends within its window only) and all layers share one group. Passing
    ``--no-disable-hybrid-kv-cache-manager`` makes vLLM refuse the connector. A model whose
    layers all slide (one group of sliding-window layers, which the hybrid manager does not
    change) is refused when its window is shorter than max_model_len: its blocks past the window
    are freed while the request runs.
    """
    if kv_cache_config is None:
        return
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) > 1:
        raise InvalidArgumentError(
            f"KVBridgeConnector: vLLM made {len(groups)} KV cache groups "
            f"({[type(g.kv_cache_spec).__name__ for g in groups]}); the connector needs one block "
            "table for every layer: keep vLLM's hybrid KV cache manager off "
            "(--disable-hybrid-kv-cache-manager; vLLM does so by itself for this connector)")
    for group in groups:
        spec = group.kv_cache_spec
        # A FullAttentionSpec keeps every token's blocks (also one promoted from a sliding
        # window, which keeps its sliding_window field for the kernel).
        if any(c.__name__ == "FullAttentionSpec" for c in type(spec).__mro__):
            continue
        window = getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size",
                                                                   None)
        if window and max_model_len is not None and int(window) >= int(max_model_len):
            continue  # no request outgrows the window: every block stays
        raise InvalidArgumentError(
            f"KVBridgeConnector: the attention layers' KV cache ({type(spec).__name__}, window "
            f"{window}) does not keep every token's blocks up to max_model_len {max_model_len}; "
            "kvbridge saves and loads every token of every layer (a max_model_len of at most "
            "the window would)")


def check_cpu_layout(dtype: torch.dtype, heads: int, block_size: int, head_dim: int) -> None:
    """Writes one block of seeded random KV with vLLM's own CPU cache-write op (the ISA the
    backend picks for this dtype, block size and head dim) and checks that paged's "cpu" layout
    reads it back exactly; raises ValueError naming the ISA otherwise."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block_size, head_dim)
    scratch = torch.zeros(1, heads, block_size, 2 * head_dim, dtype=dtype)
    key_cache, value_cache = scratch.view(1, heads, 2 * block_size, head_dim).chunk(2, dim=2)
    gen = torch.Generator().manual_seed(7)
    key = torch.randn(block_size, heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(block_size, heads, head_dim, generator=gen).to(dtype)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache,
                                   torch.arange(block_size, dtype=torch.long), isa)
    keys, values = paged.kv_views(scratch, "cpu", head_dim)
    k, v = paged.gather(keys, values, [0], block_size)
    if not (torch.equal(k[0].transpose(0, 1), key) and torch.equal(v[0].transpose(0, 1), value)):
        raise InvalidArgumentError(f"KVBridgeConnector: vLLM's CPU attention ISA {isa!r} ({dtype}, block "
                                   f"size {block_size}, head dim {head_dim}) lays out its KV blocks in a "
                                   "way kvbridge.vllm.paged does not read; this combination is not "
                                   "supported")


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
        self._block_size = int(vllm_config.cache_config.block_size)
        self._options = parse_options(tc.kv_connector_extra_config, self._block_size)
        mc = vllm_config.model_config
        self._spec = engine_spec(mc.hf_text_config, mc.model, mc.tokenizer,
                                 mc.served_model_name, mc.dtype,
                                 vllm_config.cache_config.cache_dtype, self._options)
        check_kv_cache_groups(kv_cache_config, getattr(mc, "max_model_len", None))
        tokenizer = mc.tokenizer if mc.tokenizer and os.path.isdir(str(mc.tokenizer)) else None
        self._shared = _shared(self._options, self._spec, tokenizer)
        self._chunk = self._shared.store.chunk_tokens
        # scheduler side
        self._reqs: Dict[str, _ReqState] = {}
        # worker side
        self._layers: Optional[List[Tuple[torch.Tensor, torch.Tensor]]] = None
        self._failed_blocks: Set[int] = set()
        # req_id -> (source, adapter) fingerprints of a load that held KV not the model's own;
        # its save carries them. Bounded: a request may finish without a save.
        self._derived: "collections.OrderedDict[str, Tuple[str, str]]" = collections.OrderedDict()
        logger.info("kvbridge: %s connector for %s (fingerprint %s), chunk %d tokens",
                    role.name.lower(), self._spec.name, self._spec.fingerprint, self._chunk)

    # ----- shared -------------------------------------------------------------------------

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
        with self._shared.lock:
            out: Dict[str, Any] = dict(self._shared.totals)
        out["bridge"] = self._shared.bridge.stats()
        out["store"] = self._shared.store.stats()
        out["adapters"] = {h["adapter"]: h for h in self._shared.bridge.adapter_health()}
        return out

    def record_checks(self, checks: List[Tuple[str, Any]]) -> List[str]:
        """Records shadow checks, (adapter fingerprint, kvbridge.monitor.Check) pairs, in the
        Bridge (which keeps the rolling figures and disables an adapter below the floor);
        returns the fingerprints this call disabled. Checks of adapters no longer registered
        are dropped."""
        bridge = self._shared.bridge
        disabled: List[str] = []
        for fingerprint, check in checks:
            try:
                off = bridge.record_check(fingerprint, check)
            except _core.NotFoundError:
                logger.warning("kvbridge: shadow check of unregistered adapter %s dropped",
                               fingerprint)
                continue
            self._shared.count("shadow_checks")
            if off:
                self._shared.count("shadow_disables")
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
        data = self._shared.take_pending()
        return KVBridgeConnectorStats(data=data) if data else None

    # ----- scheduler side -----------------------------------------------------------------

    def _namespace(self, request: "Request") -> str:
        params = getattr(request, "kv_transfer_params", None) or {}
        ns = params.get("namespace") or self._options.namespace
        salt = getattr(request, "cache_salt", None)
        return f"{ns}\x1fsalt={salt}" if salt else str(ns)

    def _keyable_tokens(self, request: "Request") -> Optional[List[int]]:
        if (request.prompt_token_ids is None or getattr(request, "mm_features", None)
                or getattr(request, "lora_request", None) is not None):
            return None
        return list(request.prompt_token_ids)

    def _shadow(self, request: "Request") -> Tuple[str, Optional[str], int]:
        """(role, namespace, positions) of a shadow-check twin; ("", None, 0) otherwise."""
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

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> Tuple[int, bool]:
        state = self._reqs.get(request.request_id)
        if state is None:
            tokens = self._keyable_tokens(request)
            if tokens is None:
                self._shared.count("requests_skipped")
                return 0, False
            role, shadow_ns, positions = self._shadow(request)
            if role == "own":  # the model's own prefill: nothing promised, nothing saved
                state = self._reqs[request.request_id] = _ReqState(tokens, "", 0, 0,
                                                                   shadow=role)
                return 0, False
            t0 = time.perf_counter()
            ns = shadow_ns or self._namespace(request)
            store = self._shared.store
            native = best = 0
            origin = ("", "")
            if len(tokens) > 1:
                bridge = self._shared.bridge
                found = store.match(self._spec, tokens, ns, return_kv=False)
                # Entries naming a dropped adapter are not served: promise none of a prefix
                # holding one (the load serves what comes before it, if anything).
                native = best = 0 if bridge.adapter_dropped(found.adapter) else found.tokens
                limit = len(tokens) - 1
                if found.adapter and native:
                    # Written-back entries keep their adapter's tail, as the worker's load
                    # (device_load.load) cuts them: promise no more than it will load.
                    tail = device_load.tail_of(bridge, found.adapter)
                    if tail > 0:
                        native = best = max(0, min(native, limit - tail))
                origin = (found.converted_from, found.adapter) if native else ("", "")
                usable = self._shared.usable_adapters()
                for adapter in usable:
                    if adapter.source.tokenizer != self._spec.tokenizer:
                        continue  # another tokenizer's ids: probed below
                    source = store.match(adapter.source, tokens, ns, return_kv=False)
                    length = 0 if bridge.adapter_dropped(source.adapter) else source.tokens
                    tail = bridge.recompute_tail_for(adapter)
                    if tail > 0:  # the adapter's tail stays with the engine
                        length = min(length, limit - tail)
                    if length > best:
                        best = length
                        origin = (adapter.source.fingerprint, adapter.fingerprint)
                if any(a.source.tokenizer != self._spec.tokenizer for a in usable):
                    # Across tokenizers the aligned length depends on the text's tokenization
                    # under each source tokenizer and on the adapter's alignment: the probe is
                    # the Bridge's own load (it converts; its Bridge writes nothing back).
                    try:
                        found = bridge.load(self._spec, tokens, ns, return_kv=False)
                        if found.tokens > best:
                            best = found.tokens
                            origin = (found.converted_from, found.adapter)
                    except Exception as e:  # a probe never fails the request
                        logger.warning("kvbridge: probe across tokenizers of request %s "
                                       "failed: %s", request.request_id, e)
            self._shared.count("lookups")
            self._shared.count("lookup_seconds", time.perf_counter() - t0)
            if best > native:
                self._shared.count("lookup_hits_converted")
            elif native:
                self._shared.count("lookup_hits_native")
            # vLLM computes at least the last prompt token itself; a converted twin leaves its
            # last `positions` tokens to be computed over the loaded prefix.
            cap = len(tokens) - max(1, positions)
            state = self._reqs[request.request_id] = _ReqState(tokens, ns, native, best,
                                                               shadow=role, cap=cap,
                                                               origin=origin)
        usable = min(state.best, state.cap)
        return max(0, usable - num_computed_tokens), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        state = self._reqs.get(request.request_id)
        if state is not None and num_external_tokens > 0:
            state.external = int(num_external_tokens)
            self._shared.count("tokens_promised", num_external_tokens)

    def _plan(self, meta: KVBridgeConnectorMetadata, req_id: str, state: _ReqState,
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

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
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

    # ----- worker side --------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        names = sorted(kv_caches, key=_layer_index)
        if len(names) != self._spec.num_layers:
            raise InvalidArgumentError(f"KVBridgeConnector: {len(names)} attention layers with a KV "
                                       f"cache, but {self._spec.name} has {self._spec.num_layers}")
        first = kv_caches[names[0]]
        layout = self._options.layout or ("cpu" if first.device.type == "cpu" else "split")
        if layout == "cpu":
            check_cpu_layout(first.dtype, int(first.shape[1]), int(first.shape[2]),
                             self._spec.head_dim)
        want = getattr(torch, self._spec.dtype)
        self._layers = []
        for name in names:
            kv = kv_caches[name]
            if kv.dtype != want:
                raise InvalidArgumentError(f"KVBridgeConnector: layer {name} caches {kv.dtype}, the spec "
                                           f"says {self._spec.dtype}")
            self._layers.append(paged.kv_views(kv, layout, self._spec.head_dim))
        logger.info("kvbridge: registered %d layers, layout %r, block size %d", len(names),
                    layout, first.shape[2])

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVBridgeConnectorMetadata) or not meta.loads:
            return
        for op in meta.loads:
            self._failed_blocks |= self.load_op(op)

    def load_op(self, op: LoadOp) -> Set[int]:
        """Runs one load (counted); returns the ids of the blocks it could not fill."""
        shared = self._shared
        t0 = time.perf_counter()
        hit: Dict[str, Any] = {}
        loaded, converted, failed = load_into_blocks(shared.bridge, self._spec, self._layers,
                                                     self._block_size, op, hit)
        shared.put_outcome(op.req_id, {"start": op.start, "tokens_loaded": loaded,
                                       "converted": converted,
                                       "adapter": hit.get("adapter", "") if loaded else ""})
        shared.count("loads")
        if op.shadow:
            shared.count("shadow_loads")
        shared.count("load_seconds", time.perf_counter() - t0)
        if loaded and hit.get("adapter") and not op.shadow:
            self._derived[op.req_id] = (hit["converted_from"], hit["adapter"])
            while len(self._derived) > _MAX_OUTCOMES:
                self._derived.popitem(last=False)
        if loaded:
            shared.count("tokens_loaded", loaded)
            shared.count("loads_converted" if converted else "loads_native")
        if failed:
            shared.count("load_errors")
            shared.count("failed_blocks", len(failed))
        return failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # whole prompts are copied once, in wait_for_save

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVBridgeConnectorMetadata) or not meta.saves:
            return
        for op in meta.saves:
            self.save_op(op)

    def save_op(self, op: SaveOp) -> None:
        """Copies a prompt out of the paged cache and queues it for the store."""
        shared = self._shared
        # KV computed over converted KV derives from the adapter: saved with its provenance.
        # The scheduler's origin also covers blocks vLLM's prefix cache served from an earlier
        # converted request; erring towards a provenance costs at most an early purge.
        origin = self._derived.pop(op.req_id, None) or op.origin
        if origin[1] and not self._options.write_back:
            shared.count("saves_skipped_derived")
            return
        try:
            if self._layers is None:
                raise RuntimeError("no KV caches registered")
            t0 = time.perf_counter()
            kv = tuple(paged.gather(keys, values, op.block_ids, len(op.tokens))
                       for keys, values in self._layers)
            shared.count("save_copy_seconds", time.perf_counter() - t0)
            shared.count("saves")
            shared.submit_save(op.tokens, kv, op.namespace, origin)
        except Exception as e:
            shared.count("save_errors")
            logger.warning("kvbridge: save of request %s failed: %s", op.req_id, e)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed


__all__ = ["COUNTERS", "KVBridgeConnector", "KVBridgeConnectorMetadata", "OUTCOME_KEY", "SHADOW_KEY",
           "KVBridgeConnectorStats", "LoadOp", "SaveOp", "TIMERS", "check_cpu_layout", "load_into_blocks"]
