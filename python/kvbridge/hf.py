"""Hugging Face transformers: caches (DynamicCache <-> kvbridge's legacy tuple form) and the
model calls kvbridge makes (a forward after a cache, a prefix's own KV, the first layers' own KV).

transformers (5.x) models take and return ``transformers.DynamicCache`` objects (one layer per
decoder layer, each holding ``keys`` and ``values`` of shape ``[batch, kv_heads, tokens,
head_dim]``); kvbridge's native form is the legacy tuple ``((key, value), ...)`` of the same
tensors. Every kvbridge entry point that takes a KV cache (``LinearAdapter.convert``,
``AdapterFitter.add``, ``KVStore.put``, ``Bridge.save``) accepts either form; the ones that
return a cache give a DynamicCache when asked (``as_cache=True``; ``convert`` returns the
input's form by default).

The model calls (``forward``, ``prefix_kv``, ``own_first_layers``) are what serving needs of a
model, and ``key_norm`` and ``token_codes`` read the parts of a model's weights a fit needs
besides its KV: the quality checks (kvbridge.quality, kvbridge.monitor) and exact first layers
(kvbridge.exact) run them, and the experiments build on them too. This is the one module that
calls a model.

transformers is imported only when a DynamicCache has to be built.
"""
from __future__ import annotations

import copy
import inspect
from typing import Any, List, Optional, Sequence, Tuple

import torch

from kvbridge import _args, _core
from kvbridge._core import InvalidArgumentError
from kvbridge._tensors import KVCache, cache_layers, check_kv, is_cache_object, output_cache


def is_cache(obj: Any) -> bool:
    """True for a transformers Cache object (as opposed to a legacy tuple)."""
    return is_cache_object(obj)


def to_legacy(cache: Any) -> KVCache:
    """The legacy tuple ``((key, value), ...)`` of a DynamicCache, sharing its tensors (no copy).

    A legacy tuple or list passes through as a tuple of pairs. Empty layers, and sliding-window
    layers that have dropped tokens (see full_cache), raise kvbridge.InvalidArgumentError;
    anything else TypeError.
    """
    if is_cache_object(cache):
        return tuple(cache_layers(cache))
    return tuple(check_kv(cache))


def full_cache() -> Any:
    """An empty ``transformers.DynamicCache`` whose layers keep every token, sliding-window layers
    included. Prefill with it to get a cache kvbridge can store for any prompt length: the
    model's attention masks still apply its sliding windows, so its outputs are those of its own
    cache (tests/python/test_models.py checks it for Gemma 3 past its 512-token window)."""
    from transformers import DynamicCache

    return DynamicCache()


def to_dynamic_cache(legacy: Any, config: Any = None, windows: Sequence[int] = ()) -> Any:
    """A ``transformers.DynamicCache`` holding the legacy tuple's tensors (a DynamicCache is
    returned as is).

    config: the model's config, optional; DynamicCache uses it to pick each layer's type
        (sliding-window layers for Gemma 2/3, Mistral...).
    windows: without a config, each layer's sliding window, 0 for full attention
        (ModelSpec.layer_attention's ``sliding_window``); [] for all full.
    Full-attention layers hold every token; sliding-window layers hold the last window - 1
    tokens, as the model's own cache does (all a next forward attends to). The cache's layers
    hold their own tensors: generating with it never writes into `legacy`.
    """
    if is_cache_object(legacy):
        return legacy
    from transformers import DynamicCache

    pairs = check_kv(legacy)
    if config is None and any(windows):
        if len(windows) != len(pairs):
            raise InvalidArgumentError(f"windows: expected one per layer ({len(pairs)}), got {len(windows)}")
        return DynamicCache(ddp_cache_data=[(k, v, torch.tensor(w)) if w else (k, v)
                                            for (k, v), w in zip(pairs, windows)])
    return DynamicCache(ddp_cache_data=[(k, v) for k, v in pairs], config=config)


def sliding_windows(spec: Optional[_core.ModelSpec]) -> List[int]:
    """Each layer's sliding window (0: full attention) by the spec's per-layer attention; [] for
    a spec without per-layer entries."""
    if spec is None:
        return []
    return [int(a.sliding_window) for a in getattr(spec, "layer_attention", [])]


def legacy_to_cache(kv: KVCache, spec: Optional[_core.ModelSpec] = None) -> Any:
    """A legacy tuple as a transformers DynamicCache (needs transformers): with `spec`, its
    sliding-window layers as DynamicSlidingWindowLayer (holding their last window - 1 tokens,
    as the model's own cache would), the others as DynamicLayer."""
    return to_dynamic_cache(kv, windows=sliding_windows(spec))


# ----------------------------------------------------------------------------- model calls


def as_cache(kv: Optional[KVCache]) -> Any:
    """A fresh transformers DynamicCache holding the legacy tuple `kv` (None: empty), every
    layer full (what forward feeds a model)."""
    from transformers import DynamicCache

    return DynamicCache() if kv is None else DynamicCache(kv)


def _cache_keyword(model: Any) -> str:
    """The keyword under which the installed transformers takes the KV cache: `cache` in newer
    releases, `past_key_values` before. A model's forward also takes **kwargs, so passing the
    wrong one is silently ignored (the forward would then run without the prefix)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.no_grad()
def forward(model: Any, ids: Sequence[int], past: Optional[KVCache] = None,
            logits_to_keep: int = 0) -> Tuple[torch.Tensor, KVCache]:
    """Logits [tokens, vocab] (float32) and the new legacy KV of `ids` after the cache `past`
    (positions continue from past's length). logits_to_keep=k keeps the last k positions only."""
    x = torch.as_tensor(list(ids), dtype=torch.long).view(1, -1)
    past_kw = {_cache_keyword(model): as_cache(past)}
    out = model(x, use_cache=True, logits_to_keep=logits_to_keep, **past_kw)
    cache = output_cache(out)
    return out.logits[0].float(), tuple((layer.keys, layer.values) for layer in cache.layers)


def prefix_kv(model: Any, ids: Sequence[int]) -> KVCache:
    """The model's own legacy KV of `ids` (one forward from position 0)."""
    return forward(model, ids, logits_to_keep=1)[1]


def _decoder(model: Any) -> Any:
    base = getattr(model, "model", None)
    if base is None and hasattr(model, "get_decoder"):
        base = model.get_decoder()
    if base is None or not isinstance(getattr(base, "layers", None), torch.nn.ModuleList):
        raise TypeError("model: expected a Hugging Face causal LM whose base model keeps its "
                        f"decoder layers in .layers, got {type(model).__name__}")
    return base


@torch.no_grad()
def own_first_layers(model: Any, tokens: Sequence[int], layers: int) -> KVCache:
    """The model's own legacy KV of its first `layers` layers for `tokens` at positions 0..n-1:
    one (key, value) pair per layer, [1, kv_heads, n, head_dim], the model's dtype and device.
    Only those layers run: a shallow view of the base model (``model.model`` or
    ``model.get_decoder()``, its decoder layers in a ``layers`` ModuleList) with the first
    `layers` of them, sharing the weights; the model is not modified."""
    base = _decoder(model)
    k = _args.size("layers", layers)
    if not 1 <= k <= len(base.layers):
        raise InvalidArgumentError(f"layers: expected 1..{len(base.layers)}, got {k}")
    ids = torch.as_tensor(list(tokens), dtype=torch.long).view(1, -1)
    if ids.shape[1] == 0:
        raise InvalidArgumentError("tokens: expected at least one token")
    head = copy.copy(base)                    # shares parameters, buffers and config
    head._modules = dict(base._modules)       # its own module table: `base` stays whole
    head.layers = torch.nn.ModuleList(list(base.layers)[:k])
    from transformers import DynamicCache

    out = head(input_ids=ids.to(next(base.parameters()).device), cache=DynamicCache(),
               use_cache=True)
    cache = output_cache(out)
    return tuple((key, value) for key, value in cache_layers(cache))[:k]


@torch.no_grad()
def key_norm(model: Any) -> Optional[torch.Tensor]:
    """The gains of the model's key norm, float32 [layers, head_dim], for AdapterFitter's
    target_key_norm; None for a model whose attention has no ``k_norm`` (Llama, SmolLM2, Qwen2).

    Models that RMS-normalize each key head before RoPE (Gemma 3, Qwen3) keep the norm as
    ``self_attn.k_norm`` of each decoder layer; its gains are read off by normalizing a vector of
    ones (so both conventions, ``weight * x`` and Gemma's ``(1 + weight) * x``, come out right)
    and checked on a random vector: a ``k_norm`` that is not an RMS norm of one head with
    elementwise gains (OLMo 2 normalizes all heads together) raises InvalidArgumentError rather
    than give gains that would convert wrongly."""
    layers = _decoder(model).layers
    norms = [getattr(getattr(layer, "self_attn", None), "k_norm", None) for layer in layers]
    if all(n is None for n in norms):
        return None
    if any(n is None for n in norms):
        raise InvalidArgumentError("key_norm: some decoder layers have a k_norm and others not")
    head_dim = getattr(getattr(layers[0], "self_attn", None), "head_dim", None)
    gains = []
    g = torch.Generator().manual_seed(0)
    for j, norm in enumerate(norms):
        param = next(norm.parameters(), None)
        dtype = param.dtype if param is not None else torch.float32
        device = param.device if param is not None else torch.device("cpu")
        size = head_dim or (param.numel() if param is not None else 0)
        ones = torch.ones(size, dtype=dtype, device=device)
        gain = norm(ones).float().cpu()
        x = torch.randn(3, size, generator=g)
        rms = x.pow(2).mean(-1, keepdim=True).sqrt()
        got = norm(x.to(dtype=dtype, device=device)).float().cpu()
        want = gain * x / rms
        if gain.shape != (size,) or not torch.allclose(got, want, rtol=1e-2,
                                                       atol=1e-2 * float(want.abs().max())):
            raise InvalidArgumentError(
                f"key_norm: layer {j}'s k_norm ({type(norm).__name__}) is not an RMS norm of one "
                f"key head of {size} with elementwise gains; kvbridge cannot keep its keys on it")
        gains.append(gain)
    return torch.stack(gains)


@torch.no_grad()
def token_codes(model: Any) -> torch.Tensor:
    """Codes of the model's vocabulary for AdapterFitter's target_token_codes, float32
    [vocab, hidden]: each token's input embedding scaled to unit RMS, as the first layer's norm
    sees it before its gains. The fitter compresses them to the directions its maps use
    (token_code_dims), so an adapter carries a small fixed table and a server needs only the
    token ids."""
    e = model.get_input_embeddings().weight.detach().float().cpu()
    return (e / e.pow(2).mean(-1, keepdim=True).add(1e-12).sqrt()).contiguous()


__all__: List[str] = ["as_cache", "forward", "full_cache", "is_cache", "key_norm",
                      "legacy_to_cache", "own_first_layers", "prefix_kv", "to_dynamic_cache",
                      "token_codes", "to_legacy"]
