"""The core reading torch tensors in place (KVStore.put_kv, Match.copy_into, token tensors)
against the general path through TensorView objects, on seeded random data, odd sizes, strided
and offset tensors; and input the in-place readers do not take, which must still be checked and
refused (or served) by the general path."""

import numpy as np
import pytest
import torch

import kvbridge
from conftest import random_kv, run_threads
from kvbridge._tensors import empty_kv, host_kv, kv_views


def offset_kv(spec, tokens, seed):
    """Tensors that start inside a larger storage (a non-zero storage offset) with padded rows."""
    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, spec.dtype)
    out = []
    for _ in range(spec.num_layers):
        big = torch.randn(3, spec.num_kv_heads + 1, tokens + 5, spec.head_dim + 2, generator=g)
        big = big.to(dtype)
        out.append((big[1:2, 1:, 2:2 + tokens, 1:1 + spec.head_dim],
                    big[2:3, :-1, 3:3 + tokens, :spec.head_dim]))
    return tuple(out)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("layout", ["dense", "strided", "offset"])
def test_put_from_tensors_equals_put_from_views(dtype, layout):
    spec = kvbridge.ModelSpec("m", 3, 3, 10, dtype=dtype)
    tokens = np.random.default_rng(5).integers(0, 1 << 31, size=5 * 8 + 3)
    n = len(tokens)
    if layout == "offset":
        kv = offset_kv(spec, n, seed=9)
    else:
        kv = random_kv(spec, n, seed=9, strided=layout == "strided")
    assert all(t.abs().sum() > 0 for pair in kv for t in pair)
    in_place = kvbridge.KVStore(1 << 24, chunk_tokens=8)
    assert in_place._store.put_kv(spec, tokens, kv, "default") == 40
    general = kvbridge.KVStore(1 << 24, chunk_tokens=8)
    keys, values = kv_views(host_kv(kv))
    assert general._store.put(spec, tokens, keys, values, "default") == 40
    for store in (in_place, general):
        m = store.match(spec, tokens)
        assert m.tokens == 40
        for (k, v), (k0, v0) in zip(m.kv, kv):
            assert torch.equal(k, k0[:, :, :40]) and torch.equal(v, v0[:, :, :40])


@pytest.mark.parametrize("layout", ["dense", "strided"])
def test_copy_into_equals_copy_to(layout):
    spec = kvbridge.ModelSpec("m", 2, 2, 6, dtype="bfloat16")
    store = kvbridge.KVStore(1 << 24, chunk_tokens=4)
    tokens = list(range(101, 101 + 19))
    kv = random_kv(spec, 19, seed=3, strided=layout == "strided")
    assert store.put(spec, tokens, kv) == 16
    found = store._store.match(spec, tokens, "default")
    a, b = empty_kv(spec, 16), empty_kv(spec, 16)
    assert found.copy_into(a) is True
    found.copy_to(*kv_views(b))
    for (ka, va), (kb, vb), (k0, v0) in zip(a, b, kv):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
        assert torch.equal(ka, k0[:, :, :16]) and torch.equal(va, v0[:, :, :16])
    # Strided destinations are written through their strides too.
    c = tuple((torch.zeros(1, 16, 2, 6, dtype=torch.bfloat16).transpose(1, 2),
               torch.zeros(1, 16, 2, 6, dtype=torch.bfloat16).transpose(1, 2)) for _ in range(2))
    assert found.copy_into(c) is True
    for (kc, vc), (k0, v0) in zip(c, kv):
        assert torch.equal(kc, k0[:, :, :16]) and torch.equal(vc, v0[:, :, :16])


def test_in_place_readers_decline_what_they_do_not_take(spec):
    store = kvbridge.KVStore(1 << 24, chunk_tokens=4)
    tokens = list(range(8))
    good = random_kv(spec, 8, seed=1)
    arrays = tuple((k.numpy(), v.numpy()) for k, v in good)
    float64 = tuple((k.double(), v.double()) for k, v in good)
    meta = tuple((torch.empty(k.shape, device="meta"), v) for k, v in good)
    for kv in ("kv", (), [], arrays, float64, meta, good[:1] + (good[1][:1],),
               ((good[0][0], good[0][1], good[0][1]),)):
        assert store._store.put_kv(spec, tokens, kv, "default") is None
    assert store.stats()["entries"] == 0
    found = store._store.match(spec, tokens, "default")
    assert found.copy_into(arrays) is False and found.copy_into("kv") is False


def test_put_refuses_what_the_in_place_reader_declines(spec):
    store = kvbridge.KVStore(1 << 24, chunk_tokens=4)
    tokens = list(range(8))
    good = random_kv(spec, 8, seed=1)
    with pytest.raises(TypeError):
        store.put(spec, tokens, "kv")
    with pytest.raises(TypeError):
        store.put(spec, tokens, tuple((k.numpy(), v.numpy()) for k, v in good))
    with pytest.raises(kvbridge.InvalidArgumentError):
        store.put(spec, tokens, ())
    with pytest.raises(kvbridge.InvalidArgumentError):
        store.put(spec, tokens, tuple((torch.empty(k.shape, device="meta"), v) for k, v in good))
    with pytest.raises(kvbridge.InvalidArgumentError):  # the spec's dtype is float32
        store.put(spec, tokens, tuple((k.double(), v.double()) for k, v in good))
    with pytest.raises(kvbridge.InvalidArgumentError):  # too few tokens in the tensors
        store.put(spec, list(range(12)), good)
    assert store.stats()["entries"] == 0
    # A list of lists and a tensor subclass go through the in-place reader and are stored.
    params = [[torch.nn.Parameter(k, requires_grad=False), v] for k, v in good]
    assert store.put(spec, tokens, params) == 8
    m = store.match(spec, tokens)
    assert all(torch.equal(k, k0) for (k, _), (k0, _) in zip(m.kv, good))


@pytest.mark.parametrize("make", [
    lambda ids: torch.tensor(ids, dtype=torch.int64),
    lambda ids: torch.tensor(ids, dtype=torch.int32),
    lambda ids: torch.tensor([x for i in ids for x in (i, 7)], dtype=torch.int64)[::2],
    lambda ids: torch.tensor([x for i in ids for x in (i, 7, 7)], dtype=torch.int32)[::3],
    lambda ids: torch.tensor([9] + ids, dtype=torch.int64)[1:],  # storage offset
])
def test_token_tensors_read_in_place_match_a_list(spec, make):
    rng = np.random.default_rng(11)
    ids = [int(x) for x in rng.integers(0, 1 << 31, size=23)]
    store = kvbridge.KVStore(1 << 24, chunk_tokens=4)
    assert store.put(spec, ids, random_kv(spec, 23, seed=4)) == 20
    t = make(ids)
    assert t.tolist() == ids
    assert store.match(spec, t, return_kv=False).tokens == 20
    other = list(ids)
    other[9] += 1
    assert store.match(spec, make(other), return_kv=False).tokens == 8
    assert kvbridge.prefix_hashes(spec, t, chunk_tokens=4) == kvbridge.prefix_hashes(
        spec, ids, chunk_tokens=4)


def test_token_tensors_out_of_range_or_bad_shape_are_refused(spec):
    store = kvbridge.KVStore(1 << 24, chunk_tokens=4)
    with pytest.raises(kvbridge.InvalidArgumentError, match=r"tokens\[2\] = -5"):
        store.match(spec, torch.tensor([1, 2, -5, 4], dtype=torch.int32))
    with pytest.raises(kvbridge.InvalidArgumentError, match=r"tokens\[1\] = 4294967296"):
        store.match(spec, torch.tensor([1, 1 << 32, 3, 4], dtype=torch.int64))
    with pytest.raises(kvbridge.InvalidArgumentError, match=r"tokens\[0\] = -1"):
        store.match(spec, torch.tensor([-1, 7, 1, 2, 3], dtype=torch.int64)[::2])
    with pytest.raises(kvbridge.InvalidArgumentError, match="1-D"):
        store.match(spec, torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(TypeError):
        store.match(spec, torch.zeros(4, dtype=torch.float32))


def reference_kv(found, spec):
    """The matched prefix through the general path: Match.copy_to into TensorViews."""
    out = empty_kv(spec, found.tokens)
    found.copy_to(*kv_views(out))
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("geometry", [(1, 1, 2), (3, 3, 14), (2, 5, 6)])
def test_match_returns_fresh_independent_tensors(dtype, geometry):
    """KVStore.match's kv (KVStore.match_kv: tensors created and filled by the core) is a tuple of
    (key, value) tuples of new contiguous CPU tensors, equal to what was put and to the general
    copy path, sharing memory with nothing: not each other, not the store, not a later match."""
    layers, heads, head_dim = geometry
    spec = kvbridge.ModelSpec("m", layers, heads, head_dim, dtype=dtype)
    store = kvbridge.KVStore(1 << 24, chunk_tokens=8)
    tokens = np.random.default_rng(7).integers(0, 1 << 31, size=5 * 8 + 3)
    kv = random_kv(spec, len(tokens), seed=12)
    assert all(t.abs().sum() > 0 for pair in kv for t in pair)
    assert store.put(spec, tokens, kv) == 40
    m = store.match(spec, tokens)
    assert m.tokens == 40 and (m.converted_from, m.adapter) == ("", "")
    assert type(m.kv) is tuple and len(m.kv) == layers
    expected = reference_kv(store._store.match(spec, tokens, "default"), spec)
    tensors = []
    for (k, v), (k0, v0), (ke, ve) in zip(m.kv, kv, expected):
        for t in (k, v):
            assert type(t) is torch.Tensor and t.is_cpu and t.layout == torch.strided
            assert t.shape == (1, heads, 40, head_dim) and t.dtype == getattr(torch, dtype)
            assert t.is_contiguous() and not t.requires_grad
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
        assert torch.equal(k, k0[:, :, :40]) and torch.equal(v, v0[:, :, :40])
        assert torch.equal(k, ke) and torch.equal(v, ve)
        tensors += [k, v]
    assert len({t.data_ptr() for t in tensors}) == 2 * layers
    # Writing one returned tensor changes no other one, and not what the store holds.
    before = [t.clone() for t in tensors]
    tensors[0].add_(1)
    assert not torch.equal(tensors[0], before[0])
    assert all(torch.equal(t, b) for t, b in zip(tensors[1:], before[1:]))
    again = store.match(spec, tokens)
    assert all(torch.equal(t, b) for t, b in zip((t for p in again.kv for t in p), before))
    assert again.kv[0][0].data_ptr() not in {t.data_ptr() for t in tensors}
    # Nor does writing the tensors that were put.
    kv[0][0].add_(1)
    assert torch.equal(store.match(spec, tokens).kv[0][0], before[0])


def test_match_kv_binding_miss_hit_and_device():
    spec = kvbridge.ModelSpec("m", 2, 3, 10, dtype="bfloat16")
    store = kvbridge.KVStore(1 << 24, chunk_tokens=4)
    tokens = list(range(300, 311))
    kv = random_kv(spec, 11, seed=21)
    assert store._store.match_kv(spec, tokens, "default") == (0, None, "", "")
    miss = store.match(spec, tokens)
    assert miss == kvbridge.Match(0, None)
    source_fp, adapter_fp = "1" * 32, "a" * 32
    store.put(spec, tokens, kv, converted_from=source_fp, adapter=adapter_fp)
    n, got, converted_from, adapter = store._store.match_kv(spec, tokens, "default")
    assert (n, converted_from, adapter) == (8, source_fp, adapter_fp)
    assert all(torch.equal(k, k0[:, :, :8]) and torch.equal(v, v0[:, :, :8])
               for (k, v), (k0, v0) in zip(got, kv))
    assert store._store.match_kv(spec, tokens, "other") == (0, None, "", "")
    for device in ("cpu", torch.device("cpu")):
        m = store.match(spec, tokens, device=device)
        assert (m.tokens, m.converted_from, m.adapter) == (8, source_fp, adapter_fp)
        assert all(torch.equal(a, b) for pa, pb in zip(m.kv, got) for a, b in zip(pa, pb))
    # The tensors are CPU ones whatever torch's default device (here a `with` block's).
    with torch.device("meta"):
        m = store.match(spec, tokens)
    assert all(t.is_cpu and torch.equal(t, b) for pa, pb in zip(m.kv, got)
               for t, b in zip(pa, pb))


def test_large_match_copies_release_the_gil_and_stay_exact():
    """Copies of at least 256 KiB run without the GIL: threads matching such prefixes at once
    each get exactly what was put."""
    spec = kvbridge.ModelSpec("big", 4, 8, 66, dtype="float16")
    store = kvbridge.KVStore(1 << 26, chunk_tokens=16)
    prompts = [list(range(p * 1000, p * 1000 + 96)) for p in range(4)]
    kvs = [random_kv(spec, 96, seed=30 + p) for p in range(4)]
    assert spec.kv_bytes_per_token() * 96 >= 256 << 10
    for p, kv in zip(prompts, kvs):
        assert store.put(spec, p, kv) == 96
    errors = []

    def work(seed):
        rng = np.random.default_rng(seed)
        for _ in range(20):
            p = int(rng.integers(len(prompts)))
            m = store.match(spec, prompts[p])
            if m.tokens != 96 or not all(torch.equal(a, b) for pa, pb in zip(m.kv, kvs[p])
                                         for a, b in zip(pa, pb)):
                errors.append(p)

    run_threads(work)
    assert errors == []
