"""ModelSpec derivation shared by every integration (kvbridge.models, kvbridge.vllm, the
testbed).

One model must get one spec wherever it runs, or entries saved by one runtime are misses for
another. The rules:

- families: Llama, Mistral, Qwen2/Qwen3, Gemma 2/3 and Phi-3 configs (``SUPPORTED_MODEL_TYPES``);
  another ``model_type`` is refused, not guessed;
- geometry from the HF config: ``num_hidden_layers``, ``num_key_value_heads`` (default: the
  attention heads), ``head_dim`` (default ``hidden_size / num_attention_heads``);
- RoPE base and scaling from ``rope_parameters`` (transformers 5; one entry per layer type for
  Gemma 3) or the older ``rope_theta`` / ``rope_scaling`` fields; "default", "linear" and
  "llama3" types; style "half" (the rotate-half convention all these families use) unless
  given; partial rotary embeddings are refused;
- per-layer attention (``ModelSpec.layer_attention``) where layers differ: each layer's type
  from ``layer_types`` (or every layer sliding where a ``sliding_window`` is in use), its RoPE
  from its type's entry and ``sliding_window`` for sliding layers;
- name (:func:`model_name`): from what the folder holds (``kvbridge.json``, the config's
  recorded name, the folder's own name), never the path it is reached by;
- version (:func:`weights_version`): a hash of the model folder's weight files: of their bytes
  when they total at most ``CONTENT_HASH_LIMIT`` (so a single small ``model.safetensors`` is
  hashed whole), else of their names and sizes (reading hundreds of GB at start-up is not an
  option), except where kvbridge recorded the files' content hashes when it wrote them
  (``kvbridge.json``, see recorded_hashes);
- tokenizer id (:func:`tokenizer_id`): a hash of the tokenizer folder's files; a kvbridge
  byte-level tokenizer definition (``tokenizer.json`` with ``"type": "bytes"``) keeps the id
  form its tokenizer class reports (``testbed-bytes-<hash of that file>``).
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
from typing import Any, Dict, List, Optional, Tuple, Union

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


def recorded_hashes(folder: PathLike) -> Dict[str, Tuple[int, str]]:
    """The weight files' (size, file_hash) that kvbridge recorded in the folder's
    ``kvbridge.json`` when it wrote them (kvbridge.models), by file name; {} when none."""
    marker = pathlib.Path(folder) / "kvbridge.json"
    try:
        files = json.loads(marker.read_text()).get("weights", {})
        return {str(k): (int(v[0]), str(v[1])) for k, v in files.items()}
    except (OSError, ValueError, AttributeError, TypeError, IndexError, KeyError):
        return {}


def weights_version(folder: PathLike) -> Optional[str]:
    """A version string for the weights in `folder` (see the module docstring), or None when
    it holds no weight file. Content hashes that kvbridge recorded when it wrote the files are
    used for files whose size still matches, so a large folder written by kvbridge.models is
    identified by its content without reading it again."""
    folder = pathlib.Path(folder)
    if not folder.is_dir():
        return None
    files = sorted(p for p in folder.iterdir()
                   if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    if not files:
        return None
    recorded = recorded_hashes(folder)
    known = {p.name: recorded[p.name][1] for p in files
             if p.name in recorded and recorded[p.name][0] == p.stat().st_size}
    if len(known) == len(files) or sum(p.stat().st_size for p in files) <= CONTENT_HASH_LIMIT:
        hashes = [known.get(p.name) or file_hash(p) for p in files]
        if len(files) == 1:
            return hashes[0]
        h = hashlib.sha256()
        for p, digest in zip(files, hashes):
            h.update(p.name.encode() + b"\0" + digest.encode() + b"\n")
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


#: Config ``model_type`` values whose rules kvbridge knows (the families below). Others are refused
#: rather than guessed: a wrong RoPE or window would convert every key wrongly.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gemma3_text",
                         "phi3")


def _scaling(params: dict) -> _core.RopeScaling:
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return _core.RopeScaling()
    if kind == "linear":
        return _core.RopeScaling("linear", factor=float(params["factor"]))
    if kind == "llama3":
        return _core.RopeScaling(
            "llama3", factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position=int(params["original_max_position_embeddings"]))
    raise InvalidArgumentError(f"model_spec: RoPE type {kind!r} is not supported by kvbridge.ModelSpec")


def _rope_dict(config: Any, layer_type: Optional[str] = None) -> dict:
    """The RoPE parameters of a layer type: transformers 5 ``rope_parameters`` (flat, or one
    entry per layer type as for Gemma 3), or the older ``rope_theta`` / ``rope_scaling``."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        key = layer_type if layer_type in params else "full_attention"
        if key not in params:
            raise InvalidArgumentError(f"model_spec: rope_parameters has no entry for {layer_type!r}")
        params = dict(params[key])
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        if "rope_theta" not in params:
            params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    return params


def rope_parameters(config: Any, layer_type: Optional[str] = None) -> Tuple[float, _core.RopeScaling]:
    """RoPE base and scaling of an HF config (transformers 5 ``rope_parameters``, or the older
    ``rope_theta`` / ``rope_scaling`` fields); for configs with one entry per layer type, the
    entry of `layer_type` (default: full attention)."""
    params = _rope_dict(config, layer_type)
    return float(params["rope_theta"]), _scaling(params)


def layer_types(config: Any) -> List[str]:
    """Each layer's attention type, "full_attention" or "sliding_attention": the config's
    ``layer_types`` (transformers 5 writes it for Gemma 2/3, Qwen2/3, Mistral...), else every
    layer sliding when the config has a ``sliding_window`` that is in use (Mistral, Phi-3;
    Qwen's ``use_sliding_window`` false turns it off), else every layer full."""
    n = int(config.num_hidden_layers)
    types = getattr(config, "layer_types", None)
    if types:
        types = list(types)
        if len(types) != n or any(t not in ("full_attention", "sliding_attention") for t in types):
            raise InvalidArgumentError(f"model_spec: layer_types must name full_attention or "
                                       f"sliding_attention for each of {n} layers, got {types!r}")
        return types
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True):
        return ["sliding_attention"] * n
    return ["full_attention"] * n


def layer_attention(config: Any) -> List[Tuple[float, _core.RopeScaling, int]]:
    """(RoPE base, scaling, sliding window or 0) of each layer of an HF config."""
    if float(getattr(config, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        raise InvalidArgumentError("model_spec: partial rotary embeddings (partial_rotary_factor "
                                   f"{config.partial_rotary_factor}) are not supported")
    out = []
    for t in layer_types(config):
        base, scaling = rope_parameters(config, t)
        window = int(config.sliding_window) if t == "sliding_attention" else 0
        out.append((base, scaling, window))
    return out


def spec_from_config(config: Any, name: str, dtype: str, version: str, tokenizer: str,
                     rope_style: str = "half") -> _core.ModelSpec:
    """The ModelSpec of an HF config of a supported family (SUPPORTED_MODEL_TYPES).

    dtype: the KV dtype ("float32", "bfloat16" or "float16"); version, tokenizer: as the
    ModelSpec fields (see weights_version / tokenizer_id). Layers that differ in RoPE or in
    sliding window (Gemma 2/3, Mistral, Phi-3) get per-layer entries (``layer_attention``); the
    spec-wide RoPE fields are then those of the full-attention layers.
    """
    model_type = getattr(config, "model_type", "")
    if model_type and model_type not in SUPPORTED_MODEL_TYPES:
        raise InvalidArgumentError(f"model_spec: model_type {model_type!r} is not one kvbridge has rules "
                                   f"for ({', '.join(SUPPORTED_MODEL_TYPES)})")
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    base, scaling = rope_parameters(config)
    layers = layer_attention(config)
    per_layer = {}
    if any(lb != base or ls != scaling or w for lb, ls, w in layers):
        per_layer["layer_attention"] = [
            _core.LayerAttention(rope_base=lb, rope_scaling=ls, sliding_window=w)
            for lb, ls, w in layers]
    return _core.ModelSpec(name, num_layers=int(config.num_hidden_layers),
                           num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                           version=version, tokenizer=tokenizer, rope_base=base,
                           rope_style=rope_style, rope_scaling=scaling, **per_layer)


def model_name(folder: PathLike, config: Any = None) -> str:
    """A model's name from what its folder holds, never from where it lies: the name in its
    ``kvbridge.json`` (kvbridge.models writes one), else the config's ``_name_or_path`` when it
    is not a path, else the folder's name."""
    folder = pathlib.Path(folder)
    marker = folder / "kvbridge.json"
    if marker.is_file():
        try:
            name = json.loads(marker.read_text()).get("name")
        except (ValueError, AttributeError):
            name = None
        if isinstance(name, str) and name:
            return name
    recorded = str(getattr(config, "_name_or_path", "") or "") if config is not None else ""
    if recorded and not os.path.isabs(recorded) and not recorded.startswith("."):
        return recorded
    return folder.resolve().name


def folder_spec(folder: PathLike, config: Any, dtype: str) -> _core.ModelSpec:
    """The ModelSpec of the model in a Hugging Face folder: name (model_name), version
    (weights_version), tokenizer (tokenizer_id) and the config's geometry (spec_from_config)."""
    version = weights_version(folder)
    tokenizer = tokenizer_id(folder)
    if version is None or tokenizer is None:
        raise InvalidArgumentError(f"model_spec: {folder} holds no weight files or no tokenizer files")
    return spec_from_config(config, model_name(folder, config), dtype, version, tokenizer)


__all__ = ["CONTENT_HASH_LIMIT", "SUPPORTED_MODEL_TYPES", "TOKENIZER_FILES", "WEIGHT_SUFFIXES",
           "byte_tokenizer_id", "file_hash", "folder_spec", "layer_attention", "layer_types",
           "model_name", "recorded_hashes", "rope_parameters", "spec_from_config", "tokenizer_id",
           "weights_version"]
