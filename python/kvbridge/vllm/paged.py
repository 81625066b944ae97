"""Reading and writing a request's tokens in vLLM's paged KV cache (no vLLM import needed).

vLLM hands a connector one tensor per attention layer, logically ``[num_blocks, kv_heads,
block_size, 2 * head_dim]`` with backend-chosen strides. Two content layouts exist:

- ``"cpu"`` (vLLM's CPU attention backend, its "vec" kernels): each (block, head) interior of
  ``2 * block_size * head_dim`` contiguous elements holds the block's keys head-dim major
  (``[head_dim, block_size]``: element (token n, channel d) at ``d * block_size + n``), then
  its values token major (``[block_size, head_dim]``). Established against the testbed's
  Hugging Face prefill; the connector re-checks it at start with vLLM's own cache-write op;
- ``"split"`` (FlashAttention and FlashInfer): the last dimension is ``[key | value]``, each
  ``head_dim`` wide; the other three dimensions may have any strides (NHD or HND pages).

`kv_views` turns either into two strided ``[num_blocks, kv_heads, block_size, head_dim]``
views (no copy); `gather` copies a request's first tokens out into ``[1, kv_heads, tokens,
head_dim]`` tensors (the one copy a save costs), `scatter` writes a token range back in place.
Block ids index dimension 0; token ``t`` of a request lives in block ``block_ids[t //
block_size]`` at offset ``t % block_size``.
"""
from __future__ import annotations

from typing import Sequence, Tuple, Union

import torch

from kvbridge import _core
from kvbridge._core import InvalidArgumentError

LAYOUTS = ("cpu", "split")

BlockIds = Union[Sequence[int], torch.Tensor]


def kv_views(kv_layer: torch.Tensor, layout: str, head_dim: int) -> Tuple[torch.Tensor,
                                                                        torch.Tensor]:
    """(keys, values), each a ``[num_blocks, kv_heads, block_size, head_dim]`` view of
    `kv_layer` (``[num_blocks, kv_heads, block_size, 2 * head_dim]``, see the module
    docstring)."""
    if layout not in LAYOUTS:
        raise InvalidArgumentError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    if kv_layer.dim() != 4 or kv_layer.shape[3] != 2 * head_dim:
        raise InvalidArgumentError("kv_layer: expected [num_blocks, kv_heads, block_size, "
                                   f"2 * head_dim = {2 * head_dim}], got {tuple(kv_layer.shape)}")
    if layout == "split":
        return kv_layer[..., :head_dim], kv_layer[..., head_dim:]
    blocks, heads, block_size, _ = kv_layer.shape
    s_block, s_head, s_tok, s_c = kv_layer.stride()
    if s_c != 1 or (block_size > 1 and s_tok != 2 * head_dim):
        raise InvalidArgumentError("kv_layer: the CPU layout needs each (block, head) interior dense, "
                                   f"got strides {kv_layer.stride()}")
    shape = (blocks, heads, block_size, head_dim)
    base = kv_layer.storage_offset()
    keys = kv_layer.as_strided(shape, (s_block, s_head, 1, block_size), base)
    values = kv_layer.as_strided(shape, (s_block, s_head, head_dim, 1),
                                 base + block_size * head_dim)
    return keys, values


def _slots(block_ids: BlockIds, block_size: int, start: int, stop: int,
           device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    ids = torch.as_tensor(block_ids, dtype=torch.long)
    if stop > ids.numel() * block_size:
        raise InvalidArgumentError(f"tokens [{start}, {stop}) need {-(-stop // block_size)} blocks, "
                         f"got {ids.numel()}")
    pos = torch.arange(start, stop, dtype=torch.long)
    return ids[pos // block_size].to(device), (pos % block_size).to(device)


def gather(keys: torch.Tensor, values: torch.Tensor, block_ids: BlockIds,
           num_tokens: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Copies tokens ``[0, num_tokens)`` out of one layer's `kv_views`: two fresh contiguous
    ``[1, kv_heads, num_tokens, head_dim]`` tensors on the cache's device."""
    blk, off = _slots(block_ids, keys.shape[2], 0, num_tokens, keys.device)
    # Advanced indices around a slice put the token axis first: [tokens, heads, head_dim].
    return (keys[blk, :, off].transpose(0, 1).unsqueeze(0).contiguous(),
            values[blk, :, off].transpose(0, 1).unsqueeze(0).contiguous())


def scatter(keys: torch.Tensor, values: torch.Tensor, block_ids: BlockIds, start: int,
            src_keys: torch.Tensor, src_values: torch.Tensor) -> None:
    """Writes tokens ``[start, start + n)`` of a request into one layer's `kv_views`, in place.

    src_keys, src_values: ``[1, kv_heads, n, head_dim]`` (any strides, any device: copied to
    the cache's device and dtype), the KV of those tokens.
    """
    n = src_keys.shape[2]
    if src_keys.shape != src_values.shape or src_keys.dim() != 4 or src_keys.shape[0] != 1:
        raise InvalidArgumentError("src_keys, src_values: expected two [1, kv_heads, n, head_dim] tensors, "
                                   f"got {tuple(src_keys.shape)} and {tuple(src_values.shape)}")
    blk, off = _slots(block_ids, keys.shape[2], start, start + n, keys.device)
    keys[blk, :, off] = src_keys[0].transpose(0, 1).to(keys.device, keys.dtype)
    values[blk, :, off] = src_values[0].transpose(0, 1).to(values.device, values.dtype)


__all__ = ["LAYOUTS", "gather", "kv_views", "scatter"]
