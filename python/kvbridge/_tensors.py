"""Turning user objects (token sequences, torch KV tuples, transformers caches) into the native
core's views.

Views are zero-copy: the core reads the tensors' memory through their data pointers and strides,
so the tensors must stay alive for the call, which the callers here guarantee by holding them.
"""
from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import numpy as np
import torch

from kvbridge import _core
from kvbridge._core import InvalidArgumentError

KVCache = Tuple[Tuple[torch.Tensor, torch.Tensor], ...]

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Token tensors of these dtypes on the CPU are read in place by the core.
_NATIVE_TOKEN_DTYPES = (torch.int64, torch.int32)

# The core reads dense CPU tensors itself (KVStore.put_kv, Match.copy_into, token tensors)
# through their attributes, comparing against these objects, and creates the ones
# KVStore.match_kv returns with torch.empty and torch.empty_like.
_core._register_torch(torch.Tensor, torch.strided,
                      {**{v: k for k, v in _TORCH_DTYPES.items()},
                       torch.int64: "int64", torch.int32: "int32"},
                      torch.empty, torch.empty_like)


def as_tokens(tokens: Any) -> Any:
    """The token ids in a form the native core reads: a list or tuple as it is, a numpy array
    as it is, a 1-D CPU torch int64 / int32 tensor as it is, another torch integer tensor as a
    numpy view of its CPU memory, anything else through
    np.asarray. The core checks the rest (integer dtype, 1-D, every id in [0, 2^32)) and raises
    TypeError or kvbridge.InvalidArgumentError naming the bad id."""
    if isinstance(tokens, (list, tuple, np.ndarray)):
        return tokens
    if isinstance(tokens, torch.Tensor):
        if (tokens.dtype in _NATIVE_TOKEN_DTYPES and tokens.is_cpu and tokens.dim() == 1
                and tokens.layout == torch.strided):
            return tokens  # read in place by the core
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise TypeError(f"tokens: expected an integer tensor, got dtype {tokens.dtype}")
        if tokens.layout != torch.strided or tokens.device.type == "meta":
            raise TypeError("tokens: expected a dense tensor with data, got layout "
                            f"{tokens.layout} on {tokens.device}")
        return tokens.detach().cpu().numpy()
    return np.asarray(tokens)


_DTYPE_NAMES = {v: k for k, v in _TORCH_DTYPES.items()}


def tensor_view(t: torch.Tensor) -> _core.TensorView:
    # The per-call cost of put and match is mostly here: cheap attribute reads first.
    dtype = _DTYPE_NAMES.get(t.dtype) or str(t.dtype).replace("torch.", "")
    if t.is_cpu:
        return _core.TensorView(t.data_ptr(), dtype, t.shape, t.stride(), "cpu", 0)
    return _core.TensorView(t.data_ptr(), dtype, t.shape, t.stride(), t.device.type,
                            t.device.index or 0)


def is_cache_object(kv: Any) -> bool:
    """True for a transformers Cache (anything with ``.layers``), as opposed to a legacy tuple."""
    return not isinstance(kv, (tuple, list, torch.Tensor)) and hasattr(kv, "layers")


def output_cache(out: Any) -> Any:
    """The cache of a model's forward output with use_cache=True: ``out.cache`` in the
    transformers this package installs, ``out.past_key_values`` in older ones (the one vLLM pins)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def cache_layers(cache: Any) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """The (keys, values) of each layer of a transformers Cache (e.g. DynamicCache), by duck
    typing so that transformers stays an optional import.

    kvbridge holds every layer's KV for every token. A sliding-window layer
    (``DynamicSlidingWindowLayer``) qualifies while it still holds every token it has seen (a
    prompt shorter than its window); one that has dropped its oldest tokens is refused with the
    way out: prefill with a cache that keeps every token (kvbridge.hf.full_cache()), which gives
    the same outputs since the model's attention masks apply its windows.
    """
    pairs = []
    for i, layer in enumerate(cache.layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor) or (
                not getattr(layer, "is_initialized", True)) or keys.dim() != 4:
            raise InvalidArgumentError(f"kv: layer {i} of the cache holds no [batch, heads, tokens, "
                                       "head_dim] keys and values (empty or not initialized)")
        if getattr(layer, "is_sliding", False):
            seen = int(getattr(layer, "cumulative_length", keys.shape[-2]))
            if seen != keys.shape[-2]:
                raise InvalidArgumentError(
                    f"kv: layer {i} of the cache is a sliding-window layer that holds only the last "
                    f"{keys.shape[-2]} of its {seen} tokens; kvbridge stores every token of every "
                    "layer: prefill with kvbridge.hf.full_cache() (a cache that keeps every token; "
                    "the model's attention masks still apply its windows)")
        pairs.append((keys, values))
    if not pairs:
        raise InvalidArgumentError("kv: the cache has no layers (nothing was cached yet)")
    return pairs


def check_kv(kv: Any) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """The (key, value) pairs of a legacy KV tuple or of a transformers Cache (the one place
    where caches are normalized); checks container types, shapes are checked by the core."""
    if is_cache_object(kv):
        kv = cache_layers(kv)
    if isinstance(kv, torch.Tensor) or not isinstance(kv, (tuple, list)):
        raise TypeError("kv: expected a tuple of (key, value) pairs per layer or a transformers "
                        f"DynamicCache, got {type(kv).__name__}")
    if len(kv) == 0:
        raise InvalidArgumentError("kv: expected at least one layer, got none")
    pairs = []
    for i, layer in enumerate(kv):
        if not isinstance(layer, (tuple, list)) or len(layer) != 2:
            raise TypeError(f"kv[{i}]: expected a (key, value) pair")
        for j, t in enumerate(layer):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"kv[{i}][{j}]: expected a torch.Tensor, got {type(t).__name__}")
            if t.layout != torch.strided:
                raise TypeError(f"kv[{i}][{j}]: expected a dense (strided) tensor, got layout "
                                f"{t.layout}")
            if t.device.type == "meta":
                raise InvalidArgumentError(f"kv[{i}][{j}]: a meta tensor holds no data")
        pairs.append((layer[0], layer[1]))
    return pairs


def host_kv(kv: Any) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """check_kv, then the pairs on the CPU (the same tensors when already there). The caller
    holds the result while the core reads it: for device tensors these are the only copies."""
    return [(k if k.is_cpu else k.cpu(), v if v.is_cpu else v.cpu()) for k, v in check_kv(kv)]


def kv_views(pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]]):
    return [tensor_view(k) for k, _ in pairs], [tensor_view(v) for _, v in pairs]


def empty_kv(spec: _core.ModelSpec, tokens: int, device: Any = None) -> KVCache:
    dtype = _TORCH_DTYPES[spec.dtype]
    shape = (1, spec.num_kv_heads, tokens, spec.head_dim)
    return tuple((torch.empty(shape, dtype=dtype, device=device),
                  torch.empty(shape, dtype=dtype, device=device))
                 for _ in range(spec.num_layers))
