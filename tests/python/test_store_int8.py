"""int8 storage from Python: a float64 reference of the reconstruction, the bytes it saves, and
the disk tier round trip."""
import numpy as np
import pytest
import torch

import kvbridge
from conftest import random_kv

CHUNK = 16


def reference_bound(kv, tokens):
    """Per element: half the float64 quantization step of the element's group."""
    bounds = []
    for k, v in kv:
        k = k[0, :, :tokens].double()  # [H, T, D]
        v = v[0, :, :tokens].double()
        kb = torch.empty_like(k)
        for c in range(0, tokens, CHUNK):
            kb[:, c:c + CHUNK] = k[:, c:c + CHUNK].abs().amax(dim=1, keepdim=True) / 127 / 2
        vb = v.abs().amax(dim=2, keepdim=True).expand_as(v) / 127 / 2
        bounds.append((kb, vb))
    return bounds


@pytest.mark.parametrize("dtype,unit", [("float32", 2.0**-24), ("bfloat16", 2.0**-8)])
def test_int8_reconstruction_against_float64(dtype, unit):
    spec = kvbridge.ModelSpec("m", 3, 3, 18, dtype=dtype)
    store = kvbridge.KVStore(1 << 24, chunk_tokens=CHUNK, storage="int8")
    assert store.storage == "int8"
    tokens = np.random.default_rng(3).integers(0, 50000, size=37)
    kv = random_kv(spec, 37, seed=4, strided=True)
    assert store.put(spec, tokens, kv) == 32
    m = store.match(spec, tokens)
    assert m.tokens == 32
    err2 = ref2 = 0.0
    for (k, v), (k0, v0), (kb, vb) in zip(m.kv, kv, reference_bound(kv, 32)):
        assert k.dtype == getattr(torch, dtype)
        for out, inp, bound in ((k, k0, kb), (v, v0, vb)):
            x = inp[0, :, :32].double()
            y = out[0].double()
            assert torch.all((x - y).abs() <= bound * (1 + 1e-5) + y.abs() * unit)
            err2 += float(((x - y) ** 2).sum())
            ref2 += float((x ** 2).sum())
    rms = (err2 / ref2) ** 0.5
    print(f"int8 storage {dtype}: RMS relative error {rms:.5f}")
    assert 0 < rms < 0.02


def test_int8_uses_about_half_the_bytes_of_bfloat16():
    spec = kvbridge.ModelSpec("m", 4, 2, 64, dtype="bfloat16")
    tokens = list(range(512))
    kv = random_kv(spec, 512, seed=5)
    used = {}
    for storage in ("native", "int8"):
        store = kvbridge.KVStore(1 << 26, chunk_tokens=256, storage=storage)
        assert store.put(spec, tokens, kv) == 512
        used[storage] = store.stats()["bytes_used"]
    assert 0.5 < used["int8"] / used["native"] <= 0.55


def test_int8_through_disk_and_bad_input(tmp_path):
    spec = kvbridge.ModelSpec("m", 2, 2, 8, dtype="bfloat16")
    tokens = list(range(40))
    kv = random_kv(spec, 40, seed=6)
    a = kvbridge.KVStore(1 << 22, chunk_tokens=CHUNK, disk_dir=tmp_path, storage="int8",
                         disk_fsync=False)
    assert a.put(spec, tokens, kv) == 32
    first = a.match(spec, tokens).kv
    del a
    b = kvbridge.KVStore(1 << 22, chunk_tokens=CHUNK, disk_dir=tmp_path, storage="int8")
    m = b.match(spec, tokens)
    assert m.tokens == 32 and b.stats()["disk"]["hit_chunks"] == 2
    for (k, v), (k1, v1) in zip(m.kv, first):
        assert torch.equal(k, k1) and torch.equal(v, v1)
    bad = random_kv(spec, 40, seed=7)
    bad[0][1][0, 0, 3, 2] = float("inf")
    with pytest.raises(ValueError, match="finite"):
        b.put(spec, list(range(100, 140)), bad)
    with pytest.raises(ValueError, match="storage"):
        kvbridge.KVStore(1 << 22, storage="int4")
