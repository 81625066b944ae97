"""kvbridge.experiments.eval: the metric definitions on hand-computed cases and on a model's own
cache, the window packing, the stale-adapter check, and a short end-to-end run's results.json."""
import json
import math

import pytest
import torch

import kvbridge
from kvbridge import hf
from kvbridge.experiments import common
from kvbridge.experiments import eval as ev
import tiny_testbed


@pytest.fixture(scope="module")
def pair():
    return tiny_testbed.load_pair()


def test_sums_hand_computed():
    # vocab 3, two positions. softmax([ln2, 0, 0]) = [1/2, 1/4, 1/4]; uniform = 1/3 each.
    ln2 = math.log(2.0)
    own = torch.tensor([[ln2, 0.0, 0.0], [0.0, ln2, 0.0]], dtype=torch.float64)
    conv = torch.tensor([[0.0, ln2, 0.0], [0.0, ln2, 0.0]], dtype=torch.float64)
    none = torch.zeros(2, 3)
    targets = torch.tensor([0, 1])
    s = common.Sums()
    s.add(own, conv, none, targets)
    m = s.metrics()
    l_own = (math.log(2) + math.log(2)) / 2          # p = 1/2, 1/2
    l_conv = (math.log(4) + math.log(2)) / 2         # p = 1/4, 1/2
    l_none = math.log(3)
    assert m["tokens"] == 2
    assert m["loss_own"] == pytest.approx(l_own, abs=1e-12)
    assert m["loss_conv"] == pytest.approx(l_conv, abs=1e-12)
    assert m["loss_none"] == pytest.approx(l_none, abs=1e-12)
    assert m["kept"] == pytest.approx((l_none - l_conv) / (l_none - l_own), abs=1e-12)
    assert m["agreement"] == 0.5  # argmax 0 vs 1, then 1 vs 1


def test_sums_pool_tokens_not_windows():
    s = common.Sums()
    a = torch.tensor([[2.0, 0.0]])
    s.add(a, a, torch.zeros(1, 2), torch.tensor([0]))
    b = torch.tensor([[0.0, 2.0]] * 3)
    s.add(b, torch.zeros(3, 2), torch.zeros(3, 2), torch.tensor([1, 1, 1]))
    ce = lambda x, t: float(torch.nn.functional.cross_entropy(x.double(), t, reduction="sum"))
    assert s.metrics()["loss_conv"] == pytest.approx(
        (ce(a, torch.tensor([0])) + ce(torch.zeros(3, 2), torch.tensor([1, 1, 1]))) / 4)
    assert s.metrics()["agreement"] == pytest.approx(1 / 4)  # zeros argmax 0 != 1


def test_a_reference_scores_as_the_full_add():
    """Sums.add_scored against a window's Reference pools what Sums.add of the same logits does
    (seeded random logits, several variants per window, odd sizes); a converted variant of
    another shape is refused."""
    g = torch.Generator().manual_seed(3)
    by_add, by_reference = [common.Sums() for _ in range(3)], [common.Sums() for _ in range(3)]
    for c, vocab in ((5, 11), (1, 11), (7, 11)):
        none = torch.randn(c, vocab, generator=g)
        targets = torch.randint(vocab, (c,), generator=g)
        # The prompt helps: the own logits favour the targets (kept is finite).
        own = none + 3 * torch.nn.functional.one_hot(targets, vocab)
        reference = common.Reference.of(own, none, targets)
        for a, r in zip(by_add, by_reference):
            conv = own + torch.randn(c, vocab, generator=g)
            a.add(own, conv, none, targets)
            r.add_scored(reference, conv)
    for a, r in zip(by_add, by_reference):
        assert a.metrics() == r.metrics() and 0 < a.agree < a.tokens
        assert math.isfinite(a.metrics()["kept"])
    with pytest.raises(ValueError, match="do not match"):
        by_reference[0].add_scored(reference, torch.randn(7, 12, generator=g))


def test_kept_edges():
    assert common.kept(3.0, 3.0, 2.0) == 0.0
    assert common.kept(3.0, 2.0, 2.0) == 1.0
    assert common.kept(3.0, 2.5, 2.0) == 0.5
    assert math.isnan(common.kept(2.0, 2.0, 2.0))  # no benefit to keep
    with pytest.raises(ValueError):
        common.Sums().metrics()
    with pytest.raises(ValueError):
        common.Sums().add(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(1, 3),
                          torch.tensor([0]))


def test_own_cache_fed_back_keeps_everything(pair):
    windows = ev.text_windows(pair, "heldout", 40, 3, data=tiny_testbed)
    target = pair.target.model
    scores = ev.score_windows(target, windows, 10, pair.tokenizer.bos_id,
                              lambda ids: hf.prefix_kv(target, ids),
                              {"own": lambda kv: kv,
                               "perturbed": lambda kv: tuple((k + 0.5 * torch.randn_like(k), v)
                                                             for k, v in kv)})
    own = scores["own"]
    assert own["tokens"] == 30
    assert own["loss_conv"] == own["loss_own"]
    assert own["agreement"] == 1.0
    if own["loss_none"] > own["loss_own"]:
        assert own["kept"] == 1.0
    assert scores["perturbed"]["loss_conv"] != own["loss_own"]
    assert scores["perturbed"]["loss_none"] == own["loss_none"]


def test_prefix_then_rest_equals_full_forward(pair):
    ids = pair.tokenizer.encode("the cat sat on a mat.")
    full, _ = hf.forward(pair.target.model, ids)
    kv = hf.prefix_kv(pair.target.model, ids[:9])
    rest, _ = hf.forward(pair.target.model, ids[9:], kv)
    torch.testing.assert_close(rest, full[9:], atol=1e-5, rtol=1e-5)


def test_pack_windows():
    lists = [[9, 1, 2], [9, 3], [9, 4, 5, 6, 7], [9, 8]]
    assert ev.pack_windows(lists, 4) == [[9, 1, 2, 9], [9, 4, 5, 6]]
    assert ev.pack_windows(lists, 4, count=1) == [[9, 1, 2, 9]]
    assert ev.pack_windows(lists, 20) == []
    with pytest.raises(ValueError):
        ev.pack_windows(lists, 1)


def test_flop_projection_formula():
    (row,) = ev.flop_projection([1000], 2)
    s = ev.LLAMA3_8B
    n = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    head = 2 * 4096 * 128256
    assert row["prefill_flops"] == 2 * n * 1000 + 2 * 32 * 4096 * 1000 ** 2 + head
    assert row["convert_flops"] == 999 * 32 * 2 * (2 * 2 * 1024) * (2 * 1024)
    assert row["decode_flops"] == 2 * n + 4 * 32 * 4096 * 1000 + head
    assert row["ratio"] == row["prefill_flops"] / (row["convert_flops"] + row["decode_flops"])
    assert s["layers"] == 32
    assert ev.flop_projection([1000], 32)[0]["ratio"] < row["ratio"]


def test_stale_adapter_is_refused(pair, tmp_path):
    windows = ev.text_windows(pair, "train", 40, 6, data=tiny_testbed)
    adapter = ev.fit_variants(pair, windows, ["rope_auto"])["rope_auto"]
    path = tmp_path / "a.safetensors"
    adapter.save(path)
    assert ev.load_adapter(str(path), pair).source == pair.source.spec
    newer = tiny_testbed.load_pair(version="2")
    with pytest.raises(ev.StaleAdapterError, match="refit"):
        ev.load_adapter(str(path), newer)
    with pytest.raises(ev.StaleAdapterError):
        ev.evaluate(newer, ev.EvalConfig(), adapters={"x": adapter}, data=tiny_testbed)


def test_smoke_run_results(tmp_path, monkeypatch):
    tiny_testbed.install(monkeypatch)
    out = tmp_path / "out"
    results = ev.main(["--out", str(out), "--train-windows", "12", "--heldout-windows", "3",
                       "--window-tokens", "40", "--continuation-tokens", "8",
                       "--ttft-lengths", "32", "48", "--ttft-repeats", "2",
                       "--chunk-tokens", "8", "--quiet", "--save-adapter",
                       str(tmp_path / "saved.safetensors")])
    data = json.loads((out / "results.json").read_text())
    assert (out / "eval.png").stat().st_size > 0
    assert set(data["variants"]) == {"rope_auto", "rope_all", "naive"}
    assert data["windows"] == {"train": 12, "heldout": 3}
    assert data["config"]["max_context"] == tiny_testbed.MAX_CONTEXT
    for name, v in data["variants"].items():
        assert v["tokens"] == 3 * 8
        assert len(v["r2_key"]) == len(v["r2_value"]) == len(v["source_layers"]) == 3
        assert 0.0 <= v["agreement"] <= 1.0
        want = common.kept(v["loss_none"], v["loss_conv"], v["loss_own"])
        if math.isnan(want):
            assert v["kept"] is None
        else:
            assert v["kept"] == pytest.approx(want, rel=1e-12)
        assert v["quality"] == pytest.approx(min(v["r2_key"] + v["r2_value"]))
        assert v["rope_aware"] == (name != "naive")
    assert data["variants"]["rope_all"]["source_layers"] == [[0, 1]] * 3
    assert data["best_variant"] in data["variants"]
    rows = data["ttft"]["rows"]
    assert [r["prompt_tokens"] for r in rows] == [32, 48]
    for r in rows:
        assert r["loaded_tokens"] == r["prompt_tokens"] - 1 and r["converted"]
        assert r["ratio"] == pytest.approx(r["own_ms"] / r["bridge_ms"])
    assert data["ttft"]["rows"] == data["ttft"]["by_variant"][data["best_variant"]]
    assert set(data["ttft"]["by_variant"]) == set(data["variants"])
    assert set(data["projection"]["by_source_layers"]) >= {"1", "8", "32"}
    saved = kvbridge.LinearAdapter.load(str(tmp_path / "saved.safetensors"))
    assert saved.serving is None  # no tail lever measured (tiny_testbed has no BRIDGE_OPTIONS)
    assert saved.report["layers"][0]["source_layers"] == \
        data["variants"][data["best_variant"]]["source_layers"][0]
    assert results["best_variant"] == data["best_variant"]


def test_too_long_window_is_refused(pair):
    with pytest.raises(ValueError, match="MAX_CONTEXT"):
        ev.evaluate(pair, ev.EvalConfig(window_tokens=tiny_testbed.MAX_CONTEXT + 1),
                    data=tiny_testbed)


def test_cli_dispatch(capsys):
    from kvbridge import cli

    assert cli.main([]) == 2
    assert cli.main(["--help"]) == 0
    assert "eval" in capsys.readouterr().out
    for command in ("eval", "demo"):
        with pytest.raises(SystemExit) as exit_info:
            cli.main([command, "--help"])
        assert exit_info.value.code == 0
        assert f"kvbridge {command}" in capsys.readouterr().out
