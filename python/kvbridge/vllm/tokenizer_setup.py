"""Tokenizers for loads across tokenizers: an adapter whose source model has another tokenizer
(one fitted on aligned samples) needs both tokenizers registered with the connector's Bridge,
the engine's (its tokenizer folder) and the source's (the ``tokenizers`` option, or the folder
kvbridge.models converted the source into). ``Bridge.load`` then decodes the engine's token ids
to text, tokenizes it with the source tokenizer, finds the source's cached prefix and converts
the aligned target tokens."""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Tuple

from kvbridge import _core, specs
from kvbridge._core import InvalidArgumentError
from kvbridge.adapter import LinearAdapter
from kvbridge.bridge import Bridge

logger = logging.getLogger("kvbridge.vllm")


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


__all__ = ["register_tokenizers", "source_tokenizers"]
