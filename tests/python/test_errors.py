"""Bad input gets a clear error naming the argument, never a crash."""
import numpy as np
import pytest
import torch

import kvbridge
from conftest import random_kv


@pytest.fixture
def store():
    return kvbridge.KVStore(1 << 22, chunk_tokens=4)


def test_exception_hierarchy():
    assert issubclass(kvbridge.InvalidArgumentError, ValueError)
    assert issubclass(kvbridge.InvalidArgumentError, kvbridge.Error)
    assert issubclass(kvbridge.NotFoundError, KeyError)
    assert issubclass(kvbridge.CorruptError, kvbridge.Error)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(num_layers=0), "num_layers"),
    (dict(num_kv_heads=-1), "num_kv_heads"),
    (dict(head_dim=5), "head_dim"),
    (dict(dtype="int8"), "dtype"),
    (dict(rope_style="full"), "rope_style"),
    (dict(rope_base=0.0), "rope_base"),
])
def test_bad_spec(kwargs, needle):
    args = dict(name="m", num_layers=2, num_kv_heads=2, head_dim=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=needle):
        kvbridge.ModelSpec(**args)


def test_bad_tokens(spec, store):
    kv = random_kv(spec, 8, 1)
    with pytest.raises(ValueError, match=r"tokens\[2\]"):
        store.put(spec, [1, 2, -3, 4, 5, 6, 7, 8], kv)
    with pytest.raises(ValueError, match=r"tokens\[0\]"):
        store.match(spec, [2**32, 1, 2, 3])
    with pytest.raises(TypeError, match="tokens"):
        store.put(spec, [1.5] * 8, kv)
    with pytest.raises(TypeError, match="tokens"):
        store.match(spec, torch.ones(8))
    with pytest.raises(ValueError, match="tokens"):
        store.match(spec, [])
    with pytest.raises(ValueError, match="1-D"):
        store.match(spec, np.ones((2, 4), dtype=np.int64))
    with pytest.raises(ValueError, match="tokens"):
        store.put(spec, list(range(7)), kv)  # 7 tokens, KV holds 8


def test_bad_kv(spec, store):
    tokens = list(range(8))
    kv = random_kv(spec, 8, 1)
    with pytest.raises(TypeError, match="kv"):
        store.put(spec, tokens, kv[0][0])
    with pytest.raises(TypeError, match=r"kv\[1\]"):
        store.put(spec, tokens, (kv[0], kv[1][0], kv[2]))
    with pytest.raises(TypeError, match=r"kv\[0\]\[1\]"):
        store.put(spec, tokens, ((kv[0][0], kv[0][1].numpy()),) + kv[1:])
    with pytest.raises(ValueError, match="kv"):
        store.put(spec, tokens, ())
    with pytest.raises(ValueError, match="layers"):
        store.put(spec, tokens, kv[:2])
    with pytest.raises(ValueError, match=r"kv\[1\]\[0\].*4 dims"):
        store.put(spec, tokens, (kv[0], (kv[1][0][0], kv[1][1]), kv[2]))
    with pytest.raises(ValueError, match="batch"):
        store.put(spec, tokens, tuple((k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1)) for k, v in kv))
    with pytest.raises(ValueError, match="dtype"):
        store.put(spec, tokens, tuple((k.half(), v.half()) for k, v in kv))
    with pytest.raises(ValueError, match="dtype"):
        store.put(spec, tokens, tuple((k.double(), v.double()) for k, v in kv))
    with pytest.raises(ValueError, match="kv_heads"):
        store.put(spec, tokens, tuple((k[:, :1], v[:, :1]) for k, v in kv))
    with pytest.raises(ValueError, match="differs"):
        store.put(spec, tokens, (kv[0], (kv[1][0], kv[1][1][:, :, :4]), kv[2]))


def test_bad_store_options():
    with pytest.raises(ValueError, match="capacity_bytes"):
        kvbridge.KVStore(0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        kvbridge.KVStore(1024, chunk_tokens=0)
    with pytest.raises(ValueError, match="num_shards"):
        kvbridge.KVStore(1024, num_shards=0)
