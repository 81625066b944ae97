"""transformers DynamicCache in and out of kvbridge, driving the testbed models' forward and
generate()."""
import pytest
import torch

pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

import kvbridge  # noqa: E402
from kvbridge import hf  # noqa: E402
from kvbridge.experiments import testbed  # noqa: E402

from conftest import random_kv  # noqa: E402

LOGIT_ATOL = 1e-4  # float32 cached vs full forward (see test_testbed.py)
CHUNK = 16


@pytest.fixture(scope="module")
def pair():
    return testbed.load_pair()


def prompt(tok, index, length):
    ids = tok.encode(testbed.texts("heldout")[index])
    while len(ids) < length:  # long enough: append the next fortunes
        index += 1
        ids += tok.encode(testbed.texts("heldout")[index], add_bos=False)
    return ids[:length]


def greedy(model, ids, new_tokens, cache=None):
    kwargs = {} if cache is None else {"cache": cache}
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, num_beams=1,
                             pad_token_id=testbed.load_tokenizer().pad_id,
                             eos_token_id=None, **kwargs)
    return out[0, ids.shape[1]:].tolist()


def test_legacy_and_dynamic_cache_round_trip(spec):
    legacy = random_kv(spec, 7, seed=3, strided=True)
    cache = hf.to_dynamic_cache(legacy)
    assert isinstance(cache, DynamicCache) and hf.is_cache(cache) and not hf.is_cache(legacy)
    assert len(cache.layers) == spec.num_layers and cache.get_seq_length() == 7
    back = hf.to_legacy(cache)
    assert isinstance(back, tuple) and len(back) == spec.num_layers
    for (k0, v0), (k1, v1) in zip(legacy, back):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    # to_legacy shares the cache's tensors; the cache holds its own copies of the input.
    assert back[0][0].data_ptr() == cache.layers[0].keys.data_ptr()
    assert back[0][0].data_ptr() != legacy[0][0].data_ptr()
    assert hf.to_dynamic_cache(cache) is cache
    assert all(torch.equal(a[0], b[0]) for a, b in zip(hf.to_legacy(list(legacy)), legacy))


def test_bad_caches_are_refused(spec):
    class Layer:
        def __init__(self, sliding, keys, seen=None):
            self.is_sliding, self.keys, self.values = sliding, keys, keys
            if seen is not None:
                self.cumulative_length = seen

    class Cache:
        def __init__(self, layers):
            self.layers = layers

    t = torch.randn(1, 2, 4, 6)
    with pytest.raises(ValueError, match="holds only the last 4 of its 9 tokens"):
        hf.to_legacy(Cache([Layer(False, t), Layer(True, t, seen=9)]))
    with pytest.raises(ValueError, match="layer 1"):
        hf.to_legacy(Cache([Layer(False, t), Layer(False, None)]))
    with pytest.raises(ValueError, match="no layers"):
        hf.to_legacy(DynamicCache())  # nothing cached yet
    with pytest.raises(TypeError):
        hf.to_legacy(t)
    store = kvbridge.KVStore(1 << 20, chunk_tokens=4)
    with pytest.raises(ValueError, match="sliding"):
        store.put(spec, list(range(4)), Cache([Layer(True, t, seen=5)] * spec.num_layers))


def test_sliding_window_layers_in_and_out():
    """transformers' DynamicSlidingWindowLayer: taken while it holds every token it has seen,
    refused once it dropped some, and built from per-layer windows on the way out holding the
    last window - 1 tokens, as the model's own cache would."""
    g = torch.Generator().manual_seed(5)
    kv = [(torch.randn(1, 2, 9, 6, generator=g), torch.randn(1, 2, 9, 6, generator=g))
          for _ in range(3)]
    short = hf.to_dynamic_cache([(k[:, :, :3], v[:, :, :3]) for k, v in kv], windows=[0, 4, 0])
    assert [type(l).__name__ for l in short.layers] == [
        "DynamicLayer", "DynamicSlidingWindowLayer", "DynamicLayer"]
    back = hf.to_legacy(short)  # 3 tokens < window 4: nothing dropped
    assert all(torch.equal(b[0], k[:, :, :3]) for b, (k, _) in zip(back, kv))
    long = hf.to_dynamic_cache(kv, windows=[0, 4, 0])
    assert long.layers[1].keys.shape[-2] == 3 and torch.equal(long.layers[1].keys, kv[1][0][:, :, -3:])
    assert long.layers[0].keys.shape[-2] == 9 and long.get_seq_length(1) == 9
    with pytest.raises(ValueError, match="layer 1 of the cache is a sliding-window layer"):
        hf.to_legacy(long)
    with pytest.raises(ValueError, match="windows: expected one per layer"):
        hf.to_dynamic_cache(kv, windows=[0, 4])
    full = hf.full_cache()
    assert type(full).__name__ == "DynamicCache" and not full.layers or all(
        not getattr(l, "is_sliding", False) for l in full.layers)


def test_store_accepts_and_returns_dynamic_caches(spec):
    tokens = list(range(100, 113))
    legacy = random_kv(spec, len(tokens), seed=11)
    store = kvbridge.KVStore(1 << 22, chunk_tokens=4)
    assert store.put(spec, tokens, hf.to_dynamic_cache(legacy)) == 12
    plain = store.match(spec, tokens)
    as_cache = store.match(spec, tokens, as_cache=True)
    assert isinstance(plain.kv, tuple) and isinstance(as_cache.kv, DynamicCache)
    assert as_cache.tokens == 12 and as_cache.kv.get_seq_length() == 12
    for (k, v), (ck, cv) in zip(legacy, hf.to_legacy(as_cache.kv)):
        assert torch.equal(ck, k[:, :, :12]) and torch.equal(cv, v[:, :, :12])


def test_forward_from_a_stored_cache_equals_full_forward(pair):
    tm = pair.source
    ids = prompt(pair.tokenizer, 5, 3 * CHUNK + 9)
    x = torch.tensor([ids])
    store = kvbridge.KVStore(1 << 24, chunk_tokens=CHUNK)
    _, kv = testbed.prefill(tm, x)
    assert store.put(tm.spec, ids, kv) == 3 * CHUNK
    found = store.match(tm.spec, ids, as_cache=True)
    assert found.tokens == 3 * CHUNK
    with torch.no_grad():
        full = tm.model(x, use_cache=False).logits
        out = tm.model(x[:, found.tokens:], cache=found.kv, use_cache=True)
    torch.testing.assert_close(out.logits, full[:, found.tokens:], rtol=0, atol=LOGIT_ATOL)
    assert out.cache.get_seq_length() == len(ids)


@pytest.mark.parametrize("which", ["source", "target"])
def test_generate_from_a_stored_cache_equals_own_prefill(pair, which):
    tm = getattr(pair, which)
    ids = prompt(pair.tokenizer, 9, 4 * CHUNK + 5)
    x = torch.tensor([ids])
    bridge = kvbridge.Bridge(kvbridge.KVStore(1 << 24, chunk_tokens=CHUNK))
    with torch.no_grad():
        out = tm.model(x, use_cache=True)
    assert bridge.save(tm.spec, ids, out.cache) == 4 * CHUNK  # a DynamicCache goes in
    loaded = bridge.load(tm.spec, ids, as_cache=True)
    assert loaded.tokens == 4 * CHUNK and not loaded.converted
    assert isinstance(loaded.kv, DynamicCache)
    own = greedy(tm.model, x, 24)
    reused = greedy(tm.model, x, 24, cache=loaded.kv)
    assert reused == own
    assert len(own) == 24


def test_converted_cache_drives_target_generate(pair):
    tok, a, b = pair.tokenizer, pair.source, pair.target
    fitter = kvbridge.AdapterFitter(a.spec, b.spec, source_layers="all", seed=0)
    for text in testbed.texts("train")[:400:10]:
        x = torch.tensor([tok.encode(text)[:testbed.MAX_CONTEXT]])
        _, kv_a = testbed.prefill(a, x)
        with torch.no_grad():
            cache_b = b.model(x, use_cache=True).cache
        fitter.add(kv_a, cache_b)  # legacy tuple and DynamicCache mixed
    adapter = fitter.fit()

    ids = prompt(tok, 20, 96)
    x = torch.tensor([ids])
    prefix = 80
    with torch.no_grad():
        cache_a = a.model(x[:, :prefix], use_cache=True).cache
    converted = adapter.convert(cache_a)  # DynamicCache in, DynamicCache out
    assert isinstance(converted, DynamicCache)
    assert converted.get_seq_length() == prefix
    for layer in converted.layers:
        assert layer.keys.shape == (1, b.spec.num_kv_heads, prefix, b.spec.head_dim)
    legacy = adapter.convert(hf.to_legacy(cache_a))
    assert isinstance(legacy, tuple)
    assert all(torch.equal(k, layer.keys) for (k, _), layer in zip(legacy, converted.layers))

    new = greedy(b.model, x, 16, cache=converted)
    assert len(new) == 16 and all(0 <= t < tok.vocab_size for t in new)
    # Sensible, not exact: teacher-forced over the rest of the prompt, B's next-token
    # predictions with the converted cache mostly agree with those after its own prefill, and
    # its loss there is far from a uniform guess.
    with torch.no_grad():
        own = b.model(x, use_cache=False).logits[0, prefix:-1]
        conv = b.model(x[:, prefix:-1], cache=hf.to_dynamic_cache(legacy), use_cache=True)
    conv_logits = conv.logits[0]
    agreement = (own.argmax(-1) == conv_logits.argmax(-1)).double().mean().item()
    conv_loss = torch.nn.functional.cross_entropy(conv_logits, x[0, prefix + 1:]).item()
    print(f"converted-cache agreement {agreement:.3f}, loss {conv_loss:.3f} nats/token")
    assert agreement >= 0.5, agreement
    assert conv_loss < 0.75 * torch.log(torch.tensor(float(tok.vocab_size))).item(), conv_loss


def test_output_cache_reads_either_name():
    """transformers names the forward output's cache `cache` (the version installed here) or
    `past_key_values` (older ones, such as vLLM's pin); an empty cache is still the cache."""
    from types import SimpleNamespace

    from kvbridge._tensors import output_cache

    new, old, empty = object(), object(), []
    assert output_cache(SimpleNamespace(cache=new, past_key_values=None)) is new
    assert output_cache(SimpleNamespace(past_key_values=old)) is old
    assert output_cache(SimpleNamespace(cache=None, past_key_values=old)) is old
    assert output_cache(SimpleNamespace(cache=empty, past_key_values=old)) is empty
