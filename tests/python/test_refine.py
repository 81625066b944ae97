"""kvbridge.experiments.refine: the differentiable conversion against the float64 reference, and a
short seeded refinement on the tiny stand-in models (deterministic, never worse on validation, a
normal checksummed adapter file with a recomputed fit report)."""
import pytest
import torch

import kvbridge
from kvbridge.experiments import eval as ev
from kvbridge.experiments import refine
import tiny_testbed


@pytest.fixture(scope="module")
def pair():
    return tiny_testbed.load_pair()


@pytest.fixture(scope="module")
def fitted(pair, tmp_path_factory):
    windows = ev.text_windows(pair, "train", 40, 6, data=tiny_testbed)
    adapter = ev.fit_variants(pair, windows, ["rope_auto"])["rope_auto"]
    path = tmp_path_factory.mktemp("refine") / "a.safetensors"
    adapter.save(path)
    return adapter, str(path)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_torch_adapter_matches_the_reference(pair, fitted, dtype):
    adapter, path = fitted
    model = refine.TorchAdapter(adapter, path, dtype=dtype)
    g = torch.Generator().manual_seed(5)
    spec = pair.source.spec
    # Odd token count, strided tensors ([1, T, H, D + 3] storage viewed as [1, H, T, D]).
    src = tuple(tuple(torch.randn(1, 37, spec.num_kv_heads, spec.head_dim + 3, generator=g)
                      [..., : spec.head_dim].transpose(1, 2) for _ in range(2))
                for _ in range(spec.num_layers))
    ref = adapter.convert(src, start_pos=11, reference=True)
    with torch.no_grad():
        mine = model(src, start_pos=11)
    scale = max(float(t.abs().max()) for p in ref for t in p)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for (k, v), (rk, rv) in zip(mine, ref):
        assert float((k - rk).abs().max()) <= tol * scale + 1e-7  # ref is rounded to float32
        assert float((v - rv).abs().max()) <= tol * scale + 1e-7


def test_torch_adapter_uses_each_layers_rope(tmp_path):
    # Per-layer attention: TorchAdapter un-rotates and re-rotates every layer with its own base,
    # as the native convert does (the spec-wide bases rule no layer here).
    from conftest import random_kv
    la = kvbridge.LayerAttention
    src = kvbridge.ModelSpec("s", 3, 2, 8, rope_base=3000.0,
                             layer_attention=[la(1e4, sliding_window=8), la(1e4), la(1e6)])
    tgt = kvbridge.ModelSpec("t", 2, 1, 6, rope_style="interleaved", rope_base=7000.0,
                             layer_attention=[la(1e6), la(2e4, sliding_window=4)])
    fitter = kvbridge.AdapterFitter(src, tgt, source_layers=[[0, 2], [1, 2]])
    fitter.add(random_kv(src, 61, 1), random_kv(tgt, 61, 2))
    adapter = fitter.fit()
    path = str(tmp_path / "layered.safetensors")
    adapter.save(path)
    model = refine.TorchAdapter(adapter, path, dtype=torch.float64)
    x = random_kv(src, 19, 3, strided=True)
    ref = adapter.convert(x, start_pos=101, reference=True)
    with torch.no_grad():
        mine = model(x, start_pos=101)
    scale = max(float(t.abs().max()) for p in ref for t in p)
    for (k, v), (rk, rv) in zip(mine, ref):
        assert float((k - rk).abs().max()) <= 1e-6 * scale
        assert float((v - rv).abs().max()) <= 1e-6 * scale


def test_rope_inverse_round_trips(pair):
    x = torch.randn(2, 9, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for spec in (pair.source.spec, pair.target.spec):
        back = refine.rope(refine.rope(x, spec, 7), spec, 7, inverse=True)
        torch.testing.assert_close(back, x, atol=1e-12, rtol=0)
        assert not torch.allclose(refine.rope(x, spec, 7), x)


def test_refine_is_seeded_and_never_worse(pair, fitted, tmp_path):
    adapter, path = fitted
    config = refine.RefineConfig(train_windows=4, val_windows=2, window_tokens=40,
                                 continuation_tokens=8, epochs=2, patience=2, lr=1e-3,
                                 skip_windows=0)
    a = refine.refine(pair, adapter, path, str(tmp_path / "r1.safetensors"), config,
                      progress=False, data=tiny_testbed)
    b = refine.refine(pair, adapter, path, str(tmp_path / "r2.safetensors"), config,
                      progress=False, data=tiny_testbed)
    assert a.adapter.fingerprint == b.adapter.fingerprint  # same seed, same weights
    assert [h["val_kl"] for h in a.history] == [h["val_kl"] for h in b.history]
    assert len(a.history) == 3 and a.history[0]["epoch"] == 0
    best = min(h["val_kl"] for h in a.history)
    assert a.history[a.best_epoch]["val_kl"] == best <= a.history[0]["val_kl"]
    loaded = kvbridge.LinearAdapter.load(tmp_path / "r1.safetensors")  # checksummed
    assert loaded.fingerprint == a.adapter.fingerprint
    assert loaded.source == adapter.source and loaded.target == adapter.target
    report = loaded.report
    assert report["holdout_tokens"] == 2 * 40
    assert report["train_tokens"] == adapter.report["train_tokens"]
    for new, old in zip(report["layers"], adapter.report["layers"]):
        assert new["source_layers"] == old["source_layers"]
        assert new["ridge_key"] == old["ridge_key"]
        assert new["r2_key"] <= 1.0 and new["r2_value"] <= 1.0
    if a.best_epoch > 0:
        assert a.adapter.fingerprint != adapter.fingerprint
    with pytest.raises(ValueError, match="need"):
        refine.refine(pair, adapter, path, str(tmp_path / "x.safetensors"),
                      refine.RefineConfig(train_windows=500, window_tokens=40, skip_windows=0),
                      progress=False, data=tiny_testbed)


def test_refine_needs_the_adapters_own_file(pair, fitted, tmp_path):
    adapter, path = fitted
    other = ev.fit_variants(pair, ev.text_windows(pair, "train", 40, 3, data=tiny_testbed),
                            ["rope_all"])["rope_all"]
    other_path = tmp_path / "other.safetensors"
    other.save(other_path)
    with pytest.raises(ValueError, match="is not the adapter"):
        refine.TorchAdapter(adapter, str(other_path))
