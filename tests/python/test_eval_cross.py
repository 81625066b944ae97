"""kvbridge.experiments.eval_cross: windows cut on text, alignment with the BOS fallback and the
naive ablation, the prefix/continuation split, the scoring plumbing (an exact cache gives kept = 1),
and a small run on the shipped testbed-a -> testbed-c pair."""
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import kvbridge  # noqa: E402
from kvbridge.experiments import common  # noqa: E402
from kvbridge.experiments import eval as ev  # noqa: E402
from kvbridge.experiments import eval_cross as xe  # noqa: E402
from kvbridge.experiments import testbed  # noqa: E402


def test_utf8_prefix_ends_on_a_character():
    text = "aé東🙂"  # 1 + 2 + 3 + 4 bytes
    assert [xe.utf8_prefix(text, n) for n in range(11)] == [
        "", "a", "a", "aé", "aé", "aé", "aé東", "aé東", "aé東", "aé東", "aé東🙂"]


def test_text_windows_are_long_fortunes_cut_on_text():
    windows = xe.text_windows("heldout", 200, 30)
    assert len(windows) == 30
    long = [t for t in testbed.texts("heldout") if len(t.encode("utf-8")) >= 200]
    assert windows == [xe.utf8_prefix(t, 200) for t in long[:30]]
    assert all(197 <= len(w.encode("utf-8")) <= 200 for w in windows)


def enc(offsets, roles=None):
    roles = roles or [None] * len(offsets)
    return xe.Encoded(list(range(len(offsets))), list(offsets), list(roles))


def test_alignment_fills_unserved_tokens_with_the_source_bos_and_counts_them():
    # source: BOS, then tokens of 3 and 2 bytes ("abc", "de"); target: BOS, then bytes.
    source = enc([(0, 0), (0, 3), (3, 5)], ["bos", None, None])
    target = enc([(0, 0)] + [(i, i + 1) for i in range(5)], ["bos"] + [None] * 5)
    index, missing = xe.alignment("seen", source, target)
    assert index.dtype == np.int64
    # bytes a, b end before the first source token does: nothing the source has seen serves
    # them but its BOS; c is served by "abc", d by "abc" (seen), e by "de".
    assert index.tolist() == [0, 0, 0, 1, 1, 2] and missing == 2
    index, missing = xe.alignment("covering", source, target)
    assert index.tolist() == [0, 1, 1, 1, 2, 2] and missing == 0
    index, missing = xe.alignment(xe.NAIVE, source, target)
    assert index.tolist() == [0, 1, 2, 2, 2, 2] and missing == 0
    no_bos = enc([(0, 3), (3, 5)])
    with pytest.raises(ValueError, match="no BOS"):
        xe.alignment("seen", no_bos, enc([(i, i + 1) for i in range(5)]))


def test_split_window_prefix_is_the_text_of_the_cached_tokens():
    tok = testbed.load_tokenizer("testbed-c")
    for text in xe.text_windows("heldout", 255, 20) + ["naïve café 東京 " * 12]:
        split = xe.split_window(tok, text, 0.25)
        assert split is not None
        t, p = split.target, split.p
        raw = text.encode("utf-8")
        cut = round(0.75 * len(raw))
        first = next(j for j, ((s, _), r) in enumerate(zip(t.offsets, t.roles))
                     if r is None and s >= cut)
        assert 2 <= p <= first and first - p <= 1  # moved back only off a cut character
        assert split.prefix_text.encode("utf-8") == raw[:t.offsets[p - 2][1]]
        assert t.ids == tok.encode(text)
    assert xe.split_window(tok, "hi", 0.25) is None


class _Gather:
    """A stand-in adapter for a pair of one tokenizer: output token j is source token a(j)."""

    def convert(self, kv, alignment=None):
        idx = torch.as_tensor(alignment)
        return tuple((k[:, :, idx], v[:, :, idx]) for k, v in kv)


def test_exact_cache_through_the_cross_path_keeps_everything():
    a = testbed.load_model("testbed-a")
    pair = SimpleNamespace(source=a, target=a, tokenizer=None)
    texts = xe.text_windows("heldout", 120, 3)
    scores = xe.score_cross(pair, texts, 0.25, {"seen": _Gather(), xe.NAIVE: _Gather()})
    for s in scores.values():
        assert s["windows"] == 3 and s["unaligned_prefix_tokens"] == 0
        assert s["loss_conv"] == pytest.approx(s["loss_own"], abs=1e-6)
        assert s["kept"] == pytest.approx(1.0, abs=1e-5) and s["agreement"] == 1.0
        assert s["loss_none"] > s["loss_own"]


@pytest.fixture(scope="module")
def a_to_c():
    return testbed.load_pair("testbed-a", "testbed-c")


def test_small_run_a_to_c(a_to_c, tmp_path):
    config = xe.CrossConfig(window_bytes=160, train_windows=16, heldout_windows=4,
                            ttft_bytes=[40, 160], ttft_repeats=1)
    results, adapters = xe.evaluate_cross(a_to_c, config)
    assert set(results["variants"]) == set(xe.policies()) == set(adapters)
    assert results["windows"] == {"train": 16, "heldout": 4}
    assert results["models"]["source"]["tokenizer"] != results["models"]["target"]["tokenizer"]
    for name, v in results["variants"].items():
        assert v["alignment"] == name and v["windows"] == 4
        assert v["alignment_policy"] == ("" if name == xe.NAIVE else name)
        assert 0.0 <= v["agreement"] <= 1.0 and v["tokens"] > 4
        assert len(v["r2_key"]) == a_to_c.target.spec.num_layers
        want = common.kept(v["loss_none"], v["loss_conv"], v["loss_own"])
        assert math.isnan(want) and math.isnan(v["kept"]) or v["kept"] == pytest.approx(want)
        # a byte-level source ends a token at every byte: nothing is left unserved
        assert v["unaligned_prefix_tokens"] == 0 and v["fit_unaligned_target_tokens"] == 0
    assert results["best_variant"] in results["variants"]
    rows = results["ttft"]["by_variant"][results["best_variant"]]
    assert [r["prompt_bytes"] for r in rows] == [40, 160]
    assert all(r["ratio"] == pytest.approx(r["own_ms"] / r["converted_ms"]) for r in rows)
    table = xe.format_table(results)
    assert "| seen |" in table and "| naive |" in table
    paths = common.write_results(results, str(tmp_path))
    assert json.loads(open(paths["json"]).read())["best_variant"] == results["best_variant"]


def test_eval_command_hands_cross_pairs_over(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(xe, "main", lambda argv: seen.setdefault("argv", argv))
    argv = ["--source", "testbed-a", "--target", "testbed-c", "--out", str(tmp_path)]
    ev.main(argv)
    assert seen["argv"] == argv
    with pytest.raises(SystemExit, match="unknown model"):
        ev.main(["--target", "testbed-z"])


def test_shipped_a_to_c_adapter_fits_the_shipped_weights(a_to_c):
    # Fails whenever testbed-a or testbed-c change without a refit of the shipped adapter
    # (the command in kvbridge.experiments.eval_cross.DEFAULT_CROSS_ADAPTER's comment).
    adapter = ev.load_adapter(xe.DEFAULT_CROSS_ADAPTER, a_to_c)
    assert adapter.report["alignment_policy"] in kvbridge.ALIGN_POLICIES
    assert adapter.source.tokenizer == a_to_c.source.tokenizer.id
    assert adapter.target.tokenizer == a_to_c.target.tokenizer.id
    assert kvbridge.Bridge.quality(adapter) > 0.4
    # On a few held-out windows it keeps most of the prefix's benefit.
    texts = xe.text_windows("heldout", 255, 8)
    name = adapter.report["alignment_policy"]
    scores = xe.score_cross(a_to_c, texts, 0.25, {name: adapter})
    assert scores[name]["kept"] > 0.8 and scores[name]["agreement"] > 0.7


def test_main_saves_the_best_policy_never_naive(tmp_path, capsys):
    path = tmp_path / "new" / "a_to_c.safetensors"
    results = xe.main(["--source", "testbed-a", "--target", "testbed-c", "--out",
                       str(tmp_path / "out"), "--window-bytes", "120", "--train-windows", "8",
                       "--heldout-windows", "2", "--ttft-bytes", "32", "--ttft-repeats", "1",
                       "--policies", "covering", "naive", "--quiet", "--save-adapter", str(path)])
    saved = kvbridge.LinearAdapter.load(str(path))
    assert results["saved_adapter"]["variant"] == "covering"
    assert saved.report["alignment_policy"] == "covering"
    assert "| covering |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="share a tokenizer"):
        xe.main(["--source", "testbed-a", "--target", "testbed-b"])
