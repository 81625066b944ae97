"""The connector's worker side: loads into vLLM's paged KV cache, and saves out of it.

``start_load_kv`` (before the forward) loads each promised prefix through ``Bridge.load``
(native or converted; the connector's Bridge writes nothing back, so no store write runs inside
the engine step) and writes the promised token range into the request's blocks; whatever it
could not deliver is reported through ``get_block_ids_with_load_errors`` so that vLLM
recomputes it. Loads follow the Bridge's rules: entries naming a dropped adapter are not
served, and a conversion that gives a non-finite value is not used (the blocks are recomputed).

``wait_for_save`` (after the forward) copies each finished prompt's whole chunks out of the
paged cache, the only work decode waits for, and hands the copy to the save thread
(kvbridge.vllm.saver). A prompt whose load held KV that is not the model's own prefill
(converted, or written back from a conversion) is saved with that load's provenance (source and
adapter fingerprints), since everything computed over it derives from the adapter:
``invalidate_adapter`` and a disabled adapter purge it; with ``write_back: false`` such a prompt
is not saved at all. Saves go through ``Bridge.save``, so they follow the Bridge's rules: a save
naming an adapter the Bridge has dropped (disabled, removed, replaced) stores nothing, a drop
waits for a save of its adapter under way and then purges it, and KV holding a NaN or an
infinity is refused (counted in ``save_errors``).

KV cache groups (``check_kv_cache_groups``): the connector reads and writes every layer of a
request through one block table, and kvbridge stores every layer's KV for every prompt token. So
it needs vLLM's KV cache in one group whose layers keep every token's blocks. For models mixing
sliding-window and full-attention layers (Gemma 2/3) vLLM 0.32 does that by itself: the
connector does not declare hybrid-allocator support (``SupportsHMA``), so vLLM turns its hybrid
KV cache manager off, allocates the sliding-window layers like full-attention ones (their
kernels still attend within the window) and puts all layers in one group. A configuration with
several groups (``--no-disable-hybrid-kv-cache-manager``, which vLLM refuses with this connector
anyway) or with every layer sliding below max_model_len is refused at start.
"""
from __future__ import annotations

import collections
import logging
import re
import time
from typing import Any, Dict, List, Optional, Set, Tuple

import torch

from kvbridge import _core
from kvbridge._core import InvalidArgumentError
from kvbridge.bridge import Bridge
from kvbridge.vllm import device_load, paged
from kvbridge.vllm.metadata import KVBridgeConnectorMetadata, LoadOp, SaveOp
from kvbridge.vllm.options import ConnectorOptions
from kvbridge.vllm.registry import MAX_OUTCOMES, Shared

logger = logging.getLogger("kvbridge.vllm")


class WorkerSide:
    """The worker role's state: the registered paged KV cache, the blocks whose load failed
    since vLLM last asked, and the provenance of loads whose prompts are still to be saved."""

    def __init__(self, shared: Shared, options: ConnectorOptions, block_size: int):
        self._shared = shared
        self._spec = shared.spec
        self._options = options
        self._block_size = block_size
        self._count = shared.counters.count
        self._layers: Optional[List[Tuple[torch.Tensor, torch.Tensor]]] = None
        self._failed_blocks: Set[int] = set()
        # req_id -> (source, adapter) fingerprints of a load that held KV not the model's own;
        # its save carries them. Bounded: a request may finish without a save.
        self._derived: "collections.OrderedDict[str, Tuple[str, str]]" = collections.OrderedDict()

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
        layers = []
        for name in names:
            kv = kv_caches[name]
            if kv.dtype != want:
                raise InvalidArgumentError(f"KVBridgeConnector: layer {name} caches {kv.dtype}, the spec "
                                           f"says {self._spec.dtype}")
            layers.append(paged.kv_views(kv, layout, self._spec.head_dim))
        self._layers = layers
        logger.info("kvbridge: registered %d layers, layout %r, block size %d", len(names),
                    layout, first.shape[2])

    def start_load_kv(self, meta: Any) -> None:
        """Runs the loads of this step's metadata."""
        if not isinstance(meta, KVBridgeConnectorMetadata) or not meta.loads:
            return
        for op in meta.loads:
            self._failed_blocks |= self.load_op(op)

    def load_op(self, op: LoadOp) -> Set[int]:
        """Runs one load (counted); returns the ids of the blocks it could not fill."""
        count = self._count
        t0 = time.perf_counter()
        hit: Dict[str, Any] = {}
        loaded, converted, failed = load_into_blocks(self._shared.bridge, self._spec, self._layers,
                                                     self._block_size, op, hit)
        self._shared.put_outcome(op.req_id, {"start": op.start, "tokens_loaded": loaded,
                                             "converted": converted,
                                             "adapter": hit.get("adapter", "") if loaded else ""})
        count("loads")
        if op.shadow:
            count("shadow_loads")
        count("load_seconds", time.perf_counter() - t0)
        if loaded and hit.get("adapter") and not op.shadow:
            self._derived[op.req_id] = (hit["converted_from"], hit["adapter"])
            while len(self._derived) > MAX_OUTCOMES:
                self._derived.popitem(last=False)
        if loaded:
            count("tokens_loaded", loaded)
            count("loads_converted" if converted else "loads_native")
        if failed:
            count("load_errors")
            count("failed_blocks", len(failed))
        return failed

    def wait_for_save(self, meta: Any) -> None:
        """Copies out the prompts this step's metadata saves and queues them for the store."""
        if not isinstance(meta, KVBridgeConnectorMetadata) or not meta.saves:
            return
        for op in meta.saves:
            self.save_op(op)

    def save_op(self, op: SaveOp) -> None:
        """Copies a prompt out of the paged cache and queues it for the store."""
        # KV computed over converted KV derives from the adapter: saved with its provenance.
        # The scheduler's origin also covers blocks vLLM's prefix cache served from an earlier
        # converted request; erring towards a provenance costs at most an early purge.
        origin = self._derived.pop(op.req_id, None) or op.origin
        if origin[1] and not self._options.write_back:
            self._count("saves_skipped_derived")
            return
        try:
            if self._layers is None:
                raise RuntimeError("no KV caches registered")
            t0 = time.perf_counter()
            kv = tuple(paged.gather(keys, values, op.block_ids, len(op.tokens))
                       for keys, values in self._layers)
            self._count("save_copy_seconds", time.perf_counter() - t0)
            self._count("saves")
            self._shared.saver.submit(op.tokens, kv, op.namespace, origin)
        except Exception as e:
            self._count("save_errors")
            logger.warning("kvbridge: save of request %s failed: %s", op.req_id, e)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed


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
                and not device_load.loads_on_host(bridge, spec)):
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


__all__ = ["WorkerSide", "check_cpu_layout", "check_kv_cache_groups", "load_into_blocks"]
