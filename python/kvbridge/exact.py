"""Exact first layers: a target model's own KV for its first layers in place of converted KV.

A decoder's layer-0 keys and values are a per-token function of the token embeddings (embedding,
norm, K/V projections, RoPE at the token's position), so where the target model is at hand they
can be computed exactly instead of converted. The first k layers need the model's own forward
through layers 0..k-1 over the prefix (about k / num_layers of a prefill; the layers above are
not run).

    kv = exact.exact_layers(model, tokens, kv, layers=1)

Works with Hugging Face decoder-only models whose base model (``model.model`` or
``model.get_decoder()``) keeps its decoder layers in a ``layers`` ModuleList and takes
``input_ids``, ``cache`` (or ``past_key_values``) and ``use_cache`` (Llama, Qwen2, Mistral and
their relatives in transformers 5). The model is not modified: a shallow view of its base model
with the first k layers runs, sharing the weights (kvbridge.hf.own_first_layers, the model
call; this module splices its result into a cache).
"""
from __future__ import annotations

from typing import Any, List, Sequence

from kvbridge import _args
from kvbridge._core import InvalidArgumentError
from kvbridge._tensors import KVCache, check_kv
from kvbridge.hf import own_first_layers


def exact_layers(model: Any, tokens: Sequence[int], kv: KVCache, layers: int = 1) -> KVCache:
    """`kv` (legacy KV of the model's layout for tokens[:t], t = kv's token count) with its first
    `layers` layers replaced by the model's own KV of tokens[:t]; the other layers are `kv`'s
    tensors unchanged (not copied). tokens may be longer than t (a prompt whose tail the model
    computes itself). kv: a legacy tuple or a DynamicCache. Returns a legacy tuple; `kv` itself is
    not modified."""
    pairs = tuple((key, value) for key, value in check_kv(kv))
    k = _args.size("layers", layers)
    if k == 0:
        return pairs
    if k > len(pairs):
        raise InvalidArgumentError(f"layers: the cache has {len(pairs)} layers, got {k}")
    t = int(pairs[0][0].shape[2])
    if t == 0:
        return pairs
    ids = list(tokens)
    if len(ids) < t:
        raise InvalidArgumentError(f"tokens: the cache holds {t} tokens but only {len(ids)} were given")
    own = own_first_layers(model, ids[:t], k)
    out: List[Any] = []
    for i, (key, value) in enumerate(pairs):
        if i < k:
            want = key
            key = own[i][0].to(dtype=want.dtype, device=want.device)
            value = own[i][1].to(dtype=want.dtype, device=want.device)
            if key.shape != want.shape:
                raise InvalidArgumentError(f"layer {i}: the model's KV is {tuple(key.shape)}, the cache's "
                                 f"{tuple(want.shape)}: not this model's cache")
        out.append((key, value))
    return tuple(out)


__all__: List[str] = ["exact_layers", "own_first_layers"]
