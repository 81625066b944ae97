"""The disk and Redis tiers from Python, including separate processes and a failing server."""
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

import kvbridge
from conftest import random_kv

REDIS_SERVER = shutil.which("redis-server") or (
    "/usr/bin/redis-server" if os.access("/usr/bin/redis-server", os.X_OK) else None)
needs_redis = pytest.mark.skipif(
    REDIS_SERVER is None, reason="redis-server is not installed (scripts/bootstrap.sh installs it)")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Redis:
    """A real redis-server on a free loopback port, without persistence."""

    def __init__(self):
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        self.proc = None

    def start(self):
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", "/tmp", "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.01)
        raise RuntimeError("redis-server did not start")

    def stop(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@pytest.fixture
def redis():
    server = _Redis()
    server.start()
    yield server
    server.stop()


def _same(kv_a, kv_b, tokens):
    return all(torch.equal(k, k0[:, :, :tokens]) and torch.equal(v, v0[:, :, :tokens])
               for (k, v), (k0, v0) in zip(kv_a, kv_b))


def test_disk_tier_survives_the_store_and_reports_per_tier(spec, tmp_path):
    tokens = np.random.default_rng(3).integers(0, 50000, size=40)
    kv = random_kv(spec, 40, seed=4, strided=True)
    store = kvbridge.KVStore(1 << 22, chunk_tokens=8, disk_dir=tmp_path, disk_fsync=False)
    assert store.put(spec, tokens, kv) == 40
    st = store.stats()
    assert st["disk"]["enabled"] and st["disk"]["entries"] == 5 and st["disk"]["writes"] == 5
    assert not st["redis"]["enabled"]
    del store
    reopened = kvbridge.KVStore(1 << 22, chunk_tokens=8, disk_dir=str(tmp_path))
    m = reopened.match(spec, tokens)
    assert m.tokens == 40 and _same(m.kv, kv, 40)
    st = reopened.stats()
    assert st["disk"]["hit_chunks"] == 5 and st["promotions"] == 5
    assert st["memory"]["hit_chunks"] == 0
    assert reopened.match(spec, tokens).tokens == 40
    assert reopened.stats()["memory"]["hit_chunks"] == 5


def test_second_process_reads_the_disk_tier(spec, tmp_path):
    tokens = list(range(1000, 1032))
    kv = random_kv(spec, 32, seed=5)
    store = kvbridge.KVStore(1 << 22, chunk_tokens=8, disk_dir=tmp_path)
    store.put(spec, tokens, kv)
    del store
    torch.save(kv, tmp_path / "expected.pt")
    code = textwrap.dedent(f"""
        import torch, kvbridge
        spec = kvbridge.ModelSpec("test-model", num_layers=3, num_kv_heads=2, head_dim=6)
        store = kvbridge.KVStore(1 << 22, chunk_tokens=8, disk_dir={str(tmp_path)!r})
        m = store.match(spec, list(range(1000, 1032)))
        kv = torch.load({str(tmp_path / "expected.pt")!r})
        ok = m.tokens == 32 and all(torch.equal(a, b) for p, q in zip(m.kv, kv)
                                    for a, b in zip(p, q))
        print(m.tokens, ok, store.stats()["disk"]["hit_chunks"])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["32", "True", "4"]


def test_disk_dir_shared_by_two_stores_and_another_process(spec, tmp_path):
    """Two live stores in this process and a third in a child process, on one directory."""
    def prompt(i):
        return list(range(5000 + 100 * i, 5000 + 100 * i + 16))

    kvs = [random_kv(spec, 16, seed=20 + i) for i in range(3)]
    torch.save(kvs, tmp_path / "expected.pt")
    opts = dict(chunk_tokens=8, disk_dir=tmp_path / "cache", disk_fsync=False)
    a = kvbridge.KVStore(1 << 22, **opts)
    b = kvbridge.KVStore(1 << 22, **opts)
    assert a.put(spec, prompt(0), kvs[0]) == 16
    m = b.match(spec, prompt(0))  # b opened before a wrote: read from a's files
    assert m.tokens == 16 and _same(m.kv, kvs[0], 16)
    assert b.stats()["disk"]["hit_chunks"] == 2
    assert b.put(spec, prompt(1), kvs[1]) == 16
    code = textwrap.dedent(f"""
        import torch, kvbridge
        spec = kvbridge.ModelSpec("test-model", num_layers=3, num_kv_heads=2, head_dim=6)
        store = kvbridge.KVStore(1 << 22, chunk_tokens=8, disk_dir={str(tmp_path / "cache")!r})
        kvs = torch.load({str(tmp_path / "expected.pt")!r})
        ok = []
        for i in (0, 1):
            m = store.match(spec, list(range(5000 + 100 * i, 5000 + 100 * i + 16)))
            ok.append(m.tokens == 16 and all(torch.equal(x, y[:, :, :16])
                                             for p, q in zip(m.kv, kvs[i]) for x, y in zip(p, q)))
        stored = store.put(spec, list(range(5200, 5216)), kvs[2])
        print(all(ok), stored, store.stats()["disk"]["hit_chunks"])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "16", "4"]
    m = a.match(spec, prompt(2))  # the child's put
    assert m.tokens == 16 and _same(m.kv, kvs[2], 16)
    per_file = (160 + 4 * 8 + spec.kv_bytes_per_token() * 8 + 16 + 4095) // 4096 * 4096
    assert a.stats()["disk"]["bytes_used"] == b.stats()["disk"]["bytes_used"] == 6 * per_file
    assert a.invalidate(spec)["disk"] == 6  # every store's files
    b.clear(tiers=("memory",))
    assert b.match(spec, prompt(2)).tokens == 0
    assert b.stats()["disk"]["bytes_used"] == 0


def test_disk_budget_and_corruption(spec, tmp_path):
    per_file = (224 + 4 * 8 + spec.kv_bytes_per_token() * 8 + 16 + 4095) // 4096 * 4096
    store = kvbridge.KVStore(1 << 22, chunk_tokens=8, disk_dir=tmp_path,
                             disk_capacity_bytes=3 * per_file, disk_fsync=False)
    for i in range(10):
        store.put(spec, list(range(i * 100, i * 100 + 8)), random_kv(spec, 8, i))
        assert store.stats()["disk"]["bytes_used"] <= 3 * per_file
    st = store.stats()["disk"]
    assert st["entries"] == 3 and st["evictions"] == 7
    # Damage one file: its lookup is a counted miss and the file is quarantined.
    files = sorted(tmp_path.glob("kvbridge-v1/*/*/*.kvb"))
    assert len(files) == 3
    data = bytearray(files[0].read_bytes())
    data[len(data) // 3] ^= 0x10
    files[0].write_bytes(bytes(data))
    store.clear(tiers=("memory",))
    hits = [store.match(spec, list(range(i * 100, i * 100 + 8))).tokens for i in range(7, 10)]
    assert sorted(hits) == [0, 8, 8]
    assert store.stats()["disk"]["corrupt"] == 1
    assert len(list(tmp_path.glob("kvbridge-v1/quarantine/*"))) == 1


def test_options_are_checked(spec, tmp_path):
    with pytest.raises(ValueError, match="eviction"):
        kvbridge.KVStore(1 << 20, eviction="mru")
    with pytest.raises(ValueError, match="ttl"):
        kvbridge.KVStore(1 << 20, eviction="ttl")
    with pytest.raises(TypeError, match="unknown option"):
        kvbridge.KVStore(1 << 20, disk_fsyncc=False)
    with pytest.raises(ValueError, match="redis_url"):
        kvbridge.KVStore(1 << 20, redis_url="http://localhost")
    first = kvbridge.KVStore(1 << 20, disk_dir=tmp_path)
    kvbridge.KVStore(1 << 20, disk_dir=tmp_path)  # a second live store shares the directory
    (tmp_path / "plain-file").write_bytes(b"x")
    with pytest.raises(kvbridge.UnavailableError, match="cannot create"):
        kvbridge.KVStore(1 << 20, disk_dir=tmp_path / "plain-file" / "cache")
    with pytest.raises(ValueError, match="tiers"):
        first.clear(tiers=("cache",))
    lfu = kvbridge.KVStore(1 << 20, eviction="lfu", ttl_seconds=60)
    assert lfu.put(spec, list(range(8)), random_kv(spec, 8, 1)) == 0  # chunk 256 > 8 tokens


@needs_redis
def test_redis_shared_with_another_process(spec, redis):
    tokens = np.arange(500, 532)
    kv = random_kv(spec, 32, seed=6)
    store = kvbridge.KVStore(1 << 22, chunk_tokens=8, redis_url=redis.url)
    assert store.put(spec, tokens, kv, namespace="tenant-a") == 32
    assert store.stats()["redis"]["writes"] == 4
    code = textwrap.dedent(f"""
        import torch, kvbridge
        from conftest import random_kv
        spec = kvbridge.ModelSpec("test-model", num_layers=3, num_kv_heads=2, head_dim=6)
        store = kvbridge.KVStore(1 << 22, chunk_tokens=8, redis_url={redis.url!r})
        m = store.match(spec, list(range(500, 532)), namespace="tenant-a")
        kv = random_kv(spec, 32, seed=6)
        ok = m.tokens == 32 and all(torch.equal(a, b) for p, q in zip(m.kv, kv)
                                    for a, b in zip(p, q))
        other = store.match(spec, list(range(500, 532)), namespace="tenant-b")
        st = store.stats()
        print(m.tokens, ok, other.tokens, st["redis"]["hit_chunks"], st["remote"]["round_trips"] > 0)
    """)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(__file__))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["32", "True", "0", "4", "True"]


@needs_redis
def test_redis_down_and_back(spec, redis, tmp_path):
    store = kvbridge.KVStore(1 << 22, chunk_tokens=8, disk_dir=tmp_path, redis_url=redis.url,
                             disk_fsync=False, redis_filter=False, redis_retry_min_ms=20,
                             redis_retry_max_ms=100)
    a, b = list(range(16)), list(range(100, 116))
    kv = random_kv(spec, 16, 7)
    assert store.put(spec, a, kv) == 16
    redis.stop()
    m = store.match(spec, a)  # memory
    assert m.tokens == 16 and _same(m.kv, kv, 16)
    store.clear(tiers=("memory",))
    assert store.match(spec, a).tokens == 16  # disk
    assert store.match(spec, b).tokens == 0  # would have asked Redis: a counted miss
    assert store.put(spec, b, kv) == 16  # memory and disk take it; the Redis write is skipped
    st = store.stats()
    assert st["redis"]["errors"] >= 1 and st["redis"]["write_failures"] >= 1
    redis.start()
    c = list(range(200, 216))
    deadline = time.monotonic() + 10
    while store.stats()["redis"]["writes"] == st["redis"]["writes"]:
        assert time.monotonic() < deadline, "the store never used Redis again"
        store.erase(spec, c, tiers=("memory", "disk"))
        store.put(spec, c, kv)
        time.sleep(0.01)
    fresh = kvbridge.KVStore(1 << 22, chunk_tokens=8, redis_url=redis.url)
    assert fresh.match(spec, c).tokens == 16


@needs_redis
def test_invalidate_metrics_and_filter(spec, redis, tmp_path):
    store = kvbridge.KVStore(1 << 22, chunk_tokens=8, disk_dir=tmp_path, redis_url=redis.url,
                             disk_fsync=False, redis_filter_refresh_ms=3600000)
    other = kvbridge.ModelSpec("test-model", 3, 2, 6, version="v2")
    tokens = list(range(24))
    store.put(spec, tokens, random_kv(spec, 24, 1), namespace="a")
    store.put(spec, tokens, random_kv(spec, 24, 1), namespace="b")
    store.put(other, tokens, random_kv(other, 24, 2), namespace="a")
    r = store.invalidate(spec)
    assert r == {"memory": 6, "disk": 6, "redis": 6, "redis_complete": True}
    assert store.match(spec, tokens, namespace="a").tokens == 0
    assert store.match(other, tokens, namespace="a").tokens == 24
    fresh = kvbridge.KVStore(1 << 22, chunk_tokens=8, redis_url=redis.url,
                             redis_filter_refresh_ms=3600000)
    before = fresh.stats()["remote"]
    for i in range(20):  # never stored: answered by the filter
        assert fresh.match(spec, list(range(10000 + 24 * i, 10024 + 24 * i))).tokens == 0
    after = fresh.stats()["remote"]
    assert after["filter_active"]
    assert after["filter_negatives"] - before["filter_negatives"] == 20
    assert after["round_trips"] == before["round_trips"]
    text = store.metrics_text()
    assert 'kvbridge_store_hits_total{tier="disk"}' in text
    assert "kvbridge_store_remote_latency_seconds_count" in text
    assert all(line.startswith(("#", "kvbridge_store_")) for line in text.splitlines() if line)


@needs_redis
def test_write_back_provenance_in_every_tier_and_invalidate_adapter(redis, tmp_path):
    from test_bridge import CHUNK, SRC, TGT, fit_planted, tokens_of

    old, new = fit_planted(SRC, TGT, 1), fit_planted(SRC, TGT, 4)
    assert old.fingerprint != new.fingerprint and len(old.fingerprint) == 32

    def open_store():
        return kvbridge.KVStore(64 << 20, chunk_tokens=CHUNK, disk_dir=tmp_path,
                                redis_url=redis.url, disk_fsync=False)

    ids = tokens_of(4 * CHUNK + 3, 1)
    own = tokens_of(2 * CHUNK + 1, 2)
    store = open_store()
    bridge = kvbridge.Bridge(store)
    bridge.add_adapter(old)
    bridge.save(SRC, ids, random_kv(SRC, len(ids), 3))
    bridge.save(TGT, own, random_kv(TGT, len(own), 4))
    first = bridge.load(TGT, ids)
    assert first.converted and first.tokens == 4 * CHUNK
    assert (first.converted_from, first.adapter) == (SRC.fingerprint, old.fingerprint)
    mine = bridge.load(TGT, own)
    assert not mine.converted and (mine.converted_from, mine.adapter) == ("", "")

    # The written-back entries are native hits now, still saying where they came from, from
    # memory, from disk and from Redis alike.
    again = bridge.load(TGT, ids)
    assert not again.converted and again.source == TGT.name
    assert (again.converted_from, again.adapter) == (SRC.fingerprint, old.fingerprint)
    del bridge, store
    for tiers in (("memory",), ("memory", "disk")):
        store = open_store()
        store.clear(tiers)
        reader = kvbridge.Bridge(store)
        hit = reader.load(TGT, ids)
        assert hit.tokens == 4 * CHUNK and not hit.converted, tiers
        assert (hit.converted_from, hit.adapter) == (SRC.fingerprint, old.fingerprint), tiers
        del reader, store

    # Replacing the adapter purges what the old one wrote back, in every tier; the model's own
    # entries stay. The next load converts through the new adapter.
    store = open_store()
    bridge = kvbridge.Bridge(store)
    bridge.add_adapter(old)
    assert bridge.load(TGT, ids).adapter == old.fingerprint  # promoted from Redis into memory
    bridge.add_adapter(new, replace=True)
    for tiers in ((), ("memory",), ("memory", "disk")):
        store.clear(tiers)
        assert store.match(TGT, ids, return_kv=False).tokens == 0, tiers
    assert store.match(TGT, own, return_kv=False).tokens == 2 * CHUNK
    hit = bridge.load(TGT, ids)
    assert hit.converted and hit.adapter == new.fingerprint
    # invalidate_adapter by hand, and remove_adapter, purge the same way.
    assert bridge.invalidate_adapter(new) == {"memory": 4, "disk": 4, "redis": 4,
                                              "redis_complete": True}
    assert bridge.load(TGT, ids).converted  # converted again, written back again
    assert bridge.remove_adapter(SRC, TGT)
    store.clear(("memory", "disk"))
    assert store.match(TGT, ids, return_kv=False).tokens == 0
    assert store.match(TGT, own, return_kv=False).tokens == 2 * CHUNK
    with pytest.raises(kvbridge.InvalidArgumentError, match="hex"):
        store.invalidate_adapter(TGT, "not-a-fingerprint")
