"""Serving defaults: an adapter's recorded tail recompute (LinearAdapter.serving) through the
file, the Bridge's default (recompute_tail -1: the adapter's own), explicit options, written-back
hits, the evals that record it, and the shipped testbed adapters' records."""
import math

import pytest
import torch

import kvbridge
from kvbridge import hf
from kvbridge.adapter import choose_serving
from conftest import random_kv
from test_bridge import SRC, TGT, fit_planted, make_bridge, max_rel_diff, prefix, tokens_of

RECORD = {"recompute_tail": 9, "recompute_share": 0.0, "agreement_goal": 0.875, "note": "planted",
          "by_length": [{"prompt_tokens": 53, "recompute_tail": 9}],
          "measured": [{"recompute_tail": 0, "kept": 0.5, "agreement": 0.8,
                        "computed_share": 1 / 53, "prompt_tokens": 53},
                       {"recompute_tail": 4, "kept": None, "agreement": 0.84,
                        "computed_share": 5 / 53, "prompt_tokens": 53},
                       {"recompute_tail": 9, "kept": 0.95, "agreement": 0.89,
                        "computed_share": 10 / 53, "prompt_tokens": 53}]}


@pytest.fixture()
def adapter(tmp_path):
    """A fresh planted adapter per test (its serving record is mutable)."""
    path = tmp_path / "planted.safetensors"
    fit_planted(SRC, TGT, 1).save(path)
    return kvbridge.LinearAdapter.load(path)


def test_record_round_trips_and_keeps_the_fingerprint(adapter, tmp_path):
    assert adapter.serving is None
    fp = adapter.fingerprint
    adapter.serving = RECORD
    assert adapter.serving == RECORD
    assert adapter.fingerprint == fp
    adapter.save(tmp_path / "a.safetensors")
    back = kvbridge.LinearAdapter.load(tmp_path / "a.safetensors")
    assert back.serving == RECORD and back.fingerprint == fp
    from safetensors import safe_open

    with safe_open(str(tmp_path / "a.safetensors"), "pt") as f:
        meta = f.metadata()
    assert "serving" in meta and meta["checksum"] != fp  # checksummed, not the identity
    # Only the tail is required; clearing writes the plain file again.
    adapter.serving = {"recompute_tail": 3}
    assert adapter.serving == {"recompute_tail": 3, "recompute_share": 0.0, "by_length": [],
                               "agreement_goal": None, "measured": [], "note": ""}
    adapter.serving = None
    adapter.save(tmp_path / "b.safetensors")
    with safe_open(str(tmp_path / "b.safetensors"), "pt") as f:
        assert "serving" not in f.metadata() and f.metadata()["checksum"] == fp
    assert kvbridge.LinearAdapter.load(tmp_path / "b.safetensors").serving is None


@pytest.mark.parametrize("value, error", [
    ({"recompute_tail": -1}, kvbridge.InvalidArgumentError),
    ({"agreement_goal": 0.9}, kvbridge.InvalidArgumentError),  # no tail
    ({"recompute_tail": 1, "agreement_goal": 1.5}, kvbridge.InvalidArgumentError),
    ({"recompute_tail": 1, "recompute_share": 1.5}, kvbridge.InvalidArgumentError),
    ({"recompute_tail": 1, "recompute_share": math.nan}, kvbridge.InvalidArgumentError),
    ({"recompute_tail": 1, "recompute_share": "0.1"}, TypeError),
    ({"recompute_tail": 1, "tail": 2}, kvbridge.InvalidArgumentError),
    ({"recompute_tail": 1, "measured": [{"recompute_tail": 0, "agreement": -0.5}]},
     kvbridge.InvalidArgumentError),
    ({"recompute_tail": 1, "measured": [{"recompute_tail": 0, "kept": math.inf}]},
     kvbridge.InvalidArgumentError),
    ({"recompute_tail": 1, "measured": [{"kept": 0.5}]}, kvbridge.InvalidArgumentError),
    ({"recompute_tail": 1.0}, TypeError),
    ({"recompute_tail": 1, "by_length": [{"prompt_tokens": 0, "recompute_tail": 1}]},
     kvbridge.InvalidArgumentError),
    ({"recompute_tail": 1, "by_length": [{"prompt_tokens": 50, "recompute_tail": -1}]},
     kvbridge.InvalidArgumentError),
    ({"recompute_tail": 1, "by_length": [{"prompt_tokens": 50, "recompute_tail": 1},
                                         {"prompt_tokens": 50, "recompute_tail": 2}]},
     kvbridge.InvalidArgumentError),
    ({"recompute_tail": 1, "by_length": [{"prompt_tokens": 50}]}, kvbridge.InvalidArgumentError),
    ({"recompute_tail": 1, "by_length": [{"prompt_tokens": 50, "recompute_tail": 1, "x": 0}]},
     kvbridge.InvalidArgumentError),
    ({"recompute_tail": 1, "by_length": [(50, 1)]}, TypeError),
    ({"recompute_tail": 1, "by_length": {"prompt_tokens": 50, "recompute_tail": 1}}, TypeError),
    ({"recompute_tail": 1, "measured": {"recompute_tail": 0}}, TypeError),
    ({"recompute_tail": 1, "note": 3}, TypeError),
    ([("recompute_tail", 1)], TypeError)])
def test_bad_records_are_refused(adapter, value, error):
    adapter.serving = RECORD
    with pytest.raises(error):
        adapter.serving = value
    assert adapter.serving == RECORD  # unchanged


def test_bridge_serves_with_the_adapters_tail(adapter):
    tokens = tokens_of(53, 11)  # the source caches 48 (whole chunks); limit 52
    src_kv = random_kv(SRC, 53, seed=12)
    adapter.serving = RECORD
    bridge = make_bridge(adapter)
    assert bridge.recompute_tail == -1 and bridge.recompute_tail_for(adapter, 53) == 9
    bridge.save(SRC, tokens, src_kv)
    hit = bridge.load(TGT, tokens)
    assert hit.converted and hit.tokens == 43 and hit.recompute_tail == 9  # 52 - 9
    ref = adapter.convert(prefix(src_kv, 0, 48), reference=True)
    assert max_rel_diff(hit.kv, prefix(ref, 0, 43)) < 1e-5
    # An explicit option wins; without a record the tail is 0.
    for options, tail, tokens_loaded in (({"recompute_tail": 0}, 0, 48),
                                         ({"recompute_tail": 5}, 5, 47)):
        b = make_bridge(adapter, **options)
        b.save(SRC, tokens, src_kv)
        got = b.load(TGT, tokens)
        assert (got.tokens, got.recompute_tail, b.recompute_tail_for(adapter, 53)) == \
            (tokens_loaded, tail, tail)
    adapter.serving = None
    b = make_bridge(adapter)
    b.save(SRC, tokens, src_kv)
    assert (b.load(TGT, tokens).tokens, b.recompute_tail_for(adapter, 53)) == (48, 0)


def test_bridge_serves_a_share_of_longer_prompts(adapter, tmp_path):
    # max(recompute_tail, ceil(recompute_share * n)): the fixed tail on short prompts, the
    # share on long ones.
    adapter.serving = {"recompute_tail": 2, "recompute_share": 0.1}
    bridge = make_bridge(adapter)
    assert [bridge.recompute_tail_for(adapter, n) for n in (0, 10, 20, 21, 53)] == [2, 2, 2, 3, 6]
    tokens = tokens_of(53, 13)  # the source caches 48 (whole chunks); limit 52
    src_kv = random_kv(SRC, 53, seed=14)
    bridge.save(SRC, tokens, src_kv)
    hit = bridge.load(TGT, tokens)
    assert hit.converted and hit.recompute_tail == 6 and hit.tokens == 46  # 52 - 6
    # A shorter prompt over the written-back prefix: its own length's tail.
    short = bridge.load(TGT, tokens[:36])  # written back: whole chunks [0, 32)
    assert short.recompute_tail == 4 and short.tokens == 31  # 35 - ceil(3.6)
    # The share survives the file; a file that does not record one serves the tail alone.
    adapter.save(tmp_path / "share.safetensors")
    assert kvbridge.LinearAdapter.load(tmp_path / "share.safetensors").serving[
        "recompute_share"] == 0.1
    with pytest.raises(kvbridge.InvalidArgumentError):
        bridge.recompute_tail_for(adapter, -1)


def test_bridge_serves_tails_measured_by_length(adapter, tmp_path):
    # Up to the longest measured length: each length's tail, scaled in proportion below its
    # length and held above it; past it, the share.
    adapter.serving = {"recompute_tail": 2, "recompute_share": 0.5,
                       "by_length": [{"prompt_tokens": 20, "recompute_tail": 10},
                                     {"prompt_tokens": 60, "recompute_tail": 12}]}
    bridge = make_bridge(adapter)
    assert [bridge.recompute_tail_for(adapter, n) for n in (0, 3, 10, 30, 53, 60, 61)] == \
        [2, 2, 5, 10, 11, 12, 31]
    tokens = tokens_of(53, 17)  # the source caches 48 (whole chunks); limit 52
    bridge.save(SRC, tokens, random_kv(SRC, 53, seed=18))
    hit = bridge.load(TGT, tokens)
    assert hit.converted and hit.recompute_tail == 11 and hit.tokens == 41  # 52 - 11
    adapter.save(tmp_path / "lengths.safetensors")
    back = kvbridge.LinearAdapter.load(tmp_path / "lengths.safetensors")
    assert back.serving["by_length"] == adapter.serving["by_length"]
    assert make_bridge(back).recompute_tail_for(back, 30) == 10


def test_written_back_hits_keep_the_tail(adapter):
    adapter.serving = RECORD
    bridge = make_bridge(adapter)
    tokens = tokens_of(60, 13)
    src_kv = random_kv(SRC, 60, seed=14)
    bridge.save(SRC, tokens, src_kv)
    assert bridge.load(TGT, tokens).tokens == 48  # min(48, 59 - 9), written back
    shorter = tokens[:40]  # native match 32 (written back), limit 39: cut to 30
    hit = bridge.load(TGT, shorter)
    assert (hit.converted, hit.tokens, hit.recompute_tail, hit.adapter) == \
        (False, 30, 9, adapter.fingerprint)
    ref = adapter.convert(prefix(src_kv, 0, 48), reference=True)
    assert max_rel_diff(hit.kv, prefix(ref, 0, 30)) < 1e-5
    # With tail 0 (the old default) the whole written-back 32 would be served.
    zero = kvbridge.Bridge(bridge.store, recompute_tail=0)
    zero.add_adapter(adapter)
    assert zero.load(TGT, shorter).tokens == 32


def test_record_changes_apply_to_later_loads(adapter):
    bridge = make_bridge(adapter, write_back=False)
    tokens = tokens_of(53, 15)
    bridge.save(SRC, tokens, random_kv(SRC, 53, seed=16))
    assert bridge.load(TGT, tokens).tokens == 48
    adapter.serving = {"recompute_tail": 20}
    assert bridge.load(TGT, tokens).tokens == 32


def test_choose_serving():
    points = [{"recompute_tail": 64, "agreement": 0.9888}, {"recompute_tail": 0, "agreement": 0.97},
              {"recompute_tail": 96, "agreement": 0.9905}, {"recompute_tail": 32,
                                                             "agreement": None}]
    got = choose_serving(points, 0.99, "run")
    assert got["recompute_tail"] == 96 and got["agreement_goal"] == 0.99
    assert [p["recompute_tail"] for p in got["measured"]] == [0, 32, 64, 96]
    assert got["note"].startswith("run; least measured")
    assert choose_serving(points, 0.95)["recompute_tail"] == 0
    missed = choose_serving(points, 0.999)
    assert missed["recompute_tail"] == 96 and "no measured tail reached" in missed["note"]
    with pytest.raises(kvbridge.InvalidArgumentError):
        choose_serving([], 0.9)


def test_choose_serving_holds_the_goal_at_every_prompt_length():
    # Record 255's shape: after the longer prompt the same tail agrees less.
    short = [(0, 0.858), (16, 0.872), (32, 0.879)]
    long = [(0, 0.834), (16, 0.847), (32, 0.858)]
    points = ([{"recompute_tail": r, "agreement": a, "prompt_tokens": 1266} for r, a in long]
              + [{"recompute_tail": r, "agreement": a, "prompt_tokens": 316} for r, a in short])
    got = choose_serving(points, 0.85)
    assert got["recompute_tail"] == 0 and got["recompute_share"] == pytest.approx(32 / 1266)
    assert got["by_length"] == [{"prompt_tokens": 316, "recompute_tail": 0},
                                {"prompt_tokens": 1266, "recompute_tail": 32}]
    assert "at 316 prompt tokens: 0" in got["note"] and "at 1266 prompt tokens: 32" in got["note"]
    assert [(p["recompute_tail"], p["prompt_tokens"]) for p in got["measured"]] == [
        (0, 316), (0, 1266), (16, 316), (16, 1266), (32, 316), (32, 1266)]
    # The short curve alone: a fixed tail, no share.
    alone = choose_serving(points[3:], 0.85)
    assert (alone["recompute_tail"], alone["recompute_share"]) == (0, 0.0)
    # When the longer prompts need no more than the shorter ones, no share either.
    assert choose_serving(points, 0.83)["recompute_share"] == 0.0
    # A length that reaches no measured tail falls back to its largest, and says so.
    missed = choose_serving(points, 0.86)
    assert missed["recompute_tail"] == 16
    assert missed["recompute_share"] == pytest.approx(32 / 1266)
    assert "no measured tail reached agreement 0.86 at 1266 prompt tokens" in missed["note"]


def test_real_eval_records_the_least_tail_reaching_the_goal():
    from kvbridge.experiments import real_eval

    results = {"tails": {str(r): {"kept": k, "agreement": a, "recomputed_share": s,
                                  "prompt_tokens": 900, "windows": 3}
                         for r, k, a, s in ((0, 0.48, 0.80, 0.003), (16, 0.6, 0.84, 0.06),
                                            (64, 0.73, 0.89, 0.22))}}
    rec = real_eval.serving_record(results, real_eval.DEFAULT_AGREEMENT_GOAL)
    assert rec["recompute_tail"] == 64 and rec["agreement_goal"] == 0.85
    assert rec["measured"][1] == {"recompute_tail": 16, "kept": 0.6, "agreement": 0.84,
                                  "computed_share": 0.06, "prompt_tokens": 300}
    assert real_eval.serving_record(results, 0.8)["recompute_tail"] == 0
    assert "no measured tail" in real_eval.serving_record(results, 0.95)["note"]
    # Longer prompts' curve: the tail must reach the goal there too.
    def curve(prompt_tokens, windows, points):
        return {"tails": {str(r): {"kept": k, "agreement": a, "recomputed_share": s,
                                   "prompt_tokens": prompt_tokens * windows, "windows": windows}
                          for r, k, a, s in points}}

    results["long"] = [curve(1200, 3, ((0, 0.4, 0.78, 0.001), (16, 0.5, 0.79, 0.02),
                                       (64, 0.6, 0.86, 0.06)))]
    both = real_eval.serving_record(results, 0.8)
    assert both["recompute_tail"] == 0 and len(both["measured"]) == 6
    assert both["recompute_share"] == pytest.approx(64 / 1200)
    assert both["note"].startswith("real eval, 3 + 3 held-out windows")
    assert {p["prompt_tokens"] for p in both["measured"]} == {300, 1200}
    # A third length: the record must reach the goal there too. One that needs a smaller share
    # (16 of 4,000) leaves the share to the length that needs the larger (64 of 1,200); one that
    # needs a larger share (64 of 960) takes it.
    results["long"].append(curve(4000, 2, ((0, 0.3, 0.7, 0.0), (16, 0.5, 0.81, 0.004),
                                           (64, 0.6, 0.9, 0.016))))
    three = real_eval.serving_record(results, 0.8)
    assert three["recompute_share"] == pytest.approx(64 / 1200) and len(three["measured"]) == 9
    assert [(t["prompt_tokens"], t["recompute_tail"]) for t in three["by_length"]] == [
        (300, 0), (1200, 64), (4000, 16)]
    # Served: 64 from 1,200 tokens up to 4,000 (the share would give 64 / 1200 * 4000 = 214), the
    # share past it.
    from kvbridge.experiments import eval as ev

    adapter = kvbridge.LinearAdapter.load(ev.DEFAULT_ADAPTER)
    adapter.serving = three
    bridge = kvbridge.Bridge(kvbridge.KVStore(1 << 20))
    assert [bridge.recompute_tail_for(adapter, n) for n in (300, 600, 1200, 4000, 4001)] == [
        16, 32, 64, 64, 214]
    assert three["note"].startswith("real eval, 3 + 3 + 2 held-out windows")
    results["long"][1] = curve(960, 2, ((0, 0.3, 0.7, 0.0), (16, 0.5, 0.75, 0.02),
                                        (64, 0.6, 0.82, 0.07)))
    assert real_eval.serving_record(results, 0.8)["recompute_share"] == pytest.approx(64 / 960)
    parser = real_eval.build_parser()
    args = parser.parse_args(["--source", "a", "--target", "b", "--agreement-goal", "0.7"])
    assert args.agreement_goal == 0.7 and args.long_window_bytes == [6144, 16384]
    args = parser.parse_args(["--source", "a", "--target", "b", "--long-window-bytes", "6144"])
    assert args.long_window_bytes == [6144]


def test_longer_prompts_sizes_must_exceed_the_main_windows():
    """A longer-prompt size at or below window_bytes is refused before anything is scored (its
    continuation would not be the main windows'); none at all scores the main windows alone."""
    from kvbridge.experiments import real_eval

    config = real_eval.RealConfig(window_bytes=1536, long_window_bytes=[6144, 1536])
    with pytest.raises(kvbridge.InvalidArgumentError, match="must exceed window_bytes"):
        real_eval.score_long(None, None, [], config, 1, progress=False)
    assert real_eval.score_long(None, None, [], real_eval.RealConfig(long_window_bytes=[]), 1,
                                progress=False) == {}
    assert real_eval.long_continuation_share(config, 6144) == pytest.approx(384 / 6144)


def test_shipped_adapters_carry_their_record():
    from kvbridge.experiments import eval as ev
    from kvbridge.experiments import eval_cross, testbed

    ab = kvbridge.LinearAdapter.load(ev.DEFAULT_ADAPTER)
    assert ab.serving["recompute_tail"] == testbed.BRIDGE_OPTIONS["recompute_tail"] == 96
    assert ab.serving["agreement_goal"] == testbed.SERVING_AGREEMENT_GOAL
    curve = {p["recompute_tail"]: p for p in ab.serving["measured"]}
    assert sorted(curve) == [0, 1, 4, 16, 32, 64, 96]
    # The recorded figures (benchmarks/recorded/120-quality-levers.md, Run 2).
    assert curve[96]["agreement"] == pytest.approx(0.9905, abs=5e-5)
    assert curve[64]["agreement"] < 0.99 <= curve[96]["agreement"]
    assert curve[0]["kept"] == pytest.approx(0.9898, abs=5e-5)
    assert curve[96]["prompt_tokens"] == 192
    assert curve[96]["computed_share"] == pytest.approx(97 / 192)
    ac = kvbridge.LinearAdapter.load(eval_cross.DEFAULT_CROSS_ADAPTER)
    assert ac.serving["recompute_tail"] == 0
    assert [p["recompute_tail"] for p in ac.serving["measured"]] == [0]
    assert ac.serving["measured"][0]["agreement"] == pytest.approx(0.851, abs=5e-4)


def test_shipped_adapter_default_reproduces_bridge_options():
    """A plain Bridge() serves the shipped adapter as Bridge(**testbed.BRIDGE_OPTIONS) does."""
    from kvbridge.experiments import eval as ev
    from kvbridge.experiments import testbed

    pair = testbed.load_pair()
    shipped = ev.load_adapter(ev.DEFAULT_ADAPTER, pair)
    loads = {}
    for name, options in (("default", {}), ("options", testbed.BRIDGE_OPTIONS),
                          ("zero", {"recompute_tail": 0})):
        bridge = kvbridge.Bridge(kvbridge.KVStore(64 << 20, chunk_tokens=16), **options)
        bridge.add_adapter(shipped)
        got = []
        for i, text in enumerate(testbed.texts("heldout")[:40]):
            ids = pair.tokenizer.encode(text)[:200]
            if len(ids) < 120:
                continue
            bridge.save(pair.source.spec, ids, hf.prefix_kv(pair.source.model, ids))
            got.append(bridge.load(pair.target.spec, ids))
        loads[name] = got
    assert len(loads["default"]) >= 3
    for d, o, z in zip(loads["default"], loads["options"], loads["zero"]):
        assert d.converted and d.recompute_tail == o.recompute_tail == 96
        assert d.tokens == o.tokens < z.tokens
        for (k, v), (k0, v0) in zip(d.kv, o.kv):
            assert torch.equal(k, k0) and torch.equal(v, v0)


def test_kvbridge_eval_saves_the_serving_record(tmp_path, monkeypatch):
    import tiny_testbed
    from kvbridge.experiments import eval as ev

    tiny_testbed.install(monkeypatch)
    path = tmp_path / "saved.safetensors"
    results = ev.main(["--out", str(tmp_path / "out"), "--train-windows", "8",
                       "--heldout-windows", "2", "--window-tokens", "40",
                       "--continuation-tokens", "8", "--ttft-lengths", "32", "--ttft-repeats",
                       "1", "--chunk-tokens", "8", "--variants", "rope_auto", "--quiet",
                       "--tail-tokens", "0", "4", "8", "--exact-layers", "0", "1",
                       "--agreement-goal", "0.5", "--save-adapter", str(path)])
    rows = {r["recompute_tail"]: r for r in results["levers"]["rows"] if r["exact_layers"] == 0}
    saved = kvbridge.LinearAdapter.load(path)
    record = saved.serving
    assert record == results["saved_adapter"]["serving"]
    assert record["agreement_goal"] == 0.5
    assert [p["recompute_tail"] for p in record["measured"]] == [0, 4, 8]  # exact_layers 0 only
    for p in record["measured"]:
        r = rows[p["recompute_tail"]]
        assert p["agreement"] == pytest.approx(r["agreement"])
        assert p["prompt_tokens"] == 32
        assert p["computed_share"] == pytest.approx((p["recompute_tail"] + 1) / 32)
    reached = [t for t in (0, 4, 8) if rows[t]["agreement"] >= 0.5]
    assert record["recompute_tail"] == (reached[0] if reached else 8)
    # A plain Bridge now serves it with that tail.
    bridge = kvbridge.Bridge(kvbridge.KVStore(1 << 20, chunk_tokens=8))
    assert bridge.recompute_tail_for(saved, 32) == record["recompute_tail"]
