"""Bridge through the Python API: native vs converted loads, write-back, the quality gate,
tokenizer and namespace isolation, the last-token rule, validation, stats and metrics."""
import math

import pytest
import torch

import kvbridge
from conftest import random_kv, run_threads

SRC = kvbridge.ModelSpec("src", 2, 2, 8, rope_base=10000.0, tokenizer="tok")
SRC2 = kvbridge.ModelSpec("src2", 1, 1, 6, rope_base=30000.0, tokenizer="tok")
TGT = kvbridge.ModelSpec("tgt", 3, 3, 4, rope_base=50000.0, rope_style="interleaved",
                         tokenizer="tok")
CHUNK = 16


def rope(x, spec, start_pos):
    """RoPE in float64 on [1, heads, tokens, dim] (no scaling)."""
    dim = x.shape[-1]
    inv = 1.0 / spec.rope_base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    ang = torch.arange(start_pos, start_pos + x.shape[2], dtype=torch.float64)[:, None] * inv
    cos, sin = ang.cos(), ang.sin()
    if spec.rope_style == "half":
        a, b = x[..., : dim // 2], x[..., dim // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)


def fit_planted(src, tgt, seed, noise=False):
    """An adapter fitted on a planted affine map (or, with noise, on unrelated targets)."""
    g = torch.Generator().manual_seed(seed)
    sw, tw = src.num_kv_heads * src.head_dim, tgt.num_kv_heads * tgt.head_dim
    features = 2 * src.num_layers * sw
    weights = [torch.randn(features, tw, generator=g, dtype=torch.float64) * 0.3
               for _ in range(2 * tgt.num_layers)]
    fitter = kvbridge.AdapterFitter(src, tgt, source_layers="all")
    for i in range(4):
        tokens, start = 97, 5 + 200 * i
        x = torch.randn(tokens, features, generator=g, dtype=torch.float64)
        planes = x.reshape(tokens, 2 * src.num_layers, src.num_kv_heads, src.head_dim)
        planes = planes.permute(1, 2, 0, 3).unsqueeze(1)  # [2L, 1, heads, tokens, dim]
        src_kv = tuple((rope(planes[2 * l], src, start).float(), planes[2 * l + 1].float())
                       for l in range(src.num_layers))
        tgt_kv = []
        for j in range(tgt.num_layers):
            pair = []
            for k in range(2):
                y = (torch.randn(tokens, tw, generator=g, dtype=torch.float64) if noise
                     else x @ weights[2 * j + k] + 0.5)
                y = y.reshape(1, tokens, tgt.num_kv_heads, tgt.head_dim).transpose(1, 2)
                pair.append((rope(y, tgt, start) if k == 0 else y).float())
            tgt_kv.append(tuple(pair))
        fitter.add(src_kv, tuple(tgt_kv), start_pos=start)
    return fitter.fit()


@pytest.fixture(scope="module")
def good():
    return fit_planted(SRC, TGT, 1)


@pytest.fixture(scope="module")
def good2():
    return fit_planted(SRC2, TGT, 2)


@pytest.fixture(scope="module")
def bad():
    return fit_planted(SRC, TGT, 3, noise=True)


def make_bridge(*adapters, **options):
    bridge = kvbridge.Bridge(kvbridge.KVStore(64 << 20, chunk_tokens=CHUNK), **options)
    for a in adapters:
        bridge.add_adapter(a)
    return bridge


def tokens_of(n, seed):
    return torch.randint(0, 50000, (n,), generator=torch.Generator().manual_seed(seed))


def prefix(kv, begin, count):
    return tuple((k[:, :, begin:begin + count], v[:, :, begin:begin + count]) for k, v in kv)


def assert_kv_equal(a, b):
    assert len(a) == len(b)
    for (k, v), (k0, v0) in zip(a, b):
        assert torch.equal(k, k0) and torch.equal(v, v0)


def max_rel_diff(a, b):
    diff = max((x - y).abs().max().item() for pa, pb in zip(a, b) for x, y in zip(pa, pb))
    scale = max(y.abs().max().item() for pb in b for y in pb)
    assert scale > 0
    return diff / scale


def test_planted_adapters_quality(good, good2, bad):
    assert kvbridge.Bridge.quality(good) > 0.999
    assert kvbridge.Bridge.quality(good2) > 0.999
    assert kvbridge.Bridge.quality(bad) < 0.2
    layers = good.report["layers"]
    assert kvbridge.Bridge.quality(good) == min(min(l["r2_key"], l["r2_value"]) for l in layers)


def test_converted_equals_adapter_convert_then_native(good):
    bridge = make_bridge(good)
    ids = tokens_of(53, 1)
    src_kv = random_kv(SRC, 53, seed=11, strided=True)
    assert bridge.save(SRC, ids, src_kv) == 48
    first = bridge.load(TGT, ids)
    assert (first.tokens, first.native_tokens, first.converted) == (48, 0, True)
    assert first.source == "src"
    assert first.quality == kvbridge.Bridge.quality(good)
    assert first.kv[0][0].shape == (1, 3, 48, 4) and first.kv[0][0].dtype == torch.float32
    assert_kv_equal(first.kv, good.convert(prefix(src_kv, 0, 48)))
    # float32 arithmetic vs the float64 path, unit-scale data, 64 features per output.
    assert max_rel_diff(first.kv, good.convert(prefix(src_kv, 0, 48), reference=True)) < 1e-5

    second = bridge.load(TGT, ids)
    assert (second.tokens, second.native_tokens, second.converted) == (48, 48, False)
    assert second.source == "tgt"
    assert math.isnan(second.quality)
    assert_kv_equal(second.kv, first.kv)
    s = bridge.stats()
    assert (s["saves"], s["loads"], s["misses"]) == (1, 2, 0)
    assert (s["native_hits"], s["converted_hits"]) == (1, 1)
    assert (s["conversions"], s["converted_tokens"], s["written_back_tokens"]) == (1, 48, 48)
    assert s["convert_seconds"] > 0 and s["lookup_seconds"] > 0


def test_native_wins_and_longer_conversion_extends_it(good):
    bridge = make_bridge(good)
    ids = tokens_of(61, 2)
    src_kv, tgt_kv = random_kv(SRC, 61, seed=12), random_kv(TGT, 61, seed=13)
    bridge.save(SRC, ids, src_kv)
    bridge.save(TGT, ids[:20], prefix(tgt_kv, 0, 20))  # 16 native tokens
    load = bridge.load(TGT, ids)
    assert (load.tokens, load.native_tokens, load.converted) == (48, 16, True)
    assert_kv_equal(prefix(load.kv, 0, 16), prefix(tgt_kv, 0, 16))
    tail = prefix(load.kv, 16, 32)
    assert_kv_equal(tail, good.convert(prefix(src_kv, 16, 32), start_pos=16))
    whole = good.convert(prefix(src_kv, 0, 48), reference=True)
    assert max_rel_diff(tail, prefix(whole, 16, 32)) < 1e-5

    same = make_bridge(good)
    same.save(SRC, ids, src_kv)
    same.save(TGT, ids, tgt_kv)
    native = same.load(TGT, ids)
    assert not native.converted and native.source == "tgt"
    assert_kv_equal(native.kv, prefix(tgt_kv, 0, 48))
    assert same.stats()["conversions"] == 0


def test_longest_source_wins(good, good2):
    bridge = make_bridge(good, good2)
    ids = tokens_of(70, 3)
    a, b = random_kv(SRC, 40, seed=14), random_kv(SRC2, 70, seed=15)
    bridge.save(SRC, ids[:40], a)
    bridge.save(SRC2, ids, b)
    load = bridge.load(TGT, ids)
    assert (load.source, load.tokens) == ("src2", 64)
    assert_kv_equal(load.kv, good2.convert(prefix(b, 0, 64)))


def test_quality_gate(bad):
    bridge = make_bridge(bad)
    ids = tokens_of(33, 4)
    bridge.save(SRC, ids, random_kv(SRC, 33, seed=16))
    miss = bridge.load(TGT, ids)
    assert miss.tokens == 0 and miss.kv is None and miss.source == "" and not miss.converted
    s = bridge.stats()
    assert (s["misses"], s["conversions"], s["adapters_skipped_quality"]) == (1, 0, 1)
    assert (s["adapters"], s["adapters_below_quality"]) == (1, 1)
    ungated = kvbridge.Bridge(bridge.store, min_quality=float("-inf"))
    ungated.add_adapter(bad)
    assert ungated.load(TGT, ids).converted


def test_tokenizer_mismatch_never_converts(good):
    bridge = make_bridge(good)
    ids = tokens_of(40, 5)
    bridge.save(SRC, ids, random_kv(SRC, 40, seed=17))
    other = kvbridge.ModelSpec("tgt", 3, 3, 4, rope_base=50000.0, rope_style="interleaved",
                               tokenizer="another")
    assert bridge.load(other, ids).tokens == 0
    assert bridge.stats()["conversions"] == 0
    assert bridge.stats()["adapters_skipped_stale"] == 1
    s = kvbridge.ModelSpec("s", 1, 1, 4, tokenizer="a")
    t = kvbridge.ModelSpec("t", 1, 1, 4, tokenizer="b")
    with pytest.raises(ValueError, match="tokenizer"):
        bridge.add_adapter(fit_planted(s, t, 4))


def test_last_token_is_never_returned(good):
    bridge = make_bridge(good)
    ids = tokens_of(48, 6)  # three whole chunks
    src_kv = random_kv(SRC, 48, seed=18)
    bridge.save(SRC, ids, src_kv)
    conv = bridge.load(TGT, ids)
    assert conv.converted and conv.tokens == 47
    assert_kv_equal(conv.kv, prefix(good.convert(src_kv), 0, 47))
    assert bridge.store.match(TGT, ids, return_kv=False).tokens == 48  # all 48 written back
    assert bridge.load(TGT, ids).tokens == 47
    assert bridge.load(TGT, ids[:16]).tokens == 15
    assert bridge.load(TGT, ids[:17]).tokens == 16
    for empty in ([], ids[:1]):
        assert bridge.load(TGT, empty).tokens == 0


def test_namespaces_are_isolated(good):
    bridge = make_bridge(good)
    ids = tokens_of(40, 7)
    bridge.save(SRC, ids, random_kv(SRC, 40, seed=19), namespace="a")
    assert bridge.load(TGT, ids, namespace="b").tokens == 0
    assert bridge.load(TGT, ids, namespace="a").converted
    assert bridge.load(TGT, ids, namespace="b").tokens == 0
    assert bridge.load(TGT, ids).tokens == 0
    assert bridge.load(TGT, ids, namespace="a").native_tokens == 32


def test_validation(good, bad):
    store = kvbridge.KVStore(1 << 20, chunk_tokens=CHUNK)
    with pytest.raises(ValueError, match="NaN"):
        kvbridge.Bridge(store, min_quality=float("nan"))
    with pytest.raises(TypeError):
        kvbridge.Bridge(object())
    bridge = kvbridge.Bridge(store)
    with pytest.raises(TypeError):
        bridge.add_adapter(object())
    bridge.add_adapter(bad)
    with pytest.raises(ValueError, match="already registered"):
        bridge.add_adapter(good)
    bridge.add_adapter(good, replace=True)
    assert [a.report for a in bridge.adapters()] == [good.report]
    assert bridge.remove_adapter(SRC, TGT) and not bridge.remove_adapter(SRC, TGT)
    with pytest.raises(ValueError, match="same model"):
        bridge.add_adapter(fit_planted(TGT, TGT, 5))
    ids = tokens_of(20, 8)
    with pytest.raises(ValueError, match="layers"):
        bridge.save(TGT, ids, random_kv(SRC, 20, seed=1))
    with pytest.raises(ValueError, match="tokens"):
        bridge.save(TGT, ids, random_kv(TGT, 19, seed=1))
    with pytest.raises(ValueError):
        bridge.load(TGT, [1, 2, -3])
    with pytest.raises(TypeError):
        bridge.load(TGT, [1.5, 2.5])


def test_metrics_and_device(good):
    bridge = make_bridge(good)
    ids = tokens_of(40, 9)
    bridge.save(SRC, ids, random_kv(SRC, 40, seed=20))
    bridge.load(TGT, ids)
    assert bridge.load(TGT, ids, return_kv=False).kv is None
    bridge.load(SRC2, ids)
    text = bridge.metrics()
    assert text == bridge.metrics_text() == bridge.prometheus_text()
    lines = dict(l.rsplit(" ", 1) for l in text.splitlines() if not l.startswith("#"))
    assert lines["kvbridge_bridge_loads_total"] == "3"
    assert lines["kvbridge_bridge_native_hits_total"] == "1"
    assert lines["kvbridge_bridge_converted_hits_total"] == "1"
    assert lines["kvbridge_bridge_misses_total"] == "1"
    assert lines["kvbridge_bridge_converted_tokens_total"] == "32"
    assert lines["kvbridge_bridge_adapters"] == "1"
    assert float(lines["kvbridge_bridge_convert_seconds_total"]) > 0
    assert "# TYPE kvbridge_bridge_adapters gauge" in text
    assert set(bridge.stats()) >= {"native_hits", "converted_hits", "misses", "conversions",
                                   "adapters_skipped_quality", "convert_seconds", "lookup_seconds"}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_load_to_device(good):
    bridge = make_bridge(good)
    ids = tokens_of(40, 10)
    bridge.save(SRC, ids, tuple((k.cuda(), v.cuda()) for k, v in random_kv(SRC, 40, seed=21)))
    assert bridge.load(TGT, ids, device="cuda").kv[0][0].device.type == "cuda"


def test_concurrent_loads_agree(good):
    bridge = make_bridge(good)
    ids = tokens_of(50, 11)
    src_kv = random_kv(SRC, 50, seed=22)
    bridge.save(SRC, ids, src_kv)
    expected = good.convert(prefix(src_kv, 0, 48))
    results, errors = [], []

    def work(_):
        try:
            for _ in range(5):
                results.append(bridge.load(TGT, ids).kv)
        except Exception as e:  # surfaced below
            errors.append(e)

    run_threads(work)
    assert not errors and len(results) == 20
    for kv in results:
        assert_kv_equal(kv, expected)
    s = bridge.stats()
    assert s["native_hits"] + s["converted_hits"] == 20 and s["converted_hits"] >= 1


def test_converted_loads_take_the_targets_own_start_token(good):
    """Once the target saved a prompt of its own opening with token s (or add_start), a
    converted load of a prompt opening with s has the target's own KV at position 0 (now and
    after write-back), the conversion everywhere else; prompts opening otherwise are untouched."""
    bridge = make_bridge(good)
    ids = tokens_of(53, 1)
    ids[0] = 7
    src_kv = random_kv(SRC, 53, seed=11)
    own_kv = random_kv(TGT, 37, seed=12)  # the target's own prefill of another prompt opening with 7
    other = tokens_of(37, 2)
    other[0] = 7
    assert bridge.save(TGT, other, own_kv) == 32
    bridge.save(SRC, ids, src_kv)
    converted = good.convert(prefix(src_kv, 0, 48))
    for hit in (bridge.load(TGT, ids), bridge.load(TGT, ids)):  # converted, then written back
        assert hit.tokens == 48 and hit.adapter
        for (k, v), (ck, cv), (ok, ov) in zip(hit.kv, converted, own_kv):
            assert torch.equal(k[:, :, 0], ok[:, :, 0]) and torch.equal(v[:, :, 0], ov[:, :, 0])
            assert torch.equal(k[:, :, 1:], ck[:, :, 1:]) and torch.equal(v[:, :, 1:], cv[:, :, 1:])
            assert not torch.equal(k[:, :, 0], ck[:, :, 0])
    # A prompt opening with another token keeps the converted first token.
    ids2 = tokens_of(40, 3)
    ids2[0] = 8
    bridge.save(SRC, ids2, random_kv(SRC, 40, seed=13))
    hit = bridge.load(TGT, ids2)
    assert_kv_equal(hit.kv, good.convert(prefix(random_kv(SRC, 40, seed=13), 0, 32)))
    # add_start registers it explicitly, replacing what a save recorded.
    start = random_kv(TGT, 1, seed=14)
    bridge.add_start(TGT, 8, start)
    hit = bridge.load(TGT, ids2)
    assert torch.equal(hit.kv[2][0][:, :, 0], start[2][0][:, :, 0])
    with pytest.raises(ValueError, match="expected 3 layers"):
        bridge.add_start(TGT, 8, start[:2])
