"""Paged-cache views, gather and scatter for vLLM's CPU layout and the GPU backends'
(FlashAttention / FlashInfer) layouts, on CPU tensors, against element-by-element float64
references that read the raw memory as each backend does."""
import pytest
import torch

pytest.importorskip("vllm")

from kvbridge.vllm import paged  # noqa: E402

BLOCKS, HEADS, BS, D = 7, 3, 5, 6   # odd sizes on purpose


def cpu_cache(gen):
    """CPU_ATTN: [blocks, heads, bs, 2D] contiguous; each (block, head) interior holds the
    keys as [D, bs] (channel major), then the values as [bs, D]."""
    return torch.randn(BLOCKS, HEADS, BS, 2 * D, generator=gen)


def split_cache(gen, order):
    """FlashAttention/FlashInfer: logical [blocks, heads, bs, 2D] ([K | V] last), physical
    order NHD ([blocks, bs, heads, 2D]) or HND, and a padded block stride."""
    if order == "NHD":
        raw = torch.randn(BLOCKS, BS, HEADS, 2 * D + 4, generator=gen)[..., :2 * D]
        return raw.permute(0, 2, 1, 3)
    raw = torch.randn(BLOCKS + 2, HEADS, BS, 2 * D, generator=gen)[1:-1]
    return raw


def ref_kv(cache, layout, b, h, n, d):
    """(key, value) element of token offset n in block b, head h, channel d, in float64."""
    if layout == "cpu":
        flat = cache[b, h].reshape(-1).double()
        return float(flat[d * BS + n]), float(flat[BS * D + n * D + d])
    return float(cache[b, h, n, d]), float(cache[b, h, n, D + d])


CASES = [("cpu", None), ("split", "NHD"), ("split", "HND")]


@pytest.mark.parametrize("layout,order", CASES)
def test_gather_matches_reference(layout, order):
    gen = torch.Generator().manual_seed(11)
    cache = cpu_cache(gen) if layout == "cpu" else split_cache(gen, order)
    block_ids = [4, 0, 6, 2]
    tokens = 17                                  # 3 whole blocks and 2 tokens of the 4th
    keys, values = paged.kv_views(cache, layout, D)
    assert keys.data_ptr() >= cache.data_ptr()   # views, no copy
    k, v = paged.gather(keys, values, block_ids, tokens)
    assert k.shape == (1, HEADS, tokens, D) and v.shape == (1, HEADS, tokens, D)
    for t in range(tokens):
        b, n = block_ids[t // BS], t % BS
        for h in range(HEADS):
            for d in range(D):
                rk, rv = ref_kv(cache, layout, b, h, n, d)
                assert float(k[0, h, t, d]) == rk and float(v[0, h, t, d]) == rv


@pytest.mark.parametrize("layout,order", CASES)
def test_scatter_writes_only_the_range(layout, order):
    gen = torch.Generator().manual_seed(12)
    cache = cpu_cache(gen) if layout == "cpu" else split_cache(gen, order)
    before = cache.clone()
    block_ids = [3, 5, 1]
    start, n = 4, 9                               # tokens 4..12, across all three blocks
    src = torch.randn(2, HEADS, D, n + 3, generator=gen).transpose(2, 3)[:, :, 1:n + 1]
    src_k, src_v = src[0:1], src[1:2]             # strided [1, heads, n, D]
    keys, values = paged.kv_views(cache, layout, D)
    paged.scatter(keys, values, block_ids, start, src_k, src_v)
    written = set()
    for i in range(n):
        t = start + i
        b, off = block_ids[t // BS], t % BS
        for h in range(HEADS):
            for d in range(D):
                rk, rv = ref_kv(cache, layout, b, h, off, d)
                assert rk == float(src_k[0, h, i, d]) and rv == float(src_v[0, h, i, d])
                written.add((b, h, off, d))
    # everything else is untouched
    for b in range(BLOCKS):
        for h in range(HEADS):
            for off in range(BS):
                for d in range(D):
                    if (b, h, off, d) not in written:
                        assert ref_kv(cache, layout, b, h, off, d) == \
                            ref_kv(before, layout, b, h, off, d)


def test_round_trip_bfloat16_cpu_layout():
    gen = torch.Generator().manual_seed(13)
    cache = cpu_cache(gen).to(torch.bfloat16)
    keys, values = paged.kv_views(cache, "cpu", D)
    k, v = paged.gather(keys, values, [2, 6], 8)
    other = torch.zeros_like(cache)
    ok, ov = paged.kv_views(other, "cpu", D)
    paged.scatter(ok, ov, [1, 3], 0, k, v)
    k2, v2 = paged.gather(ok, ov, [1, 3], 8)
    assert torch.equal(k, k2) and torch.equal(v, v2)


def test_bad_inputs():
    gen = torch.Generator().manual_seed(14)
    cache = cpu_cache(gen)
    with pytest.raises(ValueError, match="layout"):
        paged.kv_views(cache, "nhd", D)
    with pytest.raises(ValueError, match="2 \\* head_dim"):
        paged.kv_views(cache, "cpu", D + 1)
    with pytest.raises(ValueError, match="dense"):
        paged.kv_views(split_cache(gen, "NHD"), "cpu", D)
    keys, values = paged.kv_views(cache, "cpu", D)
    with pytest.raises(ValueError, match="blocks"):
        paged.gather(keys, values, [0], BS + 1)


@pytest.mark.parametrize("dtype,block_size,head_dim", [(torch.float32, 32, 32),
                                                       (torch.float16, 64, 32),
                                                       (torch.bfloat16, 32, 64)])
def test_cpu_layout_is_what_vllm_writes(dtype, block_size, head_dim):
    """vLLM's own CPU cache-write op and paged's "cpu" layout agree for the "vec" kernels (the
    check the connector runs at start); the AMX kernels' packed bfloat16 blocks are refused."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kvbridge.vllm.worker import check_cpu_layout

    if _get_attn_isa(dtype, block_size, head_dim) == "amx":
        with pytest.raises(ValueError, match="'amx'.*not supported"):
            check_cpu_layout(dtype, 3, block_size, head_dim)
    else:
        check_cpu_layout(dtype, 3, block_size, head_dim)
