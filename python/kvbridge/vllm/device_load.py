"""Converted loads on the paged cache's device: the source model's KV goes to the device as
stored and the adapter converts it there (on CUDA: kvbridge's CUDA convert), instead of
``Bridge.load`` converting on the CPU and the connector copying the result over.

`load` follows the Bridge's load policy (include/kvbridge/bridge.h) for the adapters a
connector registers, which all share the served model's tokenizer:

- candidates: the model's own cached prefix ``p_T`` and, for every registered adapter to
  exactly this spec with the same non-empty tokenizer id, quality >= ``bridge.min_quality``
  and enabled (``bridge.adapter_health()``), its source's cached prefix ``p_S``, cut to
  ``n - 1 - r`` when the adapter's tail ``r = bridge.recompute_tail_for(adapter, n)`` is > 0
  (the Bridge's option, or the adapter's recorded serving tail for an n-token prompt);
- the longest wins; a converted one must be strictly longer than the native one; ties go to
  the higher quality, then to the earlier registered adapter;
- native tokens ``[0, p_T)`` are kept as stored, source tokens ``[p_T, p_S)`` are converted
  with ``start_pos = p_T``;
- at most ``n - 1`` tokens are returned. Like the Bridge, a whole cached prompt is converted
  to ``p_S = n`` and then cut: the map is per token, but a GEMM's rounding depends on how many
  rows it is given (Eigen's row blocking), so converting ``n - 1`` rows would differ from
  ``Bridge.load`` in the last bits of the last rows.

It follows the Bridge's integrity rules: a cached prefix whose provenance names an adapter the
Bridge has dropped (``bridge.adapter_dropped``) is not used (the model's own prefix: none of it;
a source prefix: that candidate is skipped), a conversion whose output holds a NaN or an
infinity is not used (the load falls back to the native prefix), and neither is one whose
adapter the Bridge dropped while it converted.

Like ``Bridge.load`` (whose native load applies the rule, include/kvbridge/bridge.h), a load
holding KV that is not the model's own prefill takes the first token's KV from the model's own
where the Bridge knows it (``Bridge.add_start``; the connector's Bridge learns it from the
engine's own saves): it asks the Bridge's native registry through ``Bridge._own_start``.

It writes nothing back, like the connector's ``Bridge`` (built with ``write_back=False``): the
connector saves the request's blocks afterwards, in the background, with the provenance this
load reports (``converted_from``, ``adapter``). The Bridge's own counters (``converted_hits``,
``convert_seconds``) do not see these conversions; the connector's counters
(``loads_converted``, ``load_seconds``) do.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch

from kvbridge import _core
from kvbridge.adapter import LinearAdapter
from kvbridge.bridge import Bridge

KVPairs = Tuple[Tuple[torch.Tensor, torch.Tensor], ...]


@dataclass(frozen=True)
class DeviceLoad:
    """The result of `load`.

    tokens: prompt tokens whose KV is in `kv` (0 on a miss, at most len(tokens) - 1).
    kv: one (keys, values) pair per layer of the served model, ``[1, kv_heads, tokens,
        head_dim]``, its dtype, on the requested device; None on a miss.
    converted: True when tokens [native_tokens, tokens) were converted through an adapter.
    native_tokens: how many of `tokens` came from the model's own entries.
    source: name of the model whose cache served the last token ("" on a miss).
    converted_from, adapter: fingerprints of the source model and the adapter behind the tokens
        that are not the model's own prefill (as Bridge.load's Load): the conversion's, or
        those of written-back entries in a native hit; "" when every token is the model's own.
    """

    tokens: int
    kv: Optional[KVPairs]
    converted: bool
    native_tokens: int
    source: str
    converted_from: str = ""
    adapter: str = ""


def _candidates(bridge: Bridge, spec: _core.ModelSpec) -> List[Tuple[LinearAdapter, float]]:
    """(adapter, quality) of every adapter the Bridge would consider for `spec`, in
    registration order."""
    enabled = {h["adapter"]: bool(h["enabled"]) for h in bridge.adapter_health()}
    out = []
    for adapter in bridge.adapters():
        if adapter.target.fingerprint != spec.fingerprint:
            continue
        if not spec.tokenizer or adapter.source.tokenizer != spec.tokenizer:
            continue  # across tokenizers the Bridge needs a registered tokenizer: none here
        quality = Bridge.quality(adapter)
        if not quality >= bridge.min_quality or not enabled.get(adapter.fingerprint, False):
            continue
        out.append((adapter, quality))
    return out


def _to(kv: Sequence[Tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> KVPairs:
    return tuple((k.to(device), v.to(device)) for k, v in kv)


def load(bridge: Bridge, spec: _core.ModelSpec, tokens: Sequence[int], namespace: str,
         device: Union[str, torch.device]) -> DeviceLoad:
    """The longest usable prefix of `tokens` for `spec` (see the module docstring), its KV on
    `device`; a converted part is converted there. Raises what the store or the adapter
    raises (the connector turns that into blocks to recompute)."""
    device = torch.device(device)
    store = bridge.store
    n = len(tokens)
    limit = n - 1  # the engine computes at least the last prompt token itself
    if limit <= 0:
        return DeviceLoad(0, None, False, 0, "")
    native = store.match(spec, tokens, namespace)
    # Python's Match names only its first converted chunk's adapter: when that one is dropped,
    # none of the prefix is used (the Bridge keeps the chunks before it; this is the safe side).
    native_len = 0 if bridge.adapter_dropped(native.adapter) else min(native.tokens, limit)
    if native.adapter and native_len:
        # Written-back entries keep their adapter's tail. The Bridge never cuts the model's own
        # chunks before them; Python's Match does not say where they end, so cut it all (the
        # safe side: less served, never a converted token inside the tail).
        tail = tail_of(bridge, native.adapter, n)
        if tail > 0:
            native_len = max(0, min(native_len, limit - tail))

    def converted_rows(source_len: int, tail: int) -> int:  # the source prefix the Bridge converts
        return source_len if tail == 0 else min(source_len, limit - tail)

    def converted_end(source_len: int, tail: int) -> int:  # the tokens of it a load returns
        return min(converted_rows(source_len, tail), limit)

    best: Optional[Tuple[LinearAdapter, float, int]] = None
    if native_len < limit:
        for adapter, quality in _candidates(bridge, spec):
            probe = store.match(adapter.source, tokens, namespace, return_kv=False)
            if bridge.adapter_dropped(probe.adapter):
                continue
            length = converted_end(probe.tokens, bridge.recompute_tail_for(adapter, n))
            if length <= native_len:
                continue
            if best is not None and (length < best[2] or (length == best[2] and
                                                          quality <= best[1])):
                continue
            best = (adapter, quality, length)

    if best is not None:
        adapter = best[0]
        # Read again with the KV: another process may have evicted part of it since the probe.
        found = store.match(adapter.source, tokens, namespace, device=device)
        converted_len = converted_rows(0 if bridge.adapter_dropped(found.adapter)
                                       else found.tokens, bridge.recompute_tail_for(adapter, n))
        end = min(converted_len, limit)
        converted = None
        if end > native_len:
            source = [(k[:, :, native_len:converted_len], v[:, :, native_len:converted_len])
                      for k, v in found.kv]
            converted = adapter.convert(source, start_pos=native_len, as_cache=False,
                                        target_ids=tokens[native_len:converted_len],
                                        previous_ids=tokens[max(0, native_len - 8):native_len])
            finite = torch.stack([torch.isfinite(k).all() & torch.isfinite(v).all()
                                  for k, v in converted]).all()  # one device sync
            if not bool(finite) or bridge.adapter_dropped(adapter.fingerprint):
                converted = None  # non-finite, or dropped meanwhile: the native prefix only
        if converted is not None:
            if converted_len > end:
                converted = [(k[:, :, :end - native_len], v[:, :, :end - native_len])
                             for k, v in converted]
            if native_len > 0:
                head = _to(((k[:, :, :native_len], v[:, :, :native_len])
                            for k, v in native.kv), device)
                kv = tuple((torch.cat((hk, ck), dim=2), torch.cat((hv, cv), dim=2))
                           for (hk, hv), (ck, cv) in zip(head, converted))
            else:
                kv = tuple(converted)
            # As Bridge.load: the model's own start-token KV where it knows one (add_start).
            kv = tuple(bridge._own_start(spec, tokens, [(k, v) for k, v in kv]))
            return DeviceLoad(end, kv, True, native_len, adapter.source.name,
                              adapter.source.fingerprint, adapter.fingerprint)

    if native_len == 0:
        return DeviceLoad(0, None, False, 0, "")
    kv = tuple((k[:, :, :native_len].to(device, copy=True),
                v[:, :, :native_len].to(device, copy=True)) for k, v in native.kv)
    if native.adapter:  # written back by a conversion: as Bridge.load, the own start token
        kv = tuple(bridge._own_start(spec, tokens, list(kv)))
    return DeviceLoad(native_len, kv, False, native_len, spec.name, native.converted_from,
                      native.adapter)


def loads_on_host(bridge: Bridge, spec: _core.ModelSpec) -> bool:
    """True when an adapter to `spec` is registered that only the CPU path can serve: one from
    another tokenizer (Bridge.load aligns the tokenizations), one with the target's key norm or
    one taking the target's token codes (the CUDA convert does neither yet). The connector then
    loads through Bridge.load, not through `load`."""
    return any(a.target.fingerprint == spec.fingerprint
               and (a.source.tokenizer != spec.tokenizer or a.key_norm is not None
                    or a.has_token_codes)
               for a in bridge.adapters())


def tail_of(bridge: Bridge, adapter_fingerprint: str, prompt_tokens: int) -> int:
    """The tail, for a prompt of `prompt_tokens` tokens, of entries whose provenance names this
    adapter (as the Bridge's: the option, or the registered adapter's recorded tail for that
    length, 0 for one not registered)."""
    if bridge.recompute_tail >= 0:
        return bridge.recompute_tail
    for adapter in bridge.adapters():
        if adapter.fingerprint == adapter_fingerprint:
            return bridge.recompute_tail_for(adapter, prompt_tokens)
    return 0


def wants_device_load(layers: Optional[Sequence[Tuple[torch.Tensor, torch.Tensor]]]) -> bool:
    """True when the paged cache is on a CUDA device (converted KV is then made there)."""
    return bool(layers) and layers[0][0].device.type == "cuda"


__all__ = ["DeviceLoad", "load", "loads_on_host", "tail_of", "wants_device_load"]
