"""The documented hash definition, checked three ways: shared vectors, the library, and an
independent implementation with the xxhash package."""
import struct
import subprocess
import sys

import numpy as np
import pytest
import xxhash

import kvbridge
from conftest import VECTORS


def read_vectors():
    vectors, cur = [], {}
    for line in VECTORS.read_text().splitlines():
        if line.startswith("#"):
            continue
        if not line:
            if cur:
                vectors.append(cur)
            cur = {}
            continue
        k, v = line.split("=", 1)
        cur[k] = v
    if cur:
        vectors.append(cur)
    return vectors


def spec_of(v):
    return kvbridge.ModelSpec(
        v["name"], int(v["num_layers"]), int(v["num_kv_heads"]), int(v["head_dim"]),
        dtype=v["dtype"], version=v.get("version", ""), tokenizer=v.get("tokenizer", ""),
        rope_base=float(v.get("rope_base", 10000.0)), rope_style=v.get("rope_style", "half"))


@pytest.mark.parametrize("v", read_vectors(), ids=lambda v: v["name"])
def test_shared_vectors(v):
    spec = spec_of(v)
    tokens = [int(t) for t in v["tokens"].split(",")]
    assert spec.fingerprint == v["fingerprint"]
    hashes = kvbridge.prefix_hashes(spec, tokens, v["namespace"], int(v["chunk_tokens"]))
    assert hashes[0] == v["salt"]
    assert hashes[1:] == v["chain"].split(",")


def test_vector_count():
    assert len(read_vectors()) >= 3


def test_independent_implementation_on_random_prompt():
    spec = kvbridge.ModelSpec("rand", 5, 4, 16, dtype="bfloat16", version="v9")
    tokens = np.random.default_rng(3).integers(0, 2**32, size=1000, dtype=np.int64)
    ns = "tenant-Ω"
    salt = b"kvbridge.prefix.v1"
    for s in (ns.encode(), spec.fingerprint.encode(), b"bfloat16"):
        salt += struct.pack("<I", len(s)) + s
    h = xxhash.xxh3_128(salt).digest()
    expected = [h.hex()]
    for c in range(len(tokens) // 64):
        hi, lo = struct.unpack(">QQ", h)
        h = xxhash.xxh3_128(struct.pack("<QQ", lo, hi)
                            + tokens[c * 64:(c + 1) * 64].astype("<u4").tobytes()).digest()
        expected.append(h.hex())
    assert kvbridge.prefix_hashes(spec, tokens, ns, 64) == expected


def test_same_hashes_in_another_process(spec):
    code = ("import kvbridge;s=kvbridge.ModelSpec('test-model',3,2,6);"
            "print(kvbridge.prefix_hashes(s, list(range(40)), 'ns', 8)[-1])")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={"PYTHONHASHSEED": seed}, check=True).stdout.strip()
            for seed in ("0", "1", "random")}
    assert outs == {kvbridge.prefix_hashes(spec, list(range(40)), "ns", 8)[-1]}


def test_spec_identity():
    a = kvbridge.ModelSpec("m", 2, 2, 4)
    b = kvbridge.ModelSpec("m", 2, 2, 4)
    c = kvbridge.ModelSpec("m", 2, 2, 4, version="lora")
    d = kvbridge.ModelSpec("m", 2, 2, 4, rope_scaling=kvbridge.RopeScaling("linear", 2.0))
    assert a == b and hash(a) == hash(b) and a.fingerprint == b.fingerprint
    assert len({a.fingerprint, c.fingerprint, d.fingerprint}) == 3
    assert a != c and a != d


def test_spec_pickle_and_repr():
    import pickle
    s = kvbridge.ModelSpec("m", 2, 2, 4, dtype="bfloat16", version="v1", rope_style="interleaved",
                           rope_scaling=kvbridge.RopeScaling("llama3", 8.0, 1.0, 4.0, 8192))
    t = pickle.loads(pickle.dumps(s))
    assert t == s and t.fingerprint == s.fingerprint
    assert "name='m'" in repr(s) and s.fingerprint in repr(s)
