"""Quality levers and monitoring on the shipped testbed pair: exact first layers, tail recompute,
shadow checks (compare), the automatic fallback with a deliberately damaged adapter, the probe at
registration, and the sampling."""
import logging
import math

import pytest
import torch

import kvbridge
from kvbridge import exact, monitor
from kvbridge import hf
from kvbridge.experiments import eval as ev
from kvbridge.experiments import testbed

CHUNK = 16


@pytest.fixture(scope="module")
def pair():
    return testbed.load_pair()


@pytest.fixture(scope="module")
def shipped(pair):
    return ev.load_adapter(ev.DEFAULT_ADAPTER, pair)


@pytest.fixture(scope="module")
def damaged(pair):
    """An adapter fitted on mismatched pairs (each source window against another window's target
    KV): it loads and converts, but its KV is unrelated to the target's."""
    return monitor.damaged_adapter(pair.source.model, pair.target.model, pair.source.spec,
                                   pair.target.spec, ev.text_windows(pair, "train", 64, 12))


@pytest.fixture(scope="module")
def prompts(pair):
    return ev.text_windows(pair, "heldout", 80, 12)


def make_bridge(*adapters, **options):
    # Tail 0 unless a test gives one: the shipped adapter's recorded 96 would leave nothing of
    # these 80-token prompts to convert.
    options.setdefault("recompute_tail", 0)
    bridge = kvbridge.Bridge(kvbridge.KVStore(64 << 20, chunk_tokens=CHUNK),
                             min_quality=float("-inf"), **options)
    for a in adapters:
        bridge.add_adapter(a)
    return bridge


def test_own_first_layers_equal_the_full_prefill(pair):
    model = pair.target.model
    ids = pair.tokenizer.encode(testbed.texts("heldout")[3])[:45]
    own = hf.prefix_kv(model, ids)
    for k in (1, 2, pair.target.spec.num_layers):
        mine = exact.own_first_layers(model, ids, k)
        assert len(mine) == k
        for (key, value), (k0, v0) in zip(mine, own):
            torch.testing.assert_close(key, k0, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(value, v0, atol=1e-6, rtol=1e-6)
    assert len(model.model.layers) == pair.target.spec.num_layers  # the model is untouched
    with pytest.raises(ValueError):
        exact.own_first_layers(model, ids, 0)
    with pytest.raises(ValueError):
        exact.own_first_layers(model, ids, 7)
    with pytest.raises(TypeError):
        exact.own_first_layers(torch.nn.Linear(2, 2), ids, 1)


def test_exact_layers_replace_only_the_first(pair, shipped):
    ids = pair.tokenizer.encode(testbed.texts("heldout")[4])[:50]
    conv = shipped.convert(hf.prefix_kv(pair.source.model, ids[:40]))
    own = hf.prefix_kv(pair.target.model, ids[:40])
    out = exact.exact_layers(pair.target.model, ids, conv, 2)  # tokens may run past the cache
    for i, ((k, v), (ck, cv), (ok, ov)) in enumerate(zip(out, conv, own)):
        if i < 2:
            torch.testing.assert_close(k, ok, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(v, ov, atol=1e-6, rtol=1e-6)
            assert not torch.equal(k, ck)
        else:
            assert k is ck and v is cv
    assert exact.exact_layers(pair.target.model, ids, conv, 0)[0][0] is conv[0][0]
    with pytest.raises(ValueError, match="holds 40 tokens"):
        exact.exact_layers(pair.target.model, ids[:30], conv, 1)


def test_bridge_levers_tail_and_exact_layers(pair, shipped):
    ids = pair.tokenizer.encode(testbed.texts("heldout")[5])[:53]
    src_kv = hf.prefix_kv(pair.source.model, ids)
    bridge = make_bridge(shipped, recompute_tail=5, exact_layers=1, write_back=False)
    assert (bridge.recompute_tail, bridge.exact_layers) == (5, 1)
    bridge.save(pair.source.spec, ids, src_kv)
    hit = bridge.load(pair.target.spec, ids, model=pair.target.model)
    assert hit.converted and hit.tokens == 47  # 53 - 1 - 5
    conv = shipped.convert(tuple((k[:, :, :47], v[:, :, :47]) for k, v in src_kv))
    own = hf.prefix_kv(pair.target.model, ids[:47])
    torch.testing.assert_close(hit.kv[0][0], own[0][0], atol=1e-6, rtol=1e-6)
    for (k, v), (ck, cv) in zip(hit.kv[1:], conv[1:]):
        torch.testing.assert_close(k, ck, atol=1e-5, rtol=1e-5)
    # Without the model the layers stay converted.
    plain = bridge.load(pair.target.spec, ids)
    torch.testing.assert_close(plain.kv[0][0], conv[0][0], atol=1e-5, rtol=1e-5)
    with pytest.raises(kvbridge.InvalidArgumentError):
        make_bridge(recompute_tail=-2)
    with pytest.raises(TypeError):
        make_bridge(exact_layers=1.5)


def test_compare_logits_hand_computed():
    ln2 = math.log(2.0)
    own = torch.tensor([[ln2, 0.0, 0.0], [0.0, 0.0, ln2]], dtype=torch.float64)
    conv = torch.tensor([[ln2, 0.0, 0.0], [0.0, ln2, 0.0]], dtype=torch.float64)
    c = monitor.compare_logits(own, conv, torch.tensor([1]))
    assert (c.positions, c.agreed, c.loss_positions) == (2, 1, 1)
    # Position 2: p_own = [1/4, 1/4, 1/2], p_conv = [1/4, 1/2, 1/4].
    kl2 = 0.25 * 0 + 0.25 * math.log(0.5) + 0.5 * math.log(2.0)
    assert c.kl_sum == pytest.approx(kl2, abs=1e-12)
    assert c.loss_gap_sum == 0.0  # position 1 predicts token 1 equally under both
    assert c.agreement == 0.5 and c.kl == pytest.approx(kl2 / 2) and c.loss_gap == 0.0
    with pytest.raises(ValueError):
        monitor.compare_logits(own, conv[:1], torch.tensor([]))


def test_compare_own_cache_is_perfect_and_noise_is_not(pair):
    model = pair.target.model
    ids = pair.tokenizer.encode(testbed.texts("heldout")[6])[:70]
    own = hf.prefix_kv(model, ids[:69])
    c = monitor.compare(model, ids, own, positions=8)
    assert (c.positions, c.agreed, c.loss_positions) == (8, 8, 7)
    assert c.kl < 1e-9 and abs(c.loss_gap) < 1e-6
    g = torch.Generator().manual_seed(3)
    noisy = tuple((k + 2.0 * torch.randn(k.shape, generator=g), v) for k, v in own)
    worse = monitor.compare(model, ids, noisy, positions=8)
    assert worse.kl > 1e-3
    # A cache shorter than len - positions: the model runs everything past it.
    short = monitor.compare(model, ids, tuple((k[:, :, :20], v[:, :, :20]) for k, v in own), 8)
    assert short.positions == 8 and short.agreed == 8
    with pytest.raises(ValueError):
        monitor.compare(model, ids[:40], own)


def test_monitor_disables_a_damaged_adapter_within_min_checks(pair, damaged, prompts, caplog):
    bridge = make_bridge(damaged, min_agreement=0.9, check_window=16, min_checks=4)
    mon = monitor.QualityMonitor(bridge, {pair.target.spec: pair.target.model}, sample_rate=1.0)
    for p in prompts:
        bridge.save(pair.source.spec, p, hf.prefix_kv(pair.source.model, p))
    with caplog.at_level(logging.WARNING, logger="kvbridge.monitor"):
        converted = 0
        for p in prompts:
            hit = mon.load(pair.target.spec, p)
            converted += bool(hit.adapter)
    s = mon.stats()
    h = s["adapters"][damaged.fingerprint]
    assert not h["enabled"]
    assert converted == 4 and s["checks"] == 4 and s["disables"] == 1  # caught at min_checks
    assert h["agreement"] < 0.9 and h["disables"] == 1
    assert "disabled" in caplog.text and damaged.fingerprint in caplog.text
    # Falls back: no converted tokens, and the written-back entries are gone.
    hit = mon.load(pair.target.spec, prompts[0])
    assert hit.tokens == 0 and not hit.adapter
    b = bridge.stats()
    assert b["adapters_disabled"] == 1 and b["quality_disables"] == 1
    assert b["adapters_skipped_disabled"] >= len(prompts) - 4
    assert f'kvbridge_bridge_adapter_enabled{{adapter="{damaged.fingerprint}"' in mon.metrics_text()
    assert mon.metrics() == mon.metrics_text()
    assert mon.enable(damaged)
    assert mon.load(pair.target.spec, prompts[0]).converted


def test_monitor_keeps_the_shipped_adapter(pair, shipped, prompts):
    bridge = make_bridge(shipped, min_checks=4)
    mon = monitor.QualityMonitor(bridge, {pair.target.spec.fingerprint: pair.target.model},
                                 sample_rate=1.0)
    for p in prompts:
        bridge.save(pair.source.spec, p, hf.prefix_kv(pair.source.model, p))
        mon.load(pair.target.spec, p)
    h = mon.stats()["adapters"][shipped.fingerprint]
    assert h["enabled"] and h["checks"] == len(prompts)
    assert h["agreement"] >= 0.9 and h["kl"] < 0.1 and abs(h["loss_gap"]) < 0.2
    # Loads of a model the monitor has no model for are never checked.
    other = monitor.QualityMonitor(bridge, {}, sample_rate=1.0)
    other.load(pair.target.spec, prompts[0])
    assert other.stats()["checks"] == 0


def test_sampling_is_seeded(pair, shipped, prompts):
    def sampled(rate, seed):
        bridge = make_bridge(shipped, write_back=False)
        mon = monitor.QualityMonitor(bridge, {pair.target.spec: pair.target.model},
                                     sample_rate=rate, seed=seed)
        p = prompts[0]
        bridge.save(pair.source.spec, p, hf.prefix_kv(pair.source.model, p))
        for _ in range(30):
            mon.load(pair.target.spec, p, return_kv=True)
        s = mon.stats()
        assert s["eligible"] == 30 and s["checks"] == s["sampled"]
        return s["sampled"]

    assert sampled(0.0, 0) == 0
    assert sampled(0.2, 7) == sampled(0.2, 7)
    assert 0 < sampled(0.2, 7) < 30
    with pytest.raises(ValueError):
        monitor.QualityMonitor(make_bridge(), {}, sample_rate=1.5)
    with pytest.raises(TypeError):
        monitor.QualityMonitor(object(), {})


def test_probe_refuses_a_damaged_adapter(pair, shipped, damaged):
    bridge = make_bridge()
    with pytest.raises(monitor.AdapterQualityError, match="probe agreement") as err:
        bridge.add_adapter(damaged, source_model=pair.source.model,
                           target_model=pair.target.model)
    assert isinstance(err.value, ValueError)
    assert bridge.adapters() == []
    bridge.add_adapter(shipped, source_model=pair.source.model, target_model=pair.target.model)
    assert [a.fingerprint for a in bridge.adapters()] == [shipped.fingerprint]
    with pytest.raises(TypeError):
        bridge.add_adapter(shipped, replace=True, source_model=pair.source.model)
    a = monitor.sample_prompts(pair.source.model, count=2, length=20, seed=1)
    assert a == monitor.sample_prompts(pair.source.model, count=2, length=20, seed=1)
    assert [len(p) for p in a] == [20, 20] and a[0][0] == pair.source.model.config.bos_token_id
    check = monitor.probe_adapter(shipped, pair.source.model, pair.target.model, prompts=a)
    assert check.positions == 32


def test_record_check_validation(shipped):
    bridge = make_bridge(shipped)
    with pytest.raises(kvbridge.InvalidArgumentError):
        bridge.record_check(shipped, monitor.Check(4, 5, 0.0, 0, 0.0))
    with pytest.raises(kvbridge.NotFoundError):
        bridge.record_check("0" * 32, monitor.Check(4, 4, 0.0, 0, 0.0))
    with pytest.raises(TypeError):
        bridge.record_check(3, monitor.Check(4, 4, 0.0, 0, 0.0))
    assert not bridge.record_check(shipped, monitor.Check(4, 4, 0.0, 3, 0.0))
    assert bridge.disable_adapter(shipped) and not bridge.adapter_health()[0]["enabled"]
    assert bridge.enable_adapter(shipped.fingerprint)
    assert not bridge.enable_adapter("0" * 32)


def test_probe_refuses_adapters_across_tokenizers():
    from kvbridge.experiments import eval_cross

    cross = testbed.load_pair(source="testbed-a", target="testbed-c")
    adapter = kvbridge.LinearAdapter.load(eval_cross.DEFAULT_CROSS_ADAPTER)
    assert adapter.alignment_policy
    bridge = kvbridge.Bridge(kvbridge.KVStore(capacity_bytes=1 << 24, chunk_tokens=CHUNK))
    with pytest.raises(kvbridge.InvalidArgumentError, match="across tokenizers"):
        bridge.add_adapter(adapter, source_model=cross.source.model,
                           target_model=cross.target.model)
    assert bridge.adapters() == []


def test_forward_continues_a_cache(pair):
    """eval.forward over a prefix cache gives the logits of the whole prompt's forward (the
    cache reaches the model under the keyword the installed transformers takes)."""
    model = pair.target.model
    ids = pair.tokenizer.encode(testbed.texts("heldout")[5])[:37]
    whole, _ = hf.forward(model, ids)
    _, past = hf.forward(model, ids[:23])
    tail, kv = hf.forward(model, ids[23:], past)
    torch.testing.assert_close(tail, whole[23:], atol=1e-4, rtol=1e-4)
    assert kv[0][0].shape[2] == len(ids)
    none, _ = hf.forward(model, ids[23:])  # without the prefix the logits differ
    assert (none - whole[23:]).abs().max() > 0.1


def test_damaged_adapter_arguments(pair):
    windows = ev.text_windows(pair, "train", 24, 3)
    args = (pair.source.model, pair.target.model, pair.source.spec, pair.target.spec)
    with pytest.raises(ValueError, match="at least 2 of one length"):
        monitor.damaged_adapter(*args, windows[:1])
    with pytest.raises(ValueError, match="at least 2 of one length"):
        monitor.damaged_adapter(*args, [windows[0], windows[1][:10]])
    with pytest.raises(ValueError, match="shift"):
        monitor.damaged_adapter(*args, windows, shift=3)
