"""ModelSpec derivation shared by every integration (kvbridge.testbed, kvbridge.vllm).

One model must get one spec wherever it runs, or entries saved by one runtime are misses for
another. The rules:

- geometry from the HF config: ``num_hidden_layers``, ``num_key_value_heads`` (default: the
  attention heads), ``head_dim`` (default ``hidden_size / num_attention_heads``);
- RoPE base and scaling from ``rope_parameters`` (transformers 5) or the older ``rope_theta`` /
  ``rope_scaling`` fields; "default", "linear" and "llama3" types; style "half" (the
  Llama/Qwen2 rotate-half convention) unless given;
- version (:func:`weights_version`): a hash of the model folder's weight files: of their bytes
  when they total at most ``CONTENT_HASH_LIMIT`` (so a single small ``model.safetensors`` is
  hashed whole), else of their names and sizes (reading hundreds of GB at start-up is not an
  option);
- tokenizer id (:func:`tokenizer_id`): a hash of the tokenizer folder's files; a kvbridge
  byte-level tokenizer definition (``tokenizer.json`` with ``"type": "bytes"``) keeps the id
  form its tokenizer class reports (``testbed-bytes-<hash of that file>``).
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
from typing import Any, Optional, Tuple, Union

from kvbridge import _core
from kvbridge._core import InvalidArgumentError

PathLike = Union[str, "os.PathLike[str]"]

#: Weight files totalling at most this many bytes are hashed by content, larger ones by name
#: and size.
CONTENT_HASH_LIMIT = 256 << 20
#: File name endings that hold weights.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
#: Files that define a tokenizer (those present are hashed, in this order).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "merges.txt", "vocab.txt", "special_tokens_map.json", "added_tokens.json")


def file_hash(path: PathLike) -> str:
    """First 32 hex digits of the SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:32]


def weights_version(folder: PathLike) -> Optional[str]:
    """A version string for the weights in `folder` (see the module docstring), or None when
    it holds no weight file."""
    folder = pathlib.Path(folder)
    if not folder.is_dir():
        return None
    files = sorted(p for p in folder.iterdir()
                   if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    if not files:
        return None
    if sum(p.stat().st_size for p in files) <= CONTENT_HASH_LIMIT:
        if len(files) == 1:
            return file_hash(files[0])
        h = hashlib.sha256()
        for p in files:
            h.update(p.name.encode() + b"\0" + file_hash(p).encode() + b"\n")
        return h.hexdigest()[:32]
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.name}\0{p.stat().st_size}\n".encode())
    return "names-sizes-" + h.hexdigest()[:32]


def byte_tokenizer_id(raw: bytes) -> str:
    """The id of a kvbridge byte-level tokenizer defined by the bytes of its tokenizer.json."""
    return "testbed-bytes-" + hashlib.sha256(raw).hexdigest()[:16]


def tokenizer_id(folder: PathLike) -> Optional[str]:
    """The tokenizer id of the tokenizer files in `folder` (see the module docstring), or None
    when it holds none."""
    folder = pathlib.Path(folder)
    if not folder.is_dir():
        return None
    main = folder / "tokenizer.json"
    if main.is_file():
        raw = main.read_bytes()
        try:
            definition = json.loads(raw)
        except ValueError:
            definition = None
        if isinstance(definition, dict) and definition.get("type") == "bytes":
            return byte_tokenizer_id(raw)
    present = [folder / n for n in TOKENIZER_FILES if (folder / n).is_file()]
    if not present:
        return None
    h = hashlib.sha256()
    for p in present:
        h.update(p.name.encode() + b"\0" + file_hash(p).encode() + b"\n")
    return "tok-" + h.hexdigest()[:16]


def rope_parameters(config: Any) -> Tuple[float, _core.RopeScaling]:
    """RoPE base and scaling of an HF config (transformers 5 ``rope_parameters``, or the older
    ``rope_theta`` / ``rope_scaling`` fields)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        if "rope_theta" not in params:
            params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    base = float(params["rope_theta"])
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return base, _core.RopeScaling()
    if kind == "linear":
        return base, _core.RopeScaling("linear", factor=float(params["factor"]))
    if kind == "llama3":
        return base, _core.RopeScaling(
            "llama3", factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position=int(params["original_max_position_embeddings"]))
    raise InvalidArgumentError(f"model_spec: RoPE type {kind!r} is not supported by kvbridge.ModelSpec")


def spec_from_config(config: Any, name: str, dtype: str, version: str, tokenizer: str,
                     rope_style: str = "half") -> _core.ModelSpec:
    """The ModelSpec of a Llama/Qwen2-style HF config.

    dtype: the KV dtype ("float32", "bfloat16" or "float16"); version, tokenizer: as the
    ModelSpec fields (see weights_version / tokenizer_id).
    """
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    base, scaling = rope_parameters(config)
    return _core.ModelSpec(name, num_layers=int(config.num_hidden_layers),
                           num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                           version=version, tokenizer=tokenizer, rope_base=base,
                           rope_style=rope_style, rope_scaling=scaling)


__all__ = ["CONTENT_HASH_LIMIT", "TOKENIZER_FILES", "WEIGHT_SUFFIXES", "byte_tokenizer_id",
           "file_hash", "rope_parameters", "spec_from_config", "tokenizer_id",
           "weights_version"]
