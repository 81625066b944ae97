"""The Bridge: a model's own prompt cache, or another model's converted through an adapter."""
from __future__ import annotations

from dataclasses import dataclass
import inspect
import logging
import textwrap
import threading
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from kvbridge import _args, _core
from kvbridge._tensors import _TORCH_DTYPES, KVCache, as_tokens, empty_kv, host_kv, kv_views
from kvbridge.hf import legacy_to_cache
from kvbridge.adapter import LinearAdapter
from kvbridge.align import token_offsets
from kvbridge.store import KVStore

log = logging.getLogger("kvbridge.bridge")


@dataclass(frozen=True)
class Load:
    """The result of Bridge.load.

    tokens: prompt tokens whose KV is returned (0 on a miss, at most len(tokens) - 1: the model
        always computes at least the last prompt token itself).
    kv: their KV cache (legacy tuple, or a transformers DynamicCache when asked for; batch 1,
        fresh tensors the caller owns), None on a miss.
    source: name of the model whose cache served it ("" on a miss).
    converted: True when any token was converted through an adapter.
    native_tokens: how many of `tokens` came from the model's own cache.
    quality: the adapter's quality when converted (see Bridge), else NaN.
    converted_from, adapter: fingerprints of the source model and of the adapter behind the
        tokens that are not the model's own prefill: set for a conversion, and also for a native
        hit on entries an earlier conversion wrote back (converted is False then); "" when every
        token is the model's own KV.
    recompute_tail: the tail recompute r the load applied (Bridge.recompute_tail_for of the
        adapter that converted, or that written-back entries name, for this prompt's length):
        the model computes the prompt's last r + 1 tokens itself. 0 when every token is the
        model's own KV.
    """

    tokens: int
    kv: Optional[KVCache]
    source: str
    converted: bool
    native_tokens: int
    quality: float
    converted_from: str = ""
    adapter: str = ""
    recompute_tail: int = 0


class _Tokenizer(NamedTuple):
    """A registered tokenizer: its id, the object, and its tokens' decoded texts as loads across
    tokenizers have needed them (token id -> decode([id]); at most one entry per vocabulary id,
    so the cache is bounded by the vocabulary)."""
    id: str
    tokenizer: Any
    pieces: Dict[int, str]


class Bridge:
    """Saves prompt KV caches and loads the longest usable prefix for a model.

    load() returns the model's own cached prefix, or, when another model sharing its tokenizer
    has a strictly longer one and an adapter from it is registered, that prefix converted (only
    the tokens past the native prefix are converted) and written back as the model's own entry,
    so the next load is a native hit. An adapter's quality is the minimum held-out R² over every
    target layer's key and value maps of its fit report; adapters under `min_quality` may be
    registered but are never used (stats()["adapters_skipped_quality"] counts each pass-over).

    The start token. At position 0 a causal model's KV depends on the token alone, and it is the
    token every later one attends to most (the attention sink), where a conversion's error costs
    the most: loads holding converted tokens take the first token's KV from the target's own
    (add_start; save() registers the first token of each prompt a model saves of its own) when
    the prompt opens with that token. On SmolLM2-135M -> Gemma-3-270M this alone raised kept from
    0.58 to 0.64 (benchmarks/recorded/215-real-pairs.md).

    Models with different tokenizers: register each model's tokenizer (add_tokenizer) and an
    adapter fitted on aligned samples (AdapterFitter(alignment_policy=...)); load() then also
    serves the target from the source's cache of the same text (see load()). Thread-safe.

    store: the KVStore to use (kept alive by the bridge).
    exact_layers: when load() is given the target `model`, the first exact_layers layers of a
        load with converted tokens are the model's own KV (kvbridge.exact) instead of converted
        ones. Keyword only. Default 0.
    The options below (min_quality and write_back may also be given by position, after the
    store; the others are keyword only) are the native BridgeOptions, one property each. The
    fallback floor (kvbridge.monitor) is min_agreement, check_window and min_checks: an adapter
    whose pooled top-1 agreement over its last `check_window` quality checks is below
    `min_agreement`, once it has `min_checks` of them, is disabled (loads stop converting with
    it) and what it wrote back is purged; enable_adapter() re-enables it. add_adapter() with the
    models probes an adapter against the same floor.
    """

    def __init__(self, store: KVStore, *args: Any, **kwargs: Any):
        # The options' names, defaults and order come from the native table (_OPTIONS); the
        # signature shown by help() and inspect is _INIT_SIGNATURE, which binds the call.
        given = _INIT_SIGNATURE.bind(self, store, *args, **kwargs)
        given.apply_defaults()
        options = given.arguments
        if not isinstance(store, KVStore):
            raise TypeError(f"store: expected a kvbridge.KVStore, got {type(store).__name__}")
        self._store = store
        self._exact_layers = _args.size("exact_layers", options["exact_layers"])
        self._tokenizers: Dict[str, _Tokenizer] = {}  # by model name
        self._lock = threading.Lock()
        self._tokenizer_errors = 0  # guarded by _lock
        self._native = _core.Bridge(store._store, **{
            name: check_option(name, kind, options[name]) for name, kind, _, _ in _OPTIONS})

    @property
    def store(self) -> KVStore:
        return self._store

    @property
    def exact_layers(self) -> int:
        return self._exact_layers

    def add_tokenizer(self, spec: _core.ModelSpec, tokenizer: Any) -> None:
        """Registers the tokenizer of the model `spec` names, so that load() can serve it from
        models with other tokenizers (and them from it) through adapters fitted on aligned
        samples.

        tokenizer: what kvbridge.token_offsets takes (a tokenizers.Tokenizer, a transformers fast
            tokenizer, a testbed tokenizer) and that decodes ids (``decode``). It stands for
            spec.tokenizer: when it carries an id of its own (``tokenizer_id`` or ``id``) that id
            must equal spec.tokenizer. One tokenizer per model name; registering another one for
            a name is a ValueError, the same one again is a no-op.
        """
        if not isinstance(spec, _core.ModelSpec):
            raise TypeError(f"spec: expected a kvbridge.ModelSpec, got {type(spec).__name__}")
        if not spec.tokenizer:
            raise _core.InvalidArgumentError(f"add_tokenizer: {spec.name} has no tokenizer id")
        if not callable(getattr(tokenizer, "decode", None)):
            raise TypeError("tokenizer: expected a tokenizer with decode(ids), got "
                            f"{type(tokenizer).__name__}")
        own = getattr(tokenizer, "tokenizer_id", None) or getattr(tokenizer, "id", None)
        if isinstance(own, str) and own != spec.tokenizer:
            raise _core.InvalidArgumentError(
                f"add_tokenizer: the tokenizer's id {own!r} is not {spec.name}'s tokenizer id "
                f"{spec.tokenizer!r}")
        with self._lock:
            known = self._tokenizers.get(spec.name)
            if known is not None and (known.id != spec.tokenizer
                                      or known.tokenizer is not tokenizer):
                raise _core.InvalidArgumentError(
                    f"add_tokenizer: {spec.name} already has tokenizer {known.id!r} registered")
            if known is None:
                self._tokenizers[spec.name] = _Tokenizer(spec.tokenizer, tokenizer, {})

    def add_adapter(self, adapter: LinearAdapter, replace: bool = False, *,
                    source_model: Any = None, target_model: Any = None,
                    probe: Optional[Sequence[Sequence[int]]] = None) -> None:
        """Registers adapter.source -> adapter.target.

        Raises ValueError when source and target are the same model, when their tokenizer ids
        are empty, or differ and the adapter has no alignment policy (one fitted on aligned
        samples, AdapterFitter(alignment_policy=...)), when a tokenizer registered for either
        model (add_tokenizer) has another id than the adapter's spec says, or when the pair is
        already registered and `replace` is False. Replacing an adapter by a different one purges
        what the old one wrote back.

        source_model, target_model: the two models (Hugging Face causal LMs). Given both, the
        adapter is first probed (kvbridge.monitor.probe_adapter: prompts sampled from the source
        model with a fixed seed, or `probe`, lists of token ids) and refused with
        kvbridge.monitor.AdapterQualityError (a ValueError) when the target's top-1 agreement
        after the converted cache is below min_agreement; nothing is registered then.
        """
        if not isinstance(adapter, LinearAdapter):
            raise TypeError("adapter: expected a kvbridge.LinearAdapter, got "
                            f"{type(adapter).__name__}")
        replace = _args.flag("replace", replace)
        with self._lock:
            for spec in (adapter.source, adapter.target):
                known = self._tokenizers.get(spec.name)
                if known is not None and known.id != spec.tokenizer:
                    raise _core.InvalidArgumentError(
                        f"add_adapter: the adapter's {spec.name} has tokenizer id "
                        f"{spec.tokenizer!r}, but {known.id!r} is registered for {spec.name}")
        if (source_model is None) != (target_model is None):
            raise TypeError("add_adapter: the probe needs both source_model and target_model")
        if source_model is not None:
            from kvbridge import quality

            quality.require_quality(self, adapter, source_model, target_model, probe)
        self._native.add_adapter(adapter._native, replace)

    def remove_adapter(self, source: _core.ModelSpec, target: _core.ModelSpec) -> bool:
        """Unregisters the adapter source -> target and purges the entries it wrote back (see
        invalidate_adapter); False if there was none."""
        return self._native.remove_adapter(source, target)

    def invalidate_adapter(self, adapter: LinearAdapter) -> dict:
        """Removes every entry `adapter` wrote back into the store, in every tier (the target's
        own entries stay); add_adapter(replace=True) and remove_adapter do it for the adapter
        they drop. Returns {"memory": n, "disk": n, "redis": n, "redis_complete": bool}."""
        if not isinstance(adapter, LinearAdapter):
            raise TypeError("adapter: expected a kvbridge.LinearAdapter, got "
                            f"{type(adapter).__name__}")
        return self._native.invalidate_adapter(adapter._native)

    def adapters(self) -> List[LinearAdapter]:
        """The registered adapters, in registration order."""
        return [LinearAdapter(a) for a in self._native.adapters()]

    @staticmethod
    def quality(adapter: LinearAdapter) -> float:
        """Minimum held-out R² over every target layer's K and V maps (what min_quality gates)."""
        return _core.Bridge.quality(adapter._native)

    def recompute_tail_for(self, adapter: LinearAdapter, prompt_tokens: int) -> int:
        """The tail recompute loads of a prompt of `prompt_tokens` tokens converted by
        `adapter` get: the recompute_tail option when it is >= 0, else the adapter's recorded
        one for that length (LinearAdapter.serving: from its tails by measured length, or
        max(serving["recompute_tail"], ceil(serving["recompute_share"] * prompt_tokens))), else
        0. The adapter need not be registered."""
        if not isinstance(adapter, LinearAdapter):
            raise TypeError("adapter: expected a kvbridge.LinearAdapter, got "
                            f"{type(adapter).__name__}")
        return self._native.recompute_tail_for(adapter._native,
                                               _args.size("prompt_tokens", prompt_tokens))

    def record_check(self, adapter: Union[LinearAdapter, str], check: Any) -> bool:
        """Records a quality check (a kvbridge.monitor.Check) of the registered adapter (or its
        fingerprint); True when it disabled the adapter. kvbridge.NotFoundError if the adapter
        is not registered; InvalidArgumentError for a check out of range."""
        return self._native.record_check(_fingerprint(adapter), _args.size("positions",
                                         check.positions), _args.size("agreed", check.agreed),
                                         _args.number("kl_sum", check.kl_sum),
                                         _args.size("loss_positions", check.loss_positions),
                                         _args.number("loss_gap_sum", check.loss_gap_sum))

    def disable_adapter(self, adapter: Union[LinearAdapter, str]) -> bool:
        """Stops converting with the registered adapter (or fingerprint) and purges what it wrote
        back; False if it is not registered. Once it returns nothing the adapter converted is
        stored or served by this Bridge (see adapter_dropped); a load converting with it at that
        moment returns its native prefix only."""
        return self._native.disable_adapter(_fingerprint(adapter))

    def adapter_dropped(self, adapter: Union[LinearAdapter, str]) -> bool:
        """True when this Bridge has dropped the adapter (or fingerprint): disabled, removed or
        replaced it, and not re-enabled or registered it again since. Cached entries whose
        provenance names a dropped adapter are never served (a prefix ends before the first of
        them), and saves naming it store nothing. Other processes sharing the store's disk
        directory or Redis find the adapter's entries there deleted when the dropping call
        returns; what is in their memory tiers stays until they drop the adapter too (README,
        "Dropping an adapter")."""
        return self._native.adapter_dropped(_fingerprint(adapter))

    def enable_adapter(self, adapter: Union[LinearAdapter, str]) -> bool:
        """Re-enables a disabled adapter (or fingerprint) with an empty check window; False if it
        is not registered."""
        return self._native.enable_adapter(_fingerprint(adapter))

    def adapter_health(self) -> List[dict]:
        """Per registered adapter: fingerprint ("adapter"), "source", "target", "enabled",
        "checks", "window_checks", "window_positions", rolling "agreement", "kl", "loss_gap"
        (NaN without checks), "disables" (see AdapterHealth in include/kvbridge/bridge_health.h)."""
        return self._native.adapter_health()

    def save(self, spec: _core.ModelSpec, tokens: Any, kv: KVCache,
             namespace: str = "default", *, converted_from: str = "",
             adapter: str = "") -> int:
        """Stores the model's KV for `tokens` (as KVStore.put: a legacy tuple or a DynamicCache);
        returns the tokens now cached.

        KV holding a NaN or an infinity is refused: kvbridge.InvalidArgumentError (a ValueError)
        naming the layer and token, nothing stored (stats()["nonfinite_refused"]).
        converted_from, adapter: provenance of KV that is not the model's own prefill (computed
        over a converted prefix: Load.converted_from and Load.adapter); recorded with the chunks,
        so that invalidate_adapter and a dropped adapter purge them. When `adapter` names an
        adapter this Bridge has dropped (adapter_dropped) nothing is stored and 0 returned
        (stats()["dropped_writes"])."""
        ids = as_tokens(tokens)
        pairs = host_kv(kv)
        keys, values = kv_views(pairs)
        return self._native.save(spec, ids, keys, values, _args.text("namespace", namespace),
                                 _args.text("converted_from", converted_from),
                                 _args.text("adapter", adapter))

    def add_start(self, spec: _core.ModelSpec, token_id: int, kv: KVCache) -> None:
        """Registers the model's own KV of the token `token_id` at position 0 (a one-token
        prefill, or the first token of any prefill: at position 0 a causal model's KV depends on
        that token alone). Loads of `spec` that hold converted tokens and whose prompt opens with
        `token_id` get that first token's KV from here instead of from the conversion (see
        load()). save() registers the first token of every prompt a model saves of its own. The
        registry is the native Bridge's (include/kvbridge/bridge.h, "The start token")."""
        token_id = _args.size("token_id", token_id)
        pairs = host_kv(kv)
        if len(pairs) != spec.num_layers:
            raise _core.InvalidArgumentError(f"kv: expected {spec.num_layers} layers, got {len(pairs)}")
        # The first token in the model's dtype, as loads return it.
        dtype = _TORCH_DTYPES[spec.dtype]
        first = [(k[:, :, :1].detach().to(dtype), v[:, :, :1].detach().to(dtype))
                 for k, v in pairs]
        keys, values = kv_views(first)
        self._native.add_start(spec, token_id, keys, values)

    def _own_start(self, spec: _core.ModelSpec, ids: Any, kv: Any) -> Any:
        """kv (one (keys, values) pair per layer, any device, written in place) with its first
        token's KV the model's own where one is registered for ids[0] (add_start). load() gets
        this from the native load; loads that convert elsewhere (kvbridge.vllm.device_load) call
        this."""
        start = empty_kv(spec, 1)
        keys, values = kv_views(start)
        if not self._native.copy_start(spec, int(ids[0]), keys, values):
            return kv
        for (k, v), (sk, sv) in zip(kv, start):
            k[:, :, :1] = sk.to(k.dtype)
            v[:, :, :1] = sv.to(v.dtype)
        return kv

    def load(self, spec: _core.ModelSpec, tokens: Any, namespace: str = "default", *,
             return_kv: bool = True,
             device: Union[str, torch.device, None] = None, as_cache: bool = False,
             model: Any = None) -> Load:
        """The longest usable prefix of `tokens` for `spec` (see the class docstring).

        Across tokenizers (spec has a tokenizer registered and an adapter to it from another
        tokenizer could serve more than spec's own cached prefix: Bridge::wanted_tokenizers, so a
        repeated prompt whose own entries are cached is not tokenized again): the prompt is decoded
        and encoded again; only the prefix whose round trip reproduces its ids and text, and whose
        tokens' byte ranges each hold that token's own decoded text, is served that way (the rest
        counts in stats()["unverified_tokens"]; see _verified_prefix). A tokenizer that raises or
        misbehaves (decode returning something other than a str) is logged (logger kvbridge.bridge),
        counted in stats()["tokenizer_errors"] and left out: the load goes on without it (the
        model's own cache and same-tokenizer adapters still serve it). That text is tokenized with
        each source's registered tokenizer (here, before the native load, which then runs without
        the GIL and calls nothing back), the source's cached prefix is found, and the longest target
        prefix whose tokens all have an aligned source token in it and whose text it covers is
        converted (include/kvbridge/bridge.h, the load overload with tokenizations) and written
        back.

        Empty and one-token prompts are misses. return_kv=False reports the length only (a
        conversion, if one is needed, still runs and is written back; probe() finds the length
        without converting). device: where the returned tensors live (default: CPU). as_cache:
        return the KV as a transformers DynamicCache.
        model: the target model (spec's); with exact_layers > 0, a load holding converted tokens
        (converted now or written back by a conversion) gets its first exact_layers layers from
        the model's own forward (kvbridge.exact.exact_layers).
        """
        ids = as_tokens(tokens)
        found = self._native_call(spec, ids, namespace, probe=False)
        kv = None
        if found.tokens and return_kv:
            kv = empty_kv(spec, found.tokens)
            keys, values = kv_views(kv)
            found.copy_to(keys, values)  # with the model's own start token (add_start)
            if model is not None and self._exact_layers and found.adapter:
                from kvbridge import exact

                kv = exact.exact_layers(model, ids[: found.tokens], kv, self._exact_layers)
            if device is not None and torch.device(device).type != "cpu":
                kv = tuple((k.to(device), v.to(device)) for k, v in kv)
            if as_cache:
                kv = legacy_to_cache(kv, spec)
        return _load_of(found, kv)

    def probe(self, spec: _core.ModelSpec, tokens: Any, namespace: str = "default") -> Load:
        """What load(spec, tokens, namespace) would serve, found by its lookups and choice
        (across tokenizers: the same tokenizations and alignment), without converting, copying
        KV out of the store or writing back: a Load with kv None and the fields load() would
        report. For a scheduler that promises a length which a worker then loads; that load may
        serve less (entries evicted meanwhile, a conversion dropped for a NaN or an infinity, an
        adapter dropped meanwhile). Counted in stats()["probes"], not as a load. Raises as
        load()."""
        return _load_of(self._native_call(spec, as_tokens(tokens), namespace, probe=True), None)

    def _native_call(self, spec: _core.ModelSpec, ids: Any, namespace: str, probe: bool) -> Any:
        """The native load (or probe) of `ids`, across tokenizers where _across says so."""
        ns = _args.text("namespace", namespace)
        across = self._across(spec, ids, ns)
        if across is None:
            return (self._native.probe if probe else self._native.load)(spec, ids, ns)
        call = self._native.probe_across if probe else self._native.load_across
        return call(spec, ids, across[0], across[1], ns)

    def _across(self, spec: _core.ModelSpec, ids: Any, ns: str):
        """(target tokenization, source tokenizations by tokenizer id) for a load across
        tokenizers, or None when tokenizing could not make it serve more: `spec` has no
        registered tokenizer, or no registered tokenizer is among those the native Bridge wants
        (Bridge::wanted_tokenizers: of usable adapters to `spec` from another tokenizer that could
        serve more than spec's own cached prefix; none for a prompt whose own entries are
        cached, as a repeated one). Everything is tokenized here, before the native load, which
        calls nothing back."""
        with self._lock:
            known = self._tokenizers.get(spec.name)
            if known is None or known.id != spec.tokenizer:
                return None  # the common case: nothing more to look at on this load
            by_id = {t.id: t for t in self._tokenizers.values()}
        wanted = [by_id[t] for t in self._native.wanted_tokenizers(spec, ids, ns) if t in by_id]
        if not wanted:
            return None
        prompt = [int(i) for i in ids]
        try:
            text, target = _verified_prefix(known.tokenizer, prompt, known.pieces, spec.name)
        except Exception as e:  # a broken target tokenizer: serve what needs no tokenizer
            self._tokenizer_error(spec.tokenizer, known.tokenizer, e)
            return None
        raw = text.encode("utf-8")
        sources = {}
        for source in wanted:
            try:
                sids, offsets, roles = token_offsets(source.tokenizer, text)
                # Only the tokens whose byte ranges hold their own text (see _verified_prefix).
                k = _spans_hold_their_text(source.tokenizer, sids, offsets, roles, raw,
                                           source.pieces, source.id)
                sources[source.id] = _tokenization(sids[:k], offsets[:k], roles[:k])
            except Exception as e:  # one broken source tokenizer leaves the others usable
                self._tokenizer_error(source.id, source.tokenizer, e)
        return target, sources

    def _tokenizer_error(self, tokenizer_id: str, tokenizer: Any, error: Exception) -> None:
        with self._lock:
            self._tokenizer_errors += 1
        log.warning("kvbridge: tokenizer %r (%s) failed during a load across tokenizers; the "
                    "load goes on without it: %s: %s", tokenizer_id, type(tokenizer).__name__,
                    type(error).__name__, error)

    def stats(self) -> dict:
        """Counters and times: see BridgeStats in include/kvbridge/bridge_stats.h; and
        "tokenizer_errors", the tokenizer failures loads across tokenizers went on without."""
        out = self._native.stats()
        with self._lock:
            out["tokenizer_errors"] = self._tokenizer_errors
        return out

    def metrics_text(self) -> str:
        """The stats in Prometheus text format (kvbridge_bridge_* families): the name
        KVStore.metrics_text has for the store's."""
        return self._native.metrics_text()

    # Earlier names of metrics_text, kept for their callers (kvbridge.monitor and the vLLM
    # shadow worker call metrics()).
    metrics = metrics_text
    prometheus_text = metrics_text


#: The native options: (name, type, default, doc) per field of BridgeOptions (bridge_options.h).
_OPTIONS = _core.Bridge.OPTIONS
#: The argument check (kvbridge._args) for each option type; int options are counts.
_OPTION_CHECKS = {"float": _args.number, "bool": _args.flag, "int": _args.size}


def _tail(name: str, value: Any) -> int:
    """recompute_tail: a count, or -1 for each adapter's recorded tail."""
    return _args.integer(name, value, -1)


#: Options whose check is not their type's.
_OPTION_CHECKS_BY_NAME = {"recompute_tail": _tail}


def check_option(name: str, kind: str, value: Any) -> Any:
    """`value` as the native option `name` of type `kind` takes it (TypeError or
    InvalidArgumentError otherwise)."""
    return _OPTION_CHECKS_BY_NAME.get(name, _OPTION_CHECKS[kind])(name, value)
#: How many options (the first ones) may also be given by position.
_POSITIONAL_OPTIONS = 2


def _init_signature() -> inspect.Signature:
    p = inspect.Parameter
    params = [p("self", p.POSITIONAL_OR_KEYWORD),
              p("store", p.POSITIONAL_OR_KEYWORD, annotation="KVStore")]
    for i, (name, kind, default, _) in enumerate(_OPTIONS):
        how = p.POSITIONAL_OR_KEYWORD if i < _POSITIONAL_OPTIONS else p.KEYWORD_ONLY
        params.append(p(name, how, default=default, annotation=kind))
    params.append(p("exact_layers", p.KEYWORD_ONLY, default=0, annotation="int"))
    return inspect.Signature(params)


def _option_property(name: str, doc: str) -> property:
    return property(lambda self: getattr(self._native, name), doc=doc)


_INIT_SIGNATURE = _init_signature()
Bridge.__init__.__signature__ = _INIT_SIGNATURE  # type: ignore[attr-defined]
for _name, _kind, _default, _doc in _OPTIONS:
    setattr(Bridge, _name, _option_property(_name, _doc))
if Bridge.__doc__ is not None:  # None under python -OO
    Bridge.__doc__ = Bridge.__doc__.rstrip() + "\n\n" + "".join(
        textwrap.fill(f"{name} ({kind}, default {default!r}): {doc}", 96,
                      initial_indent="    ", subsequent_indent="        ") + "\n"
        for name, kind, default, doc in _OPTIONS)
del _name, _kind, _default, _doc


def _fingerprint(adapter: Union[LinearAdapter, str]) -> str:
    if isinstance(adapter, LinearAdapter):
        return adapter.fingerprint
    if isinstance(adapter, str):
        return adapter
    raise TypeError("adapter: expected a kvbridge.LinearAdapter or its fingerprint, got "
                    f"{type(adapter).__name__}")


def _load_of(found: Any, kv: Any) -> Load:
    """The Load of a native BridgeLoad `found` (a load's or a probe's), holding `kv`."""
    return Load(found.tokens, kv, found.source, found.converted, found.native_tokens,
                found.quality, found.converted_from, found.adapter, found.recompute_tail)


def _tokenization(ids, offsets, roles):
    """The native form of a tokenization: (ids, starts, ends, roles with "" for ordinary)."""
    return ([int(i) for i in ids], [int(s) for s, _ in offsets], [int(e) for _, e in offsets],
            ["" if r is None else r for r in roles])


def _decode(tokenizer: Any, ids: List[int], name: str = "") -> str:
    try:
        text = tokenizer.decode(ids, skip_special_tokens=True)
    except TypeError:  # the testbed tokenizers drop special ids themselves
        text = tokenizer.decode(ids)
    if not isinstance(text, str):
        raise _core.InvalidArgumentError(
            f"tokenizer {type(tokenizer).__name__}{' of ' + name if name else ''}: decode "
            f"returned {type(text).__name__}, expected a str")
    return text


def _spans_hold_their_text(tokenizer: Any, ids: List[int], offsets: List[Tuple[int, int]],
                           roles: List[Optional[str]], raw: bytes, pieces: Dict[int, str],
                           name: str = "") -> int:
    """How many leading tokens have byte ranges that hold their own text: for each ordinary
    token, its decoded text alone (decode([id])) must equal the text's bytes in its range (read
    as UTF-8, U+FFFD for partial characters), or that with a leading space (decoders that drop
    the space a word-initial piece stands for when it is decoded first). A piece holding part of
    a character (a byte-level or byte-fallback token inside a multi-byte character decodes to
    U+FFFD) needs a range holding a non-ASCII character (the whole one, for character-based
    offsets, or U+FFFD for a byte range inside it) and the piece's whole characters. Special tokens (a role)
    have empty ranges, which align() checks. pieces: the tokenizer's decoded tokens so far (the
    Bridge keeps one per registered tokenizer), extended here: one decode per id not in it."""
    for j, (i, (s, e), role) in enumerate(zip(ids, offsets, roles)):
        if role is not None:
            continue
        piece = pieces.get(i)
        if piece is None:
            piece = pieces[i] = _decode(tokenizer, [i], name)
        span = raw[s:e].decode("utf-8", errors="replace")
        if piece == span or " " + piece == span:
            continue
        # Part of a character (byte-level and byte-fallback pieces): decode gives U+FFFD, and
        # character-based offsets give the whole character; the whole characters must be there.
        if ("\ufffd" in piece and any(ord(c) > 127 for c in span)
                and all(part in span for part in piece.split("\ufffd"))):
            continue
        return j
    return len(ids)


def _longest_decoding_prefix(tokenizer: Any, prompt: List[int], v: int, ends: List[int],
                             raw: bytes, name: str = "") -> int:
    """A u <= v such that prompt[:u] decodes to exactly raw[:ends[u - 1]] (u = 0 always does):
    v itself when it does, else found by galloping down from v (v - 1, v - 2, v - 4, ...) to one
    that does and bisecting the last step. At most about 2 log2(v) + 2 decodes of at most v ids,
    where trying each length down from v took up to v (quadratic in the prompt for a decode that
    is not prefix-stable). The result is the longest such u wherever the property holds for
    every length up to some point and for none after it, as for every tokenizer whose decode
    only differs from the text at its end (a character cut by the prefix's last token)."""

    def decodes(u: int) -> bool:
        return u == 0 or _decode(tokenizer, prompt[:u], name).encode("utf-8") == raw[:ends[u - 1]]

    if decodes(v):
        return v
    bad, step = v, 1  # bad: a length known not to decode
    while True:
        good = max(v - step, 0)
        if decodes(good):
            break
        bad, step = good, 2 * step
    while bad - good > 1:
        mid = (good + bad) // 2
        if decodes(mid):
            good = mid
        else:
            bad = mid
    return good


def _verified_prefix(tokenizer: Any, prompt: List[int], pieces: Dict[int, str], name: str = ""):
    """The prompt's text and the target tokenization of its verified prefix.

    The prompt is decoded to text and encoded again (with the tokenizer's special tokens when
    the prompt starts with them). The verified prefix is the longest common prefix of the prompt
    and the re-encoding, cut before the first token whose byte range does not hold its own text
    (_spans_hold_their_text: offsets that are shifted or otherwise wrong), and then shortened
    until the text of its tokens (decoded together) is exactly the start of the text up to its
    last token's end (_longest_decoding_prefix): only then do its spans describe the prompt.
    Tokens past it (normalisation, unknown bytes, special tokens inside the text, misaligned
    offsets) are never served across tokenizers. Cost: a decode of one token per distinct id
    not yet in `pieces` (see _spans_hold_their_text) and O(log n) decodes of at most n tokens.
    Returns (text of the verified prefix, tokenization)."""
    text = _decode(tokenizer, prompt, name)
    for add_bos in (True, False):
        ids, offsets, roles = token_offsets(tokenizer, text, add_bos=add_bos)
        v = 0
        while v < min(len(ids), len(prompt)) and ids[v] == prompt[v]:
            v += 1
        if v > 0 or not add_bos:
            break
    raw = text.encode("utf-8")
    v = _spans_hold_their_text(tokenizer, ids[:v], offsets[:v], roles[:v], raw, pieces, name)
    ends: List[int] = []  # ends[u - 1]: where the text of tokens [0, u) ends
    for _, e in offsets[:v]:
        ends.append(max(e, ends[-1]) if ends else e)
    v = _longest_decoding_prefix(tokenizer, prompt, v, ends, raw, name)
    end = ends[v - 1] if v else 0
    return raw[:end].decode("utf-8", errors="strict"), _tokenization(ids[:v], offsets[:v], roles[:v])


__all__: List[str] = ["Bridge", "Load"]
