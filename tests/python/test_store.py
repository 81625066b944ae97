import numpy as np
import pytest
import torch

import kvbridge
from conftest import random_kv, run_threads


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("strided", [False, True])
def test_put_match_round_trip(dtype, strided):
    spec = kvbridge.ModelSpec("m", 3, 5, 14, dtype=dtype)
    store = kvbridge.KVStore(1 << 24, chunk_tokens=16)
    tokens = np.random.default_rng(1).integers(0, 50000, size=3 * 16 + 7)
    kv = random_kv(spec, len(tokens), seed=2, strided=strided)
    assert store.put(spec, tokens, kv) == 48
    m = store.match(spec, tokens)
    assert m.tokens == 48
    assert len(m.kv) == 3
    for (k, v), (k0, v0) in zip(m.kv, kv):
        assert k.shape == (1, 5, 48, 14) and k.dtype == getattr(torch, dtype)
        assert torch.equal(k, k0[:, :, :48]) and torch.equal(v, v0[:, :, :48])


@pytest.mark.parametrize("make", [list, np.asarray, torch.tensor,
                                  lambda t: torch.tensor(t, dtype=torch.int32),
                                  lambda t: np.asarray(t, dtype=np.uint32)])
def test_token_containers(spec, make):
    store = kvbridge.KVStore(1 << 22, chunk_tokens=4)
    tokens = list(range(100, 112))
    store.put(spec, make(tokens), random_kv(spec, 12, 1))
    assert store.match(spec, make(tokens)).tokens == 12
    assert store.match(spec, tokens).tokens == 12


def test_miss_namespace_and_partial(spec):
    store = kvbridge.KVStore(1 << 22, chunk_tokens=8)
    tokens = list(range(20))
    store.put(spec, tokens, random_kv(spec, 20, 1), namespace="a")
    assert store.match(spec, tokens, namespace="a").tokens == 16
    miss = store.match(spec, tokens, namespace="b")
    assert miss.tokens == 0 and miss.kv is None
    assert store.match(spec, tokens[:7], namespace="a").tokens == 0
    assert store.match(spec, tokens, namespace="a", return_kv=False).kv is None
    other = kvbridge.ModelSpec("test-model", 3, 2, 6, version="v2")
    assert store.match(other, tokens, namespace="a").tokens == 0
    st = store.stats()
    assert st["hits"] == 2 and st["misses"] == 3 and st["entries"] == 2


def test_budget_and_eviction(spec):
    per_entry = spec.kv_bytes_per_token() * 8 + 4 * 8 + 128
    store = kvbridge.KVStore(5 * per_entry, chunk_tokens=8)
    for i in range(50):
        store.put(spec, list(range(i * 100, i * 100 + 16)), random_kv(spec, 16, i))
        assert store.stats()["bytes_used"] <= 5 * per_entry
    st = store.stats()
    assert st["peak_bytes"] <= 5 * per_entry and st["evictions"] > 0
    # The most recent prompt survived.
    assert store.match(spec, list(range(4900, 4916))).tokens == 16


def test_erase_and_clear(spec):
    store = kvbridge.KVStore(1 << 22, chunk_tokens=4)
    store.put(spec, list(range(8)), random_kv(spec, 8, 1))
    assert store.erase(spec, list(range(8))) == 2
    assert store.match(spec, list(range(8))).tokens == 0
    store.put(spec, list(range(8)), random_kv(spec, 8, 1))
    store.clear()
    assert store.stats()["entries"] == 0 and store.stats()["bytes_used"] == 0


def test_threads(spec):
    store = kvbridge.KVStore(1 << 20, chunk_tokens=4, num_shards=4)
    prompts = [list(range(p * 50, p * 50 + 4 * (1 + p % 3))) for p in range(16)]
    kvs = [random_kv(spec, len(t), p) for p, t in enumerate(prompts)]
    errors = []

    def work(seed):
        rng = np.random.default_rng(seed)
        for _ in range(300):
            p = int(rng.integers(len(prompts)))
            if rng.random() < 0.4:
                store.put(spec, prompts[p], kvs[p])
            else:
                m = store.match(spec, prompts[p])
                for (k, v), (k0, v0) in zip(m.kv or (), kvs[p]):
                    if not (torch.equal(k, k0[:, :, :m.tokens]) and torch.equal(v, v0[:, :, :m.tokens])):
                        errors.append(p)

    run_threads(work)
    assert errors == []
    assert store.stats()["hits"] > 0


def test_put_with_provenance_is_purged_by_invalidate_adapter(spec):
    """KV put with a provenance (converted_from, adapter) is reported by match and removed by
    invalidate_adapter of that adapter; the model's own KV and chunks stored before keep theirs."""
    store = kvbridge.KVStore(1 << 22, chunk_tokens=8)
    source_fp, adapter_fp, other_fp = "1" * 32, "a" * 32, "b" * 32
    tokens = list(range(40))
    store.put(spec, tokens[:8], random_kv(spec, 8, 1))  # the model's own first chunk
    assert store.put(spec, tokens[:24], random_kv(spec, 24, 2), converted_from=source_fp,
                     adapter=adapter_fp) == 24
    hit = store.match(spec, tokens)
    assert (hit.tokens, hit.converted_from, hit.adapter) == (24, source_fp, adapter_fp)
    assert store.match(spec, tokens, return_kv=False).adapter == adapter_fp
    # the first chunk was stored before: it keeps its (own) provenance and its KV
    head = store.match(spec, tokens[:8])
    assert (head.converted_from, head.adapter) == ("", "")
    assert torch.equal(head.kv[0][0], random_kv(spec, 8, 1)[0][0])
    assert store.invalidate_adapter(spec, other_fp)["memory"] == 0
    assert store.invalidate_adapter(spec, adapter_fp)["memory"] == 2
    assert store.match(spec, tokens).tokens == 8
    for bad in ({"converted_from": source_fp}, {"adapter": adapter_fp},
                {"converted_from": "xyz", "adapter": adapter_fp}):
        with pytest.raises(kvbridge.InvalidArgumentError, match="fingerprint"):
            store.put(spec, tokens[:16], random_kv(spec, 16, 3), **bad)
    with pytest.raises(TypeError, match="adapter"):
        store.put(spec, tokens[:16], random_kv(spec, 16, 3), converted_from=source_fp,
                  adapter=None)
    assert store.match(spec, tokens).tokens == 8  # refused puts stored nothing
