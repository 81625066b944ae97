"""The connector's ``kv_connector_extra_config`` and the served model's ModelSpec.

Kept free of vLLM imports so that both are testable without an engine.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from kvbridge import _args, _core, specs
from kvbridge._core import InvalidArgumentError

#: Keys of the connector itself (every other key must be a StoreOptions field).
#: The Bridge's quality-fallback options the connector passes through (kvbridge.monitor): an
#: adapter whose rolling shadow-check agreement falls below min_agreement is disabled.
QUALITY_KEYS = ("min_agreement", "check_window", "min_checks")
#: The Bridge's serving options the connector passes through. recompute_tail not given: the
#: Bridge's default, -1, each adapter's own recorded tail for the prompt's length
#: (LinearAdapter.serving, 0 without one).
SERVING_KEYS = ("recompute_tail",)
CONNECTOR_KEYS = ("namespace", "adapters", "tokenizers", "min_quality", "write_back", "model_name",
                  "version", "tokenizer", "layout") + QUALITY_KEYS + SERVING_KEYS
#: Default memory tier of the connector's store.
DEFAULT_CAPACITY_BYTES = 1 << 30
_KV_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
#: (type, default) of each Bridge option, from the native table (the Bridge's own defaults).
_BRIDGE_OPTIONS = {name: (kind, default) for name, kind, default, _ in _core.Bridge.OPTIONS}
#: The argument check (kvbridge._args) for each Bridge option type, as kvbridge.Bridge's.
_OPTION_CHECKS = {"float": _args.number, "bool": _args.flag, "int": _args.size}


def _store_option_names() -> Tuple[str, ...]:
    o = _core.StoreOptions()
    return tuple(n for n in dir(o) if not n.startswith("_") and not callable(getattr(o, n)))


@dataclass(frozen=True)
class ConnectorOptions:
    """The parsed extra config.

    store: StoreOptions fields by name (capacity_bytes defaults to DEFAULT_CAPACITY_BYTES,
        chunk_tokens to the engine's block size); namespace: default tenant namespace;
    adapters: adapter file paths (their target must be the served model); tokenizers: folders
        holding the tokenizers of adapter sources whose tokenizer differs from the served
        model's (matched by kvbridge.specs.tokenizer_id; see tokenizer_setup.source_tokenizers);
    min_quality: the Bridge's; write_back: save prompts whose KV derives from a conversion (with its
        provenance, from the background thread: the connector's Bridge itself never writes
        back); model_name, version, tokenizer: override the derived ModelSpec fields; layout:
        the paged layout ("cpu" / "split"; default by device);
    quality: QUALITY_KEYS given in the extra config, by name (the others keep the Bridge's
        defaults, kvbridge.Bridge.OPTIONS); see bridge_options().
    serving: SERVING_KEYS given in the extra config, by name (recompute_tail: an int >= 0 for
        every adapter, or -1; not given, the Bridge's default: each adapter's recorded tail).
    """

    store: Tuple[Tuple[str, Any], ...]
    namespace: str = "default"
    adapters: Tuple[str, ...] = ()
    tokenizers: Tuple[str, ...] = ()
    min_quality: float = 0.5
    write_back: bool = True
    model_name: Optional[str] = None
    version: Optional[str] = None
    tokenizer: Optional[str] = None
    layout: Optional[str] = None
    chunk_tokens: int = 0
    quality: Tuple[Tuple[str, Any], ...] = ()
    serving: Tuple[Tuple[str, Any], ...] = ()

    def bridge_options(self) -> Dict[str, Any]:
        """The kvbridge.Bridge keyword options of this config (the Bridge's defaults for keys not
        given)."""
        out: Dict[str, Any] = {"min_quality": self.min_quality, "write_back": self.write_back}
        out.update(self.quality)
        out.update(self.serving)
        return out

    def option(self, name: str) -> Any:
        """A Bridge option's configured value, or the Bridge's default."""
        return self.bridge_options().get(name, _BRIDGE_OPTIONS[name][1])


def parse_options(extra: Optional[Mapping[str, Any]], block_size: int) -> ConnectorOptions:
    """Validates `extra` (kv_connector_extra_config); raises ValueError naming a bad key or
    value."""
    extra = dict(extra or {})
    store_names = _store_option_names()
    unknown = sorted(k for k in extra if k not in CONNECTOR_KEYS and k not in store_names)
    if unknown:
        raise InvalidArgumentError(f"KVBridgeConnector: unknown kv_connector_extra_config key(s) {unknown}; "
                                   f"expected {sorted(CONNECTOR_KEYS)} or StoreOptions fields "
                                   f"{sorted(store_names)}")
    probe = _core.StoreOptions()
    store: Dict[str, Any] = {"capacity_bytes": DEFAULT_CAPACITY_BYTES,
                             "chunk_tokens": int(block_size)}
    for name in store_names:
        if name in extra:
            value = extra[name]
            if name in ("disk_dir",) and value is not None:
                value = os.fspath(value)
            try:
                setattr(probe, name, value)
            except (TypeError, ValueError) as e:
                raise InvalidArgumentError(f"KVBridgeConnector: bad value {value!r} for {name!r}: {e}") \
                    from None
            store[name] = value
    if int(store["chunk_tokens"]) <= 0:
        raise InvalidArgumentError(f"KVBridgeConnector: chunk_tokens must be positive, got "
                                   f"{store['chunk_tokens']}")
    adapters = extra.get("adapters", ())
    if isinstance(adapters, (str, os.PathLike)):
        adapters = (adapters,)
    if not isinstance(adapters, (list, tuple)):
        raise InvalidArgumentError("KVBridgeConnector: 'adapters' must be a list of adapter file paths, "
                                   f"got {type(adapters).__name__}")
    for p in adapters:
        if not os.path.isfile(os.fspath(p)):
            raise InvalidArgumentError(f"KVBridgeConnector: adapter file {os.fspath(p)!r} does not exist")
    tokenizers = extra.get("tokenizers", ())
    if isinstance(tokenizers, (str, os.PathLike)):
        tokenizers = (tokenizers,)
    if not isinstance(tokenizers, (list, tuple)):
        raise InvalidArgumentError("KVBridgeConnector: 'tokenizers' must be a list of tokenizer "
                                   f"folders, got {type(tokenizers).__name__}")
    for p in tokenizers:
        if specs.tokenizer_id(os.fspath(p)) is None:
            raise InvalidArgumentError(f"KVBridgeConnector: tokenizers: {os.fspath(p)!r} is not a "
                                       "folder holding tokenizer files")
    layout = extra.get("layout")
    if layout is not None and layout not in ("cpu", "split"):
        raise InvalidArgumentError(f"KVBridgeConnector: layout must be 'cpu' or 'split', got {layout!r}")
    namespace = extra.get("namespace", "default")
    if not isinstance(namespace, str) or not namespace:
        raise InvalidArgumentError(f"KVBridgeConnector: namespace must be a non-empty string, got "
                                   f"{namespace!r}")
    for key in ("model_name", "version", "tokenizer"):
        if extra.get(key) is not None and not isinstance(extra[key], str):
            raise InvalidArgumentError(f"KVBridgeConnector: {key} must be a string, got {extra[key]!r}")
    # The package's own argument checks, so "0.5" or "false" are refused rather than coerced.
    min_quality = extra.get("min_quality", 0.5)
    try:
        min_quality = _args.number("min_quality", min_quality)
    except TypeError:
        raise InvalidArgumentError(f"KVBridgeConnector: min_quality must be a number, got "
                                   f"{min_quality!r}") from None
    write_back = extra.get("write_back", True)
    try:
        write_back = _args.flag("write_back", write_back)
    except TypeError:
        raise InvalidArgumentError(f"KVBridgeConnector: write_back must be a bool, got "
                                   f"{write_back!r}") from None
    quality: Dict[str, Any] = {}
    for key in QUALITY_KEYS:
        if key in extra:
            kind = _BRIDGE_OPTIONS[key][0]
            try:
                quality[key] = _OPTION_CHECKS[kind](key, extra[key])
            except TypeError:
                raise InvalidArgumentError(f"KVBridgeConnector: {key} must be {_KIND_WORDS[kind]}, "
                                           f"got {extra[key]!r}") from None
    _check_quality(quality)
    serving: Dict[str, Any] = {}
    for key in SERVING_KEYS:
        if key in extra:
            from kvbridge.bridge import check_option

            try:
                serving[key] = check_option(key, _BRIDGE_OPTIONS[key][0], extra[key])
            except (TypeError, ValueError) as e:
                raise InvalidArgumentError(f"KVBridgeConnector: bad {key} {extra[key]!r}: {e}") \
                    from None
    return ConnectorOptions(
        store=tuple(sorted(store.items())), namespace=namespace,
        adapters=tuple(os.path.abspath(os.fspath(p)) for p in adapters),
        tokenizers=tuple(os.path.abspath(os.fspath(p)) for p in tokenizers),
        min_quality=min_quality, write_back=write_back,
        model_name=extra.get("model_name"), version=extra.get("version"),
        tokenizer=extra.get("tokenizer"), layout=layout, chunk_tokens=int(store["chunk_tokens"]),
        quality=tuple(sorted(quality.items())), serving=tuple(sorted(serving.items())))


_KIND_WORDS = {"float": "a number", "int": "a count (int)", "bool": "a bool"}


def _check_quality(quality: Mapping[str, Any]) -> None:
    """Refuses a quality floor the Bridge would refuse, with the connector's error wording (a
    throwaway Bridge over a tiny store checks the ranges, so they are stated once, in C++)."""
    if not quality:
        return
    from kvbridge.bridge import Bridge
    from kvbridge.store import KVStore

    try:
        Bridge(KVStore(1 << 16, 16), **quality)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(f"KVBridgeConnector: bad quality option(s) {dict(quality)}: {e}") \
            from None


def kv_dtype_name(model_dtype: Any, cache_dtype: str) -> str:
    """The KV dtype of an engine: its cache_dtype, or the model dtype for "auto"."""
    if cache_dtype in (None, "auto"):
        if model_dtype not in _KV_DTYPES:
            raise InvalidArgumentError(f"KVBridgeConnector: model dtype {model_dtype} is not a KV dtype "
                                       "kvbridge stores (float32, bfloat16, float16)")
        return _KV_DTYPES[model_dtype]
    if cache_dtype in ("float32", "bfloat16", "float16"):
        return cache_dtype
    if cache_dtype in ("half",):
        return "float16"
    raise InvalidArgumentError(f"KVBridgeConnector: kv cache dtype {cache_dtype!r} is not supported "
                               "(float32, bfloat16, float16; quantized vLLM caches are not)")


def engine_spec(hf_config: Any, model: str, tokenizer: Optional[str], served_name: Any,
                model_dtype: Any, cache_dtype: str, options: ConnectorOptions) -> _core.ModelSpec:
    """The served model's ModelSpec by the rules of kvbridge.specs: for a model folder, exactly
    the spec ``kvbridge.models.load(folder, dtype)`` gives (``specs.folder_spec``), wherever
    the folder lies and whatever name vLLM serves it under, so that entries and adapters made
    outside vLLM apply to the engine without renaming anything.

    model, tokenizer: vLLM's model and tokenizer paths (or hub names); served_name: vLLM's
    served model name (a string or a list, the first is used): an API alias, which names the
    spec only for a model that is not a local folder (vLLM's default served name is the model
    path, which is never the identity of a folder).
    Name: options.model_name, else ``specs.model_name`` of the model folder (its
    ``kvbridge.json``, the config's recorded name, the folder's own name), else the served
    name, else `model`. Version: options.version, else weights_version(model), else
    "<model>" (a hub name without a local folder). Tokenizer: options.tokenizer, else
    tokenizer_id of the tokenizer folder, else of the model folder, else the tokenizer's name.
    KV dtype: the engine's cache dtype (``kv_dtype_name``), which is the dtype the connector
    reads from and writes into the paged cache (checked again against the cache tensors when
    they are registered).
    """
    if isinstance(served_name, (list, tuple)):
        served_name = served_name[0] if served_name else None
    model = str(model)
    folder = model if os.path.isdir(model) else None
    name = options.model_name or (specs.model_name(folder, hf_config) if folder else None) \
        or served_name or model
    version = options.version or specs.weights_version(model) or model
    tok = options.tokenizer
    if tok is None:
        tok = ((specs.tokenizer_id(tokenizer) if tokenizer else None)
               or specs.tokenizer_id(model) or str(tokenizer or model))
    return specs.spec_from_config(hf_config, str(name), kv_dtype_name(model_dtype, cache_dtype),
                                  version=version, tokenizer=tok)


__all__ = ["CONNECTOR_KEYS", "QUALITY_KEYS", "SERVING_KEYS", "ConnectorOptions", "DEFAULT_CAPACITY_BYTES", "engine_spec",
           "kv_dtype_name", "parse_options"]
