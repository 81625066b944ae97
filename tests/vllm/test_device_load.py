"""kvbridge.vllm.device_load: converted loads made on the paged cache's device, against
Bridge.load (the C++ load policy, converting on the CPU) on seeded random KV of the shipped
adapter's source and target specs; through the connector worker's load_into_blocks into the GPU
backends' ("split") layout on CPU tensors; and on CUDA where there is one."""
import pytest
import torch

pytest.importorskip("vllm")

import kvbridge  # noqa: E402
from kvbridge.experiments.vllm_testbed import ADAPTER  # noqa: E402
from kvbridge.vllm import device_load, metadata, paged, worker  # noqa: E402

CHUNK = 32
NS = "tenant"


@pytest.fixture(scope="module")
def adapter():
    return kvbridge.LinearAdapter.load(ADAPTER)


def random_kv(spec, tokens, seed):
    """Seeded random KV of `spec`, strided (every other token of a wider tensor)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(spec.num_layers):
        k, v = (torch.randn(1, spec.num_kv_heads, 2 * tokens, spec.head_dim,
                            generator=gen)[:, :, ::2] for _ in range(2))
        out.append((k, v))
    return tuple(out)


def make_bridge(adapter, prompt, source_tokens, native_tokens, seed=0, **options):
    # The policy cases below assume no tail unless they give one (the shipped adapter records
    # 96: the "recompute_tail": -1 cases use it).
    options.setdefault("recompute_tail", 0)
    store = kvbridge.KVStore(1 << 26, chunk_tokens=CHUNK)
    if source_tokens:
        store.put(adapter.source, prompt[:source_tokens],
                  random_kv(adapter.source, source_tokens, seed + 1), NS)
    if native_tokens:
        store.put(adapter.target, prompt[:native_tokens],
                  random_kv(adapter.target, native_tokens, seed + 2), NS)
    bridge = kvbridge.Bridge(store, write_back=False, **options)
    bridge.add_adapter(adapter)
    return bridge


def prompt_of(n, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=gen).tolist()


def assert_same_load(got, want, atol=0.0):
    assert (got.tokens, got.converted, got.native_tokens) == \
        (want.tokens, want.converted, want.native_tokens)
    if want.tokens == 0:
        assert got.kv is None
        return
    assert (got.source, got.converted_from, got.adapter) == \
        (want.source, want.converted_from, want.adapter)
    assert len(got.kv) == len(want.kv)
    for (gk, gv), (wk, wv) in zip(got.kv, want.kv):
        assert gk.shape == wk.shape and gv.shape == wv.shape
        if atol == 0.0:
            assert torch.equal(gk.cpu(), wk) and torch.equal(gv.cpu(), wv)
        else:
            torch.testing.assert_close(gk.cpu(), wk, rtol=1e-4, atol=atol)
            torch.testing.assert_close(gv.cpu(), wv, rtol=1e-4, atol=atol)


# (prompt length, source tokens cached, native tokens cached, Bridge options)
CASES = [
    (101, 96, 0, {}),                        # converted only
    (101, 96, 32, {}),                       # native head + converted tail
    (101, 32, 64, {}),                       # the native prefix is longer: native only
    (101, 64, 64, {}),                       # as long: native only (converted must be longer)
    (96, 96, 0, {}),                         # whole prompt cached: n - 1 tokens
    (101, 96, 32, {"recompute_tail": 5}),    # converted part cut to n - 1 - 5
    (101, 96, 0, {"recompute_tail": -1}),    # the adapter's recorded tail (96): n - 1 - 96
    (101, 96, 32, {"recompute_tail": -1}),   # ... no longer than the native 32: native only
    (101, 96, 0, {"min_quality": 0.99}),     # under the quality gate: a miss
    (101, 96, 64, {"min_quality": 0.99}),    # under the quality gate: native only
    (101, 0, 0, {}),                         # nothing cached
    (1, 0, 0, {}),                           # one-token prompt
]


@pytest.mark.parametrize("n,source_tokens,native_tokens,options", CASES)
def test_matches_bridge_load(adapter, n, source_tokens, native_tokens, options):
    prompt = prompt_of(n)
    bridge = make_bridge(adapter, prompt, source_tokens, native_tokens, **options)
    want = bridge.load(adapter.target, prompt, NS)
    got = device_load.load(bridge, adapter.target, prompt, NS, "cpu")
    assert_same_load(got, want)
    assert got.converted == (source_tokens > native_tokens and "min_quality" not in options
                             and (options.get("recompute_tail") != -1 or native_tokens == 0))


@pytest.mark.parametrize("n,source_tokens,native_tokens", [(101, 96, 0), (101, 96, 32)])
def test_own_start_token_as_bridge_load(adapter, n, source_tokens, native_tokens):
    """With the model's own start-token KV registered (add_start, or an own save), a converted
    load's first token is that KV, as in Bridge.load."""
    prompt = prompt_of(n)
    bridge = make_bridge(adapter, prompt, source_tokens, native_tokens)
    bridge.add_start(adapter.target, prompt[0], random_kv(adapter.target, 1, 9))
    want = bridge.load(adapter.target, prompt, NS)
    got = device_load.load(bridge, adapter.target, prompt, NS, "cpu")
    assert_same_load(got, want)
    if native_tokens == 0:
        start = random_kv(adapter.target, 1, 9)
        assert torch.equal(got.kv[0][0][:, :, :1], start[0][0])


def test_disabled_adapter_and_other_namespace(adapter):
    prompt = prompt_of(101)
    bridge = make_bridge(adapter, prompt, 96, 32)
    assert device_load.load(bridge, adapter.target, prompt, "elsewhere", "cpu").tokens == 0
    bridge.disable_adapter(adapter)
    got = device_load.load(bridge, adapter.target, prompt, NS, "cpu")
    assert (got.tokens, got.converted) == (32, False)
    assert_same_load(got, bridge.load(adapter.target, prompt, NS))


def test_native_hit_on_written_back_entries_reports_their_adapter(adapter):
    """Entries put with the adapter's provenance are native hits that name the adapter, as in
    Bridge.load; invalidate_adapter removes them."""
    prompt = prompt_of(101)
    bridge = make_bridge(adapter, prompt, 0, 0)
    bridge.store.put(adapter.target, prompt[:64], random_kv(adapter.target, 64, 7), NS,
                     converted_from=adapter.source.fingerprint, adapter=adapter.fingerprint)
    got = device_load.load(bridge, adapter.target, prompt, NS, "cpu")
    assert (got.tokens, got.converted, got.adapter) == (64, False, adapter.fingerprint)
    assert_same_load(got, bridge.load(adapter.target, prompt, NS))
    bridge.invalidate_adapter(adapter)
    assert device_load.load(bridge, adapter.target, prompt, NS, "cpu").tokens == 0


def test_written_back_entries_keep_their_adapters_tail(adapter):
    """With the Bridge's default (each adapter's recorded tail, 96 for the shipped adapter)
    written-back entries are cut to n - 1 - 96, as in Bridge.load."""
    prompt = prompt_of(101)
    bridge = make_bridge(adapter, prompt, 0, 0, recompute_tail=-1)
    assert bridge.recompute_tail_for(adapter, 224) == 96
    bridge.store.put(adapter.target, prompt[:64], random_kv(adapter.target, 64, 7), NS,
                     converted_from=adapter.source.fingerprint, adapter=adapter.fingerprint)
    got = device_load.load(bridge, adapter.target, prompt, NS, "cpu")
    assert (got.tokens, got.converted, got.adapter) == (4, False, adapter.fingerprint)
    assert_same_load(got, bridge.load(adapter.target, prompt, NS))


def test_other_targets_are_not_candidates(adapter):
    """An adapter to testbed-b is no candidate for a testbed-a engine."""
    prompt = prompt_of(101)
    bridge = make_bridge(adapter, prompt, 96, 0)
    got = device_load.load(bridge, adapter.source, prompt, NS, "cpu")
    assert (got.tokens, got.converted, got.source) == (96, False, adapter.source.name)


def split_cache(spec, blocks, block_size, seed, device="cpu"):
    """One [blocks, heads, block_size, 2 * head_dim] tensor per layer in the NHD page order
    (FlashAttention's), seeded random."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(blocks, block_size, spec.num_kv_heads, 2 * spec.head_dim,
                        generator=gen).to(device).permute(0, 2, 1, 3)
            for _ in range(spec.num_layers)]


@pytest.mark.parametrize("start,native_tokens", [(0, 0), (32, 32), (7, 0)])
def test_connector_call_site_split_layout(adapter, monkeypatch, start, native_tokens):
    """load_into_blocks with the device path forced on CPU tensors of the "split" layout
    writes the same blocks as its CPU path (Bridge.load), and only the promised range."""
    spec = adapter.target
    prompt = prompt_of(101, seed=9)
    bridge = make_bridge(adapter, prompt, 96, native_tokens, seed=3)
    block_ids = [5, 1, 7, 2]
    op = metadata.LoadOp("r", prompt, NS, start, 96, block_ids)
    caches = {}
    for path in ("cpu", "device"):
        layers = split_cache(spec, 9, CHUNK, seed=4)
        views = [paged.kv_views(kv, "split", spec.head_dim) for kv in layers]
        with monkeypatch.context() as m:
            m.setattr(device_load, "wants_device_load", lambda _layers, on=path == "device": on)
            loaded, converted, failed = worker.load_into_blocks(bridge, spec, views, CHUNK, op)
        assert (loaded, converted, failed) == (96 - start, True, set())
        caches[path] = layers
    untouched = split_cache(spec, 9, CHUNK, seed=4)
    for got, want, before in zip(caches["device"], caches["cpu"], untouched):
        assert torch.equal(got, want)
        assert not torch.equal(got, before)
        # blocks outside the request keep their contents
        for b in set(range(9)) - set(block_ids):
            assert torch.equal(got[b], before[b])


def test_load_failure_is_blocks_to_recompute(adapter, monkeypatch):
    spec = adapter.target
    prompt = prompt_of(101, seed=9)
    bridge = make_bridge(adapter, prompt, 96, 0)

    def broken(*_args, **_kwargs):
        raise RuntimeError("conversion failed")

    monkeypatch.setattr(device_load, "wants_device_load", lambda _layers: True)
    monkeypatch.setattr(kvbridge.LinearAdapter, "convert", broken)
    views = [paged.kv_views(kv, "split", spec.head_dim)
             for kv in split_cache(spec, 9, CHUNK, seed=4)]
    op = metadata.LoadOp("r", prompt, NS, 32, 96, [5, 1, 7, 2])
    loaded, _, failed = worker.load_into_blocks(bridge, spec, views, CHUNK, op)
    assert loaded == 0 and failed == {1, 7}


def _cuda_ready():
    return torch.cuda.is_available() and kvbridge.cuda_device_count() > 0


@pytest.mark.skipif(not _cuda_ready(), reason="needs a CUDA device and a kvbridge built with CUDA")
@pytest.mark.parametrize("n,source_tokens,native_tokens,options", CASES[:5])
def test_cuda_convert_matches_bridge_load(adapter, n, source_tokens, native_tokens, options):
    prompt = prompt_of(n)
    bridge = make_bridge(adapter, prompt, source_tokens, native_tokens, **options)
    want = bridge.load(adapter.target, prompt, NS)
    got = device_load.load(bridge, adapter.target, prompt, NS, "cuda")
    if got.kv is not None:
        assert all(k.is_cuda and v.is_cuda for k, v in got.kv)
    assert_same_load(got, want, atol=1e-4)


@pytest.mark.skipif(not _cuda_ready(), reason="needs a CUDA device and a kvbridge built with CUDA")
def test_cuda_cache_takes_the_device_path(adapter, monkeypatch):
    spec = adapter.target
    prompt = prompt_of(101, seed=9)
    bridge = make_bridge(adapter, prompt, 96, 32, seed=3)
    calls = []
    real = device_load.load
    monkeypatch.setattr(device_load, "load", lambda *a, **k: calls.append(1) or real(*a, **k))
    layers = split_cache(spec, 9, CHUNK, seed=4, device="cuda")
    views = [paged.kv_views(kv, "split", spec.head_dim) for kv in layers]
    op = metadata.LoadOp("r", prompt, NS, 0, 96, [5, 1, 7, 2])
    assert worker.load_into_blocks(bridge, spec, views, CHUNK, op) == (96, True, set())
    assert calls == [1]
    want = bridge.load(spec, prompt, NS)
    for (keys, values), (wk, wv) in zip(views, want.kv):
        k, v = paged.gather(keys, values, op.block_ids, 96)
        torch.testing.assert_close(k.cpu(), wk[:, :, :96], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v.cpu(), wv[:, :, :96], rtol=1e-4, atol=1e-4)
