"""kvbridge.experiments.demo: main() on a small batch; its report agrees with the Bridge's stats and
with a direct conversion, and a missing or stale adapter is refitted, never used."""
import pytest
import torch

import kvbridge
from kvbridge import hf
from kvbridge.experiments import demo
from kvbridge.experiments import eval as ev
import tiny_testbed

ARGS = ["--prompts", "3", "--window-tokens", "40", "--continuation-tokens", "8",
        "--generate", "5", "--chunk-tokens", "8", "--fit-windows", "8", "--min-quality=-inf",
        "--cross-prompts", "0"]


def test_demo_main_report(tmp_path, monkeypatch, capsys):
    tiny_testbed.install(monkeypatch)
    report = demo.main(ARGS + ["--adapter", str(tmp_path / "missing.safetensors")])
    printed = capsys.readouterr()
    assert "fitting one" in printed.err
    assert report["adapter"]["origin"] == "fitted"
    assert report["prompts"] == 3 and len(report["rows"]) == 3
    st = report["bridge_stats"]
    # three converted loads, then one reload that write-back made native
    assert st["loads"] == 4 and st["converted_hits"] == 3 and st["native_hits"] == 1
    assert st["saves"] == 3 and st["misses"] == 0
    assert report["reload_is_native"]
    # whole chunks are converted, the trimmed last prompt token included (BridgeStats)
    assert st["converted_tokens"] == sum(r["prompt_tokens"] // 8 * 8 for r in report["rows"])
    assert st["written_back_tokens"] == st["converted_tokens"]
    for r in report["rows"]:
        assert r["prompt_tokens"] == 32 and r["loaded_tokens"] == 31 and r["converted"]
        assert r["source"] == "tiny-a"
        assert len(r["own_tokens"]) == len(r["bridge_tokens"]) == 5
    assert report["scored"]["tokens"] == 3 * 8
    assert report["same_generation"] == sum(r["own_tokens"] == r["bridge_tokens"]
                                            for r in report["rows"])
    assert report["same_first_token"] == sum(r["own_tokens"][0] == r["bridge_tokens"][0]
                                             for r in report["rows"])
    assert "TTFT own ms" in printed.out and "kept" in printed.out


def test_demo_uses_matching_adapter_and_refuses_stale(tmp_path, monkeypatch):
    tiny_testbed.install(monkeypatch)
    pair = tiny_testbed.load_pair()
    windows = ev.text_windows(pair, "train", 40, 6, data=tiny_testbed)
    adapter = ev.fit_variants(pair, windows, ["rope_auto"])["rope_auto"]
    path = tmp_path / "a.safetensors"
    adapter.save(path)
    got = demo.get_adapter(pair, str(path), 4, log=lambda m: None)
    assert got["origin"] == "shipped"
    messages = []
    stale = demo.get_adapter(tiny_testbed.load_pair(version="2"), str(path), 4,
                             log=messages.append)
    assert stale["origin"] == "fitted" and "stale" in messages[0]
    assert stale["adapter"].source.version == "a2"


def test_bridge_conversion_matches_direct_convert(monkeypatch):
    pair = tiny_testbed.load_pair()
    windows = ev.text_windows(pair, "train", 40, 6, data=tiny_testbed)
    adapter = ev.fit_variants(pair, windows, ["rope_auto"])["rope_auto"]
    prompt = ev.text_windows(pair, "heldout", 33, 1, data=tiny_testbed)[0]
    report = demo.run(pair, adapter, [prompt + [0]], continuation=1, generate=2,
                      chunk_tokens=8, min_quality=float("-inf"))
    bridge = kvbridge.Bridge(kvbridge.KVStore(1 << 24, chunk_tokens=8),
                             min_quality=float("-inf"))
    bridge.add_adapter(adapter)
    src_kv = hf.prefix_kv(pair.source.model, prompt)
    bridge.save(pair.source.spec, prompt, src_kv)
    load = bridge.load(pair.target.spec, prompt)
    assert load.tokens == 32 == report["rows"][0]["loaded_tokens"]
    direct = adapter.convert(tuple((k[:, :, :32], v[:, :, :32]) for k, v in src_kv))
    for (k, v), (dk, dv) in zip(load.kv, direct):
        torch.testing.assert_close(k, dk, atol=0, rtol=0)
        torch.testing.assert_close(v, dv, atol=0, rtol=0)


def test_shipped_adapter_fits_the_shipped_weights():
    # Fails whenever the testbed weights change without a refit of the shipped adapter
    # (python -m kvbridge.experiments.eval --save-adapter ..., or scripts/fit_testbed_adapter.py).
    testbed = pytest.importorskip("kvbridge.experiments.testbed")
    pair = testbed.load_pair()
    adapter = ev.load_adapter(ev.DEFAULT_ADAPTER, pair)
    assert adapter.source.name == "testbed-a" and adapter.target.name == "testbed-b"
    assert kvbridge.Bridge.quality(adapter) > 0.5


def test_cross_tokenizer_row_serves_the_aligned_conversion():
    testbed = pytest.importorskip("kvbridge.experiments.testbed")
    from kvbridge.experiments import eval_cross as xe

    pair = testbed.load_pair("testbed-a", "testbed-c")
    adapter = demo.get_cross_adapter(pair, xe.DEFAULT_CROSS_ADAPTER, 4)["adapter"]
    texts = xe.text_windows("heldout", 255, 2)
    report = demo.run_cross(pair, adapter, texts, 0.25, generate=3)
    assert report["prompts"] == 2 and report["bridge_stats"]["converted_hits"] == 2
    for text, r in zip(texts, report["rows"]):
        assert r["converted"] and r["loaded_tokens"] == r["prompt_tokens"] - 1
        assert len(r["own_tokens"]) == len(r["bridge_tokens"]) == 3
        # What the Bridge served is the adapter's conversion through the "seen" alignment of
        # the prompt's two tokenizations (nothing misaligned, nothing lost).
        prompt = xe.utf8_prefix(text, int(0.75 * len(text.encode("utf-8"))))
        assert r["prompt_bytes"] == len(prompt.encode("utf-8"))
        src = xe.encode(pair.source.tokenizer, prompt)
        tgt = xe.encode(pair.target.tokenizer, prompt)
        m = len(tgt.ids) - 1
        index, missing = xe.alignment(adapter.report["alignment_policy"], src,
                                      xe.Encoded(tgt.ids[:m], tgt.offsets[:m], tgt.roles[:m]))
        assert missing == 0
        want = adapter.convert(hf.prefix_kv(pair.source.model, src.ids), alignment=index)
        bridge = kvbridge.Bridge(kvbridge.KVStore(1 << 26, chunk_tokens=16), min_quality=0.0)
        bridge.add_tokenizer(pair.source.spec, pair.source.tokenizer)
        bridge.add_tokenizer(pair.target.spec, pair.target.tokenizer)
        bridge.add_adapter(adapter)
        bridge.save(pair.source.spec, src.ids, hf.prefix_kv(pair.source.model, src.ids))
        load = bridge.load(pair.target.spec, tgt.ids)
        assert load.tokens == m
        for (k, v), (wk, wv) in zip(load.kv, want):
            torch.testing.assert_close(k, wk, rtol=0, atol=1e-5)
            torch.testing.assert_close(v, wv, rtol=0, atol=1e-5)
    assert "Across tokenizers" in demo.format_cross(report, pair)
