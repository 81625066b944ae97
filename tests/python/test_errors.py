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


@pytest.mark.parametrize("make, error, needle", [
    # Wrong types are TypeErrors, never truncated.
    (lambda: kvbridge.KVStore(1.5), TypeError, "capacity_bytes"),
    (lambda: kvbridge.KVStore(1 << 20, chunk_tokens=2.7), TypeError, "chunk_tokens"),
    (lambda: kvbridge.KVStore(1 << 20, chunk_tokens=True), TypeError, "chunk_tokens"),
    (lambda: kvbridge.KVStore(1 << 20, chunk_tokens="16"), TypeError, "chunk_tokens"),
    (lambda: kvbridge.KVStore(1 << 20, disk_fsync=1), TypeError, "disk_fsync"),
    (lambda: kvbridge.KVStore(1 << 20, redis_command_timeout_ms=2.5), TypeError, "timeout"),
    (lambda: kvbridge.Bridge(kvbridge.KVStore(1 << 20), min_quality="0.5"), TypeError,
     "min_quality"),
    (lambda: kvbridge.ModelSpec("m", 2.0, 2, 4), TypeError, "num_layers"),
    (lambda: kvbridge.ModelSpec("m", True, 2, 4), TypeError, "num_layers"),
    (lambda: kvbridge.ModelSpec("m", 2, 2, 4, rope_base="1e4"), TypeError, "rope_base"),
    (lambda: kvbridge.AdapterFitter(SPEC, SPEC2, seed=1.5), TypeError, "seed"),
    # Values the core's types cannot hold are InvalidArgumentErrors naming the argument.
    (lambda: kvbridge.KVStore(2**64), kvbridge.InvalidArgumentError, "capacity_bytes"),
    (lambda: kvbridge.KVStore(-1), kvbridge.InvalidArgumentError, "capacity_bytes"),
    (lambda: kvbridge.KVStore(1 << 20, chunk_tokens=2**62), kvbridge.InvalidArgumentError,
     "chunk_tokens"),
    (lambda: kvbridge.KVStore(1 << 20, num_shards=2**40), kvbridge.InvalidArgumentError,
     "num_shards"),
    (lambda: kvbridge.KVStore(1 << 20, redis_pool_size=2**40), kvbridge.InvalidArgumentError,
     "redis_pool_size"),
    (lambda: kvbridge.KVStore(1 << 20, disk_dir="/tmp/a\0b"), kvbridge.InvalidArgumentError,
     "NUL"),
    (lambda: kvbridge.ModelSpec("m", 2**70, 2, 4), kvbridge.InvalidArgumentError, "num_layers"),
    (lambda: kvbridge.ModelSpec("m", 2**62, 2, 4), kvbridge.InvalidArgumentError, "num_layers"),
    (lambda: kvbridge.ModelSpec("m", 2, 2, 2**40), kvbridge.InvalidArgumentError, "head_dim"),
    (lambda: kvbridge.ModelSpec("m", 2, 2, 4, rope_scaling=kvbridge.RopeScaling(
        "linear", factor=float("nan"))), kvbridge.InvalidArgumentError, "factor"),
    (lambda: kvbridge.ModelSpec("m", 2, 2, 4, rope_scaling=kvbridge.RopeScaling(
        low_freq_factor=float("inf"))), kvbridge.InvalidArgumentError, "low_freq_factor"),
    (lambda: kvbridge.AdapterFitter(SPEC, SPEC2, seed=2**64), kvbridge.InvalidArgumentError,
     "seed"),
    (lambda: kvbridge.AdapterFitter(SPEC, SPEC2, seed=-1), kvbridge.InvalidArgumentError,
     "seed"),
    (lambda: kvbridge.prefix_hashes(SPEC, [1, 2], chunk_tokens=2**64),
     kvbridge.InvalidArgumentError, "chunk_tokens"),
])
def test_sizes_seeds_and_numbers_are_checked(make, error, needle):
    with pytest.raises(error, match=needle):
        make()


SPEC = kvbridge.ModelSpec("spec-a", 1, 1, 4, tokenizer="t")
SPEC2 = kvbridge.ModelSpec("spec-b", 1, 1, 4, tokenizer="t")


def test_positions_and_namespaces(store):
    fitter = kvbridge.AdapterFitter(SPEC, SPEC2, source_layers="all", ridge=0.1)
    src, tgt = random_kv(SPEC, 40, 1), random_kv(SPEC2, 40, 2)
    fitter.add(src, tgt)
    adapter = fitter.fit()
    for bad, error in [(1.5, TypeError), (True, TypeError), ("3", TypeError),
                       (-1, kvbridge.InvalidArgumentError),
                       (2**63, kvbridge.InvalidArgumentError),
                       (2**53 - 10, kvbridge.InvalidArgumentError)]:  # + 40 tokens > 2^53
        with pytest.raises(error, match="start_pos"):
            adapter.convert(src, bad)
        with pytest.raises(error, match="start_pos"):
            fitter.add(src, tgt, start_pos=bad)
    assert adapter.convert(src, 2**53 - 40)[0][0].shape[2] == 40  # the last exact position
    bridge = kvbridge.Bridge(store)
    kv = random_kv(SPEC, 8, 3)
    for call in (lambda ns: store.put(SPEC, list(range(8)), kv, ns),
                 lambda ns: store.match(SPEC, list(range(8)), ns),
                 lambda ns: store.erase(SPEC, list(range(8)), ns),
                 lambda ns: bridge.save(SPEC, list(range(8)), kv, ns),
                 lambda ns: bridge.load(SPEC, list(range(8)), ns)):
        with pytest.raises(kvbridge.InvalidArgumentError, match="namespace.*surrogate"):
            call("tenant-\udc80")
        with pytest.raises(TypeError, match="namespace"):
            call(7)


def test_sparse_and_meta_tensors(spec, store):
    kv = random_kv(spec, 8, 1)
    sparse = ((kv[0][0].to_sparse(), kv[0][1]),) + kv[1:]
    with pytest.raises(TypeError, match=r"kv\[0\]\[0\].*strided"):
        store.put(spec, list(range(8)), sparse)
    meta = kv[:2] + ((kv[2][0], torch.empty_like(kv[2][1], device="meta")),)
    with pytest.raises(ValueError, match=r"kv\[2\]\[1\].*meta"):
        store.put(spec, list(range(8)), meta)


def test_cli_errors_are_messages(tmp_path, capsys):
    from kvbridge import cli

    assert cli.main(["evaluate"]) == 2
    assert "unknown command 'evaluate'" in capsys.readouterr().err
    for argv, needle in [(["eval", "--threads", "-1"], "--threads: must be >= 0, got -1"),
                         (["eval", "--chunk-tokens", "0"], "--chunk-tokens: must be >= 1"),
                         (["demo", "--chunk-tokens", "x"], "expected an integer, got 'x'")]:
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2 and needle in capsys.readouterr().err
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    pytest.importorskip("kvbridge.experiments.testbed")
    assert cli.main(["eval", "--adapter", str(bad), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvbridge eval: error: ") and "Traceback" not in err



@pytest.mark.parametrize("tokens, index, value", [
    ([np.uint64(2**63), 1, 2, 3], 0, 2**63),             # came out as "dtype float64"
    ([5, 2**63, 1, 2], 1, 2**63),                         # likewise, mixed with small ints
    (np.array([1, 2, 3, 2**64 - 1], dtype=np.uint64), 3, 2**64 - 1),
    ([1, 2, 2**70, 3], 2, 2**70),                         # beyond 64 bits
    ([1, -2**63 - 1, 2, 3], 1, -2**63 - 1),
    ([1, 2, 3, 2**32], 3, 2**32),
    (torch.tensor([1, 2, -5, 3]), 2, -5),
    (np.array([7, 8, 9, -1], dtype=np.int32)[::-1], 0, -1),  # strided, narrower dtype
])
def test_token_id_out_of_range_is_named(spec, store, tokens, index, value):
    for call in (lambda: store.match(spec, tokens), lambda: kvbridge.prefix_hashes(spec, tokens)):
        with pytest.raises(kvbridge.InvalidArgumentError,
                           match=rf"tokens\[{index}\] = {value} is outside the token id range"):
            call()


@pytest.mark.parametrize("tokens, needle", [
    ([1, 2, True, 3], r"tokens\[2\]: expected an integer token id, got bool"),
    ([1, 2.0, 3, 4], r"tokens\[1\]: expected an integer token id, got float"),
    ([[1, 2], [3, 4]], r"tokens\[0\]: expected an integer token id, got list"),
    (np.array([True, False, True, True]), "got dtype bool"),
    ("abcd", "got dtype <U4"),
])
def test_token_id_of_wrong_type_is_named(spec, store, tokens, needle):
    with pytest.raises(TypeError, match=needle):
        store.match(spec, tokens)


def test_token_forms_agree(spec, store):
    """A list, a tuple, numpy arrays of every integer width, strided arrays and torch tensors
    of the same ids all hash to the same chain."""
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]
    want = kvbridge.prefix_hashes(spec, ids, chunk_tokens=4)
    forms = [tuple(ids), np.array(ids, dtype=np.int64), torch.tensor(ids),
             torch.tensor(ids, dtype=torch.int32), np.repeat(np.array(ids, dtype=np.int64), 2)[::2]]
    forms += [np.array(ids, dtype=d) for d in (np.int8, np.int16, np.int32, np.uint8,
                                               np.uint16, np.uint32, np.uint64)]
    forms += [[np.int64(t) for t in ids]]
    for form in forms:
        assert kvbridge.prefix_hashes(spec, form, chunk_tokens=4) == want, type(form)
