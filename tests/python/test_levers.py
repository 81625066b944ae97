"""kvbridge eval's levers on the tiny stand-in models: exact layers over every layer are the
target's own cache (kept = agreement = 1), the lever rows of a short CLI run, and the default
grid."""
import json

import pytest

from kvbridge import hf
from kvbridge.experiments import eval as ev
import tiny_testbed


@pytest.fixture(scope="module")
def pair():
    return tiny_testbed.load_pair()


def test_every_layer_exact_is_the_own_cache(pair):
    windows = ev.text_windows(pair, "heldout", 40, 3, data=tiny_testbed)
    train = ev.text_windows(pair, "train", 40, 6, data=tiny_testbed)
    adapter = ev.fit_variants(pair, train, ["rope_auto"])["rope_auto"]
    layers = pair.target.spec.num_layers
    scores = ev.score_levers(pair.target.model, windows, 8, pair.tokenizer.bos_id,
                             lambda ids: hf.prefix_kv(pair.source.model, ids), adapter,
                             [(0, 0), (3, 0), (0, layers), (5, layers)])
    for tail in (0, 5):
        own = scores[ev.lever_name(tail, layers)]
        assert own["agreement"] == 1.0
        assert own["loss_conv"] == pytest.approx(own["loss_own"], abs=1e-5)
    conv = scores[ev.lever_name(0, 0)]
    assert conv["tokens"] == 24
    assert conv["loss_conv"] != pytest.approx(conv["loss_own"], abs=1e-5)
    assert scores[ev.lever_name(3, 0)]["loss_conv"] != conv["loss_conv"]
    with pytest.raises(ValueError, match="too short"):
        ev.score_levers(pair.target.model, windows, 8, pair.tokenizer.bos_id,
                        lambda ids: hf.prefix_kv(pair.source.model, ids), adapter, [(31, 0)])


def test_lever_grid():
    assert ev.lever_grid(ev.EvalConfig(tail_tokens=[0, 4], exact_layers=[1])) == [(0, 1), (4, 1)]
    assert ev.lever_grid(ev.EvalConfig(exact_layers=[2])) == [(0, 2)]
    assert ev.lever_grid(ev.EvalConfig(), data=tiny_testbed) == []  # it has no BRIDGE_OPTIONS
    from kvbridge.experiments import testbed

    r = testbed.BRIDGE_OPTIONS["recompute_tail"]
    assert ev.lever_grid(ev.EvalConfig()) == [(0, 0), (r, 0)]


def test_cli_lever_rows(tmp_path, monkeypatch, capsys):
    tiny_testbed.install(monkeypatch)
    out = tmp_path / "out"
    results = ev.main(["--out", str(out), "--train-windows", "8", "--heldout-windows", "2",
                       "--window-tokens", "40", "--continuation-tokens", "8",
                       "--ttft-lengths", "32", "--ttft-repeats", "1", "--chunk-tokens", "8",
                       "--variants", "rope_auto", "--quiet", "--tail-tokens", "0", "4",
                       "--exact-layers", "0", "1"])
    rows = results["levers"]["rows"]
    assert [(r["recompute_tail"], r["exact_layers"]) for r in rows] == [(0, 0), (0, 1), (4, 0),
                                                                        (4, 1)]
    for r in rows:
        assert r["tokens"] == 16 and len(r["ttft"]) == 1
        assert r["ttft"][0]["loaded_tokens"] == 31 - r["recompute_tail"]
    assert rows[0]["kept"] == pytest.approx(results["variants"]["rope_auto"]["kept"], abs=1e-9)
    saved = json.loads((out / "results.json").read_text())
    assert len(saved["levers"]["rows"]) == 4
    assert "| 4 | 1 |" in capsys.readouterr().out
