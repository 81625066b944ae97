"""Adapters through the Python API: planted maps through RoPE, convert vs the float64 path."""
import inspect
import math
import os
import subprocess
import sys

import pytest
import torch

import kvbridge
from conftest import random_kv


def rope(x, base, start_pos, style, inverse=False):
    """Independent RoPE in torch (float64): x [1, heads, tokens, dim]."""
    dim = x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    pos = torch.arange(start_pos, start_pos + x.shape[2], dtype=torch.float64)
    ang = pos[:, None] * inv[None, :]
    cos, sin = ang.cos(), ang.sin() * (-1 if inverse else 1)
    x = x.double()
    if style == "half":
        a, b = x[..., : dim // 2], x[..., dim // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)


SRC = kvbridge.ModelSpec("src", 2, 2, 8, rope_base=10000.0, rope_style="half")
TGT = kvbridge.ModelSpec("tgt", 3, 3, 4, rope_base=50000.0, rope_style="interleaved")


def planted_sample(weights, tokens, start_pos, seed, index=None):
    """Source KV of `tokens` tokens and the target KV of the planted map, token j from source
    token j, or with `index` (an alignment) from source token index[j] (-1: any token; a fit
    must skip those), len(index) target tokens then."""
    g = torch.Generator().manual_seed(seed)
    free = [(torch.randn(1, 2, tokens, 8, generator=g, dtype=torch.float64),
             torch.randn(1, 2, tokens, 8, generator=g, dtype=torch.float64)) for _ in range(2)]
    x = torch.cat([t.transpose(1, 2).reshape(tokens, 16) for pair in free for t in pair], dim=1)
    if index is not None:
        x = x[torch.as_tensor(index).clamp(min=0)]
    n = x.shape[0]
    target = []
    for w_k, b_k, w_v, b_v in weights:
        k = (x @ w_k + b_k).reshape(1, n, 3, 4).transpose(1, 2)
        v = (x @ w_v + b_v).reshape(1, n, 3, 4).transpose(1, 2)
        target.append((rope(k, 50000.0, start_pos, "interleaved").float(), v.float()))
    source = [(rope(k, 10000.0, start_pos, "half").float(), v.float()) for k, v in free]
    return tuple(source), tuple(target)


def planted_weights(seed):
    """Seeded planted-map weights for SRC -> TGT: per target layer (w_k, b_k, w_v, b_v)."""
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(*shape, generator=g, dtype=torch.float64) * 0.3
                  for shape in ((64, 12), (12,), (64, 12), (12,))) for _ in range(3)]


@pytest.fixture(scope="module")
def weights():
    return planted_weights(7)


@pytest.mark.parametrize("source_layers", ["auto", "all", [[0, 1], [0, 1], [0, 1]]])
def test_fit_recovers_planted_map_through_rope(weights, source_layers):
    fitter = kvbridge.AdapterFitter(SRC, TGT, source_layers=source_layers)
    for i in range(5):
        src, tgt = planted_sample(weights, 89, 7 + 150 * i, seed=i)
        fitter.add(src, tgt, start_pos=7 + 150 * i)
    adapter = fitter.fit()
    report = adapter.report
    assert report["holdout_tokens"] > 0 and report["train_tokens"] > report["holdout_tokens"]
    for layer in report["layers"]:
        assert layer["r2_key"] > 0.9999 and layer["r2_value"] > 0.9999
        assert layer["source_layers"] == [0, 1]
    src, tgt = planted_sample(weights, 23, 3000, seed=99)  # held out, new positions
    out = adapter.convert(src, start_pos=3000)
    for (k, v), (k0, v0) in zip(out, tgt):
        assert k.shape == k0.shape and k.dtype == torch.float32
        assert torch.allclose(k, k0, atol=2e-3, rtol=1e-3)
        assert torch.allclose(v, v0, atol=2e-3, rtol=1e-3)


def test_auto_fit_reports_progress_and_its_selection(weights, tmp_path):
    fitter = kvbridge.AdapterFitter(SRC, TGT, source_layers="auto", exact_candidates=2)
    for i in range(5):
        src, tgt = planted_sample(weights, 89, 7 + 150 * i, seed=i)
        fitter.add(src, tgt, start_pos=7 + 150 * i)
    calls = []
    adapter = fitter.fit(progress=lambda *a: calls.append(a))
    assert calls
    done = [c[0] for c in calls]
    assert done == sorted(done) and all(c[0] <= c[1] + 1e-12 for c in calls)
    assert calls[-1][0] == pytest.approx(calls[-1][1])  # stopped early: its plan shrank to done
    assert {c[2] for c in calls} >= {0, 1, 2} and all(-1 <= c[2] < 3 for c in calls)
    for layer in adapter.report["layers"]:
        steps = layer["selection"]
        taken = [s["source_layer"] for s in steps if s["accepted"]]
        assert sorted(taken) == layer["source_layers"] == [0, 1]
        # Taken in turn, each with the exact held-out R² of the set so far; the last is the set's.
        last = [s for s in steps if s["accepted"]][-1]
        assert (last["r2_key"], last["r2_value"]) == (layer["r2_key"], layer["r2_value"])
        assert all(s["screen"] <= 1 and s["r2_key"] <= 1 for s in steps)
    # The steps survive a save and load.
    path = tmp_path / "auto.safetensors"
    adapter.save(path)
    assert kvbridge.LinearAdapter.load(path).report == adapter.report
    # A tqdm bar, and a callback that raises stops fit().
    assert fitter.fit(progress=True).report == adapter.report

    def stop(*_):
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        fitter.fit(progress=stop)
    with pytest.raises(kvbridge.InvalidArgumentError):
        kvbridge.AdapterFitter(SRC, TGT, exact_candidates=0)


def test_naive_fit_fails_on_rotated_keys(weights):
    fitter = kvbridge.AdapterFitter(SRC, TGT, source_layers="all", rope_aware=False)
    for i in range(5):
        src, tgt = planted_sample(weights, 89, 7 + 150 * i, seed=i)
        fitter.add(src, tgt, start_pos=7 + 150 * i)
    assert all(l["r2_key"] < 0.9 for l in fitter.fit().report["layers"])


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("bfloat16", 2e-2), ("float16", 4e-3)])
def test_convert_matches_float64_path(dtype, tol):
    src_spec = kvbridge.ModelSpec("s", 3, 3, 10, dtype=dtype, rope_base=20000.0)
    tgt_spec = kvbridge.ModelSpec("t", 2, 1, 6, dtype=dtype, rope_style="interleaved",
                                  rope_scaling=kvbridge.RopeScaling("llama3", 8.0, 1.0, 4.0, 64))
    fitter = kvbridge.AdapterFitter(src_spec, tgt_spec, source_layers=[[0, 2], [1]])
    fitter.add(random_kv(src_spec, 203, 1), random_kv(tgt_spec, 203, 2))
    adapter = fitter.fit()
    src = random_kv(src_spec, 41, 3, strided=True)
    fast = adapter.convert(src, start_pos=517)
    ref = adapter.convert(src, start_pos=517, reference=True)
    for (k, v), (k0, v0) in zip(fast, ref):
        assert k.dtype == getattr(torch, dtype) and k.shape == (1, 1, 41, 6)
        for a, b in ((k, k0), (v, v0)):
            scale = b.float().abs().max().item()
            assert scale > 0
            assert (a.float() - b.float()).abs().max().item() <= tol * scale


def test_cpu_convert_kernel_names_the_path_and_the_isa_cap_lowers_it():
    bf16_kernels = {"amx-bf16", "avx512-bf16"}
    kernels = bf16_kernels | {"avx512", "avx2", "generic"}
    assert kvbridge.cpu_convert_kernel("bfloat16") in kernels
    assert kvbridge.cpu_convert_kernel("float32") in kernels - bf16_kernels
    assert kvbridge.cpu_convert_kernel("float16") == kvbridge.cpu_convert_kernel("float32")
    with pytest.raises(kvbridge.InvalidArgumentError):
        kvbridge.cpu_convert_kernel("int8")
    # The cap is read once per process, so a child process shows it.
    code = "import kvbridge; print(kvbridge.cpu_convert_kernel('bfloat16'))"
    def capped(cap):
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True, env={**os.environ, "KVBRIDGE_CPU_ISA": cap}
                              ).stdout.strip()
    assert capped("generic") == "generic"
    # "avx512bf16" allows the AVX512-BF16 kernel but not AMX; "avx512" keeps float32 GEMMs.
    assert capped("avx512bf16") in {"avx512-bf16", "avx512", "avx2", "generic"}
    assert capped("avx512") in kernels - bf16_kernels


def test_fit_helper_with_callables(weights):
    samples = {i: planted_sample(weights, 60, 0, seed=i) for i in range(4)}
    adapter = kvbridge.fit_adapter(SRC, TGT, lambda i: samples[i][0], lambda i: samples[i][1],
                                   range(4), progress=False, source_layers="all")
    assert min(l["r2_value"] for l in adapter.report["layers"]) > 0.9999


def test_bad_input():
    fitter = kvbridge.AdapterFitter(SRC, TGT)
    with pytest.raises(ValueError, match="held-out"):
        fitter.fit()
    src, tgt = random_kv(SRC, 10, 1), random_kv(TGT, 10, 2)
    with pytest.raises(ValueError, match="layers"):
        fitter.add(tgt, src)
    with pytest.raises(ValueError, match="tokens"):
        fitter.add(src, random_kv(TGT, 9, 2))
    bad = list(src)
    bad[1] = (bad[1][0].clone(), bad[1][1].clone())
    bad[1][1][0, 0, 3, 2] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        fitter.add(tuple(bad), tgt)
    assert fitter.train_tokens + fitter.holdout_tokens == 0
    with pytest.raises(ValueError, match="source_layers"):
        kvbridge.AdapterFitter(SRC, TGT, source_layers=[[0]])
    with pytest.raises(ValueError, match="source_layers"):
        kvbridge.AdapterFitter(SRC, TGT, source_layers="some")
    fitter.add(src, tgt)
    fitter.add(random_kv(SRC, 40, 3), random_kv(TGT, 40, 4))
    adapter = fitter.fit()
    with pytest.raises(ValueError, match="layers"):
        adapter.convert(tgt)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_convert_keeps_device():
    fitter = kvbridge.AdapterFitter(SRC, TGT, source_layers="all")
    fitter.add(random_kv(SRC, 50, 1), random_kv(TGT, 50, 2))
    out = fitter.fit().convert(tuple((k.cuda(), v.cuda()) for k, v in random_kv(SRC, 5, 3)))
    assert out[0][0].device.type == "cuda"


@pytest.fixture
def fitted(weights):
    fitter = kvbridge.AdapterFitter(SRC, TGT, source_layers=[[0], [0, 1], [1]])
    for i in range(3):
        src, tgt = planted_sample(weights, 70, 11 * i, seed=20 + i)
        fitter.add(src, tgt, start_pos=11 * i)
    return fitter.fit()


def test_save_load_round_trip(fitted, tmp_path):
    path = tmp_path / "a.safetensors"
    fitted.save(path)
    loaded = kvbridge.LinearAdapter.load(path)
    assert loaded.source == SRC and loaded.target == TGT
    assert loaded.report == fitted.report
    src = random_kv(SRC, 9, 5)
    for (k, v), (k0, v0) in zip(loaded.convert(src, 4), fitted.convert(src, 4)):
        assert torch.equal(k, k0) and torch.equal(v, v0)


def test_file_is_plain_safetensors(fitted, tmp_path):
    import json
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = tmp_path / "a.safetensors"
    fitted.save(path)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    assert meta["format"] == "kvbridge.adapter" and meta["format_version"] == "2"
    assert json.loads(meta["layer_map"]) == [[0], [0, 1], [1]]
    assert json.loads(meta["source_spec"])["fingerprint"] == SRC.fingerprint
    assert tensors["layers.1.key.weight"].shape == (64, 12)
    assert tensors["layers.2.value.bias"].shape == (12,)
    # A file the safetensors package writes from the same content loads and converts the same.
    other = tmp_path / "b.safetensors"
    save_file(tensors, str(other), metadata=meta)
    src = random_kv(SRC, 6, 1)
    got = kvbridge.LinearAdapter.load(other).convert(src)
    want = fitted.convert(src)
    assert all(torch.equal(a, b) for pa, pb in zip(got, want) for a, b in zip(pa, pb))

    # Validation: wrong version, bad JSON, missing and mis-shaped tensors are CorruptError (with
    # a checksum that matches the edit, so each check is reached).
    def rewrite(mutate_meta=None, mutate_tensors=None):
        m, t = dict(meta), dict(tensors)
        if mutate_meta:
            mutate_meta(m)
        if mutate_tensors:
            mutate_tensors(t)
        m["checksum"] = adapter_checksum(m, t)
        p = tmp_path / "bad.safetensors"
        save_file(t, str(p), metadata=m)
        return p

    cases = [
        (lambda m: m.update(format_version="4"), None, "format_version"),
        (lambda m: m.update(alignment_policy="seen"), None, "alignment_policy"),
        (lambda m: m.update(source_spec="{not json"), None, "source_spec"),
        (lambda m: m.pop("layer_map"), None, "layer_map"),
        (lambda m: m.update(layer_map="[[0], [0, 1], [7]]"), None, "layer_map"),
        (None, lambda t: t.pop("layers.0.key.bias"), "missing"),
        (None, lambda t: t.update({"layers.0.key.bias": torch.zeros(5)}), "shape"),
        (None, lambda t: t.update({"layers.0.key.bias": torch.zeros(12, dtype=torch.float64)}), "F32"),
        (None, lambda t: t.update({"extra": torch.zeros(1)}), "does not use"),
    ]
    for mm, mt, needle in cases:
        with pytest.raises(kvbridge.CorruptError, match=needle):
            kvbridge.LinearAdapter.load(rewrite(mm, mt))
    raw = path.read_bytes()
    (tmp_path / "trunc.safetensors").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(kvbridge.CorruptError):
        kvbridge.LinearAdapter.load(tmp_path / "trunc.safetensors")
    with pytest.raises(kvbridge.NotFoundError):
        kvbridge.LinearAdapter.load(tmp_path / "absent.safetensors")


def test_two_pass_fit_within_a_memory_budget(weights):
    # All-layer accumulators for SRC -> TGT take 125,152 bytes, the probe pass 108,768.
    samples = {i: planted_sample(weights, 60, 0, seed=i) for i in range(4)}
    fitter = kvbridge.AdapterFitter(SRC, TGT, max_memory_bytes=115_000)
    assert (fitter.passes, fitter.pass_index, fitter.memory_bytes) == (2, 0, 108_768)
    for i in range(4):
        fitter.add(*samples[i])
    with pytest.raises(ValueError, match="probe pass"):
        fitter.fit()
    fitter.next_pass()
    assert fitter.pass_index == 1 and fitter.train_tokens == 0
    assert fitter.memory_bytes <= 115_000
    candidates = fitter.candidate_layers()
    assert len(candidates) == 3 and all(c and set(c) <= {0, 1} for c in candidates)
    assert sum(len(c) for c in candidates) < 6  # the budget cannot hold both layers everywhere
    for i in range(4):
        fitter.add(*samples[i])
    manual = fitter.fit().report

    adapter = kvbridge.fit_adapter(SRC, TGT, lambda i: samples[i][0], lambda i: samples[i][1],
                                   list(range(4)), progress=False, max_memory_bytes=115_000)
    assert adapter.report == manual  # the helper runs the same two passes
    with pytest.raises(ValueError, match="re-iterable"):
        kvbridge.fit_adapter(SRC, TGT, lambda i: samples[i][0], lambda i: samples[i][1],
                             iter(range(4)), progress=False, max_memory_bytes=115_000)
    one_pass = kvbridge.AdapterFitter(SRC, TGT, max_memory_bytes=125_152)
    assert one_pass.passes == 1
    with pytest.raises(ValueError, match="single pass"):
        one_pass.next_pass()


def adapter_checksum(meta, tensors):
    """The adapter file checksum as docs/adapter_file.md defines it (an independent copy)."""
    import struct

    import xxhash

    def field(b):
        return struct.pack("<Q", len(b)) + b

    h = xxhash.xxh3_128()
    h.update(b"kvbridge.adapter.checksum")
    for key in sorted(meta):
        if key != "checksum":
            h.update(field(key.encode()) + field(meta[key].encode()))
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(field(name.encode()) + struct.pack("<Q", t.dim())
                 + struct.pack(f"<{t.dim()}Q", *t.shape) + field(t.numpy().tobytes()))
    return h.hexdigest()


def read_adapter_file(path):
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata()), {name: f.get_tensor(name) for name in f.keys()}


def test_every_bit_flip_is_corrupt(fitted, tmp_path):
    import random

    path = tmp_path / "a.safetensors"
    fitted.save(path)
    raw = bytearray(path.read_bytes())
    rng = random.Random(16)
    bad = tmp_path / "flip.safetensors"
    for _ in range(200):
        bit = rng.randrange(8 * len(raw))
        flipped = bytearray(raw)
        flipped[bit // 8] ^= 1 << (bit % 8)
        bad.write_bytes(bytes(flipped))
        with pytest.raises(kvbridge.CorruptError):
            kvbridge.LinearAdapter.load(bad)
    assert kvbridge.LinearAdapter.load(path).fingerprint == fitted.fingerprint


def test_checksum_binds_content_and_the_ordered_pair(fitted, tmp_path):
    import json

    from safetensors.torch import save_file

    path = tmp_path / "a.safetensors"
    fitted.save(path)
    meta, tensors = read_adapter_file(path)
    assert meta["format_version"] == "2"
    assert meta["checksum"] == adapter_checksum(meta, tensors) == fitted.fingerprint

    def write(m, t, name="b.safetensors"):
        p = tmp_path / name
        save_file(t, str(p), metadata=m)
        return p

    # Rewritten by the safetensors package with the same content: still valid.
    assert kvbridge.LinearAdapter.load(write(meta, tensors)).fingerprint == fitted.fingerprint

    # A report out of range is refused even when the checksum matches it.
    def resigned(mutate):
        m = dict(meta)
        mutate(m)
        m["checksum"] = adapter_checksum(m, tensors)
        return write(m, tensors)

    def report_edit(**changes):
        def mutate(m):
            fit = json.loads(m["fit_report"])
            for key, value in changes.items():
                if key in ("train_tokens", "holdout_tokens"):
                    fit[key] = value
                else:
                    fit["layers"][1][key] = value
            # JSON has no NaN or infinity: 1e999 overflows (refused as not JSON), null is not
            # a number.
            m["fit_report"] = json.dumps(fit).replace("12345.5", "1e999")
        return mutate

    for change, needle in [({"r2_key": 1.5}, "r2_key"), ({"r2_value": None}, "r2_value"),
                           ({"r2_key": -12345.5}, "fit_report.*overflow"),
                           ({"ridge_key": -1.0}, "ridge_key"),
                           ({"ridge_value": 12345.5}, "fit_report.*overflow"),
                           ({"train_tokens": -5}, "train_tokens"),
                           ({"holdout_tokens": -1}, "holdout_tokens"),
                           ({"train_tokens": 2.5}, "train_tokens")]:
        with pytest.raises(kvbridge.CorruptError, match=needle):
            kvbridge.LinearAdapter.load(resigned(report_edit(**change)))
    # An edited R² (the quality gate's input) without a new checksum is refused.
    m = dict(meta)
    report_edit(r2_key=0.999)(m)
    with pytest.raises(kvbridge.CorruptError, match="checksum"):
        kvbridge.LinearAdapter.load(write(m, tensors))

    # Source and target swapped: refused even when the geometry would allow it.
    a = kvbridge.ModelSpec("model-a", 1, 1, 4, tokenizer="t")
    b = kvbridge.ModelSpec("model-b", 1, 1, 4, tokenizer="t")
    fitter = kvbridge.AdapterFitter(a, b, source_layers="all", ridge=0.1)
    fitter.add(random_kv(a, 40, 1), random_kv(b, 40, 2))
    square = tmp_path / "square.safetensors"
    fitter.fit().save(square)
    m, t = read_adapter_file(square)
    m["source_spec"], m["target_spec"] = m["target_spec"], m["source_spec"]
    with pytest.raises(kvbridge.CorruptError, match="checksum"):
        kvbridge.LinearAdapter.load(write(m, t, "swapped.safetensors"))


def test_files_without_a_checksum_need_an_explicit_opt_in(fitted, tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "a.safetensors"
    fitted.save(path)
    meta, tensors = read_adapter_file(path)
    del meta["checksum"]
    for version in ("1", "2"):  # format 1 had no checksum; a writer may also have dropped it
        meta["format_version"] = version
        other = tmp_path / f"unchecked-{version}.safetensors"
        save_file(tensors, str(other), metadata=meta)
        with pytest.raises(kvbridge.CorruptError, match="allow_unchecked"):
            kvbridge.LinearAdapter.load(other)
        loaded = kvbridge.LinearAdapter.load(other, allow_unchecked=True)
        assert loaded.report == fitted.report and loaded.fingerprint == fitted.fingerprint
        src = random_kv(SRC, 6, 1)
        for (k, v), (k0, v0) in zip(loaded.convert(src), fitted.convert(src)):
            assert torch.equal(k, k0) and torch.equal(v, v0)
        loaded.save(tmp_path / "resaved.safetensors")  # saving adds the checksum
        assert kvbridge.LinearAdapter.load(tmp_path / "resaved.safetensors").fingerprint == \
            fitted.fingerprint
    # The opt-in skips only the missing checksum: a wrong one is still refused.
    meta["checksum"] = "0" * 32
    save_file(tensors, str(tmp_path / "wrong.safetensors"), metadata=meta)
    with pytest.raises(kvbridge.CorruptError, match="checksum"):
        kvbridge.LinearAdapter.load(tmp_path / "wrong.safetensors", allow_unchecked=True)


def test_special_files_are_refused_before_reading(tmp_path):
    with pytest.raises(kvbridge.CorruptError, match="regular file"):
        kvbridge.LinearAdapter.load("/dev/zero")
    with pytest.raises(kvbridge.CorruptError, match="regular file"):
        kvbridge.LinearAdapter.load(tmp_path)
    with pytest.raises(kvbridge.InvalidArgumentError, match="NUL"):
        kvbridge.LinearAdapter.load(str(tmp_path / "a") + "\0x")


def key_norm_gains(seed):
    """Gains for TGT's layers, of either sign, one of them 0 per layer."""
    g = torch.Generator().manual_seed(seed)
    gains = (0.3 + 2.7 * torch.rand(TGT.num_layers, TGT.head_dim, generator=g)) * \
        torch.where(torch.rand(TGT.num_layers, TGT.head_dim, generator=g) < 0.25, -1.0, 1.0)
    gains[torch.arange(TGT.num_layers), torch.randint(TGT.head_dim, (TGT.num_layers,),
                                                      generator=g)] = 0.0
    return gains


def test_key_norm_puts_converted_keys_on_the_targets_set(weights, tmp_path):
    """With the target's key norm the maps are the same, and each converted key head,
    un-rotated, is the plain map's with its zero-gain dimensions 0 and the rest scaled to mean
    (k / g)² = 1; values are untouched. The file keeps the gains, and the fingerprint covers
    them."""
    gains = key_norm_gains(3)

    def fit(**kw):
        fitter = kvbridge.AdapterFitter(SRC, TGT, source_layers=[[0], [0, 1], [1]], **kw)
        for i in range(3):
            src, tgt = planted_sample(weights, 70, 11 * i, seed=20 + i)
            fitter.add(src, tgt, start_pos=11 * i)
        return fitter.fit()

    plain, normed = fit(), fit(target_key_norm=gains)
    assert plain.key_norm is None and torch.equal(normed.key_norm, gains)
    assert plain.fingerprint != normed.fingerprint
    src = random_kv(SRC, 23, 8)
    a = plain.convert(src, 5, reference=True)
    b = normed.convert(src, 5, reference=True)
    for j, ((ka, va), (kb, vb)) in enumerate(zip(a, b)):
        assert torch.equal(va, vb)
        ua, ub = rope(ka, 50000.0, 5, "interleaved", True), rope(kb, 50000.0, 5, "interleaved", True)
        g = gains[j].double()
        on = g != 0
        scale = torch.sqrt(on.sum() / ((ua[..., on] / g[on]) ** 2).sum(-1, keepdim=True))
        expected = torch.where(on, ua * scale, torch.zeros_like(ua))
        assert torch.allclose(ub, expected, rtol=1e-5, atol=1e-6)
        assert torch.allclose(((ub[..., on] / g[on]) ** 2).mean(-1), torch.ones(1, dtype=ub.dtype),
                              atol=1e-4)
    path = tmp_path / "normed.safetensors"
    normed.save(path)
    loaded = kvbridge.LinearAdapter.load(path)
    assert torch.equal(loaded.key_norm, gains) and loaded.fingerprint == normed.fingerprint
    for (k, v), (k0, v0) in zip(loaded.convert(src, 5), normed.convert(src, 5)):
        assert torch.equal(k, k0) and torch.equal(v, v0)

    # A file with the gains of some layers only is refused, whatever its checksum says.
    from safetensors.torch import save_file
    meta, tensors = read_adapter_file(path)
    del tensors["layers.1.key_norm"]
    del meta["checksum"]
    save_file(tensors, str(tmp_path / "partial.safetensors"), metadata=meta)
    with pytest.raises(kvbridge.CorruptError, match="key_norm"):
        kvbridge.LinearAdapter.load(tmp_path / "partial.safetensors", allow_unchecked=True)
    # And bad gains are refused when the fitter is made.
    not_finite = gains.clone()
    not_finite[1, 3] = float("inf")
    for bad in (gains[:2], gains[:, :3], not_finite):
        with pytest.raises(kvbridge.InvalidArgumentError, match="target_key_norm"):
            kvbridge.AdapterFitter(SRC, TGT, target_key_norm=bad)
    with pytest.raises(kvbridge.InvalidArgumentError, match="2-D"):
        kvbridge.AdapterFitter(SRC, TGT, target_key_norm=gains[0])


def codes_sample(weights, codes, wz, tokens, start_pos, seed, previous=()):
    """planted_sample with a token term: each target map also adds wz[j][kind] [2 * dims, 12]
    times the codes of the token and of the one before it (zeros before position 0); random ids
    in [0, len(codes))."""
    src, tgt = planted_sample(weights, tokens, start_pos, seed)
    g = torch.Generator().manual_seed(seed + 1000)
    ids = torch.randint(codes.shape[0], (tokens,), generator=g).tolist()
    before = list(previous)[-1:] if start_pos > 0 else []
    prev = before + ids[:-1] if start_pos > 0 else [None] + ids[:-1]
    z = torch.cat([codes[ids].double(),
                   torch.stack([codes[i].double() if i is not None else
                                torch.zeros(codes.shape[1], dtype=torch.float64) for i in prev])],
                  dim=1)
    out = []
    for j, (k, v) in enumerate(tgt):
        dk = (z @ wz[j][0]).reshape(1, tokens, 3, 4).transpose(1, 2)
        dv = (z @ wz[j][1]).reshape(1, tokens, 3, 4).transpose(1, 2)
        out.append(((k.double() + rope(dk, 50000.0, start_pos, "interleaved")).float(),
                    (v.double() + dv).float()))
    return src, tuple(out), ids


def test_fitter_keyword_defaults_are_the_native_ones():
    """AdapterFitter's keyword defaults are FitOptions' (include/kvbridge/adapter.h): the list is
    written in both languages, and this keeps the two from drifting apart."""
    native = kvbridge._core.FitOptions()
    params = inspect.signature(kvbridge.AdapterFitter.__init__).parameters
    names = ("rope_aware", "holdout", "max_source_layers", "seed", "alignment_policy", "min_gain",
             "exact_candidates", "token_context", "token_code_dims")
    for name in names:
        assert params[name].default == getattr(native, name), name
    assert params["source_layers"].default == "auto"
    assert native.selection == kvbridge._core.FitOptions.Selection.AUTO
    assert params["ridge"].default == "auto" and len(native.ridge_grid) > 1


def test_token_codes_fit_convert_and_file(weights, tmp_path):
    """A fitter with the target's token codes finds a planted token term (the R² with it is near
    1, without it far below), convert needs the ids and matches the float64 path, and the file
    keeps the codes."""
    g = torch.Generator().manual_seed(5)
    codes = torch.randn(37, 3, generator=g)
    wz = [(torch.randn(6, 12, generator=g, dtype=torch.float64),
           torch.randn(6, 12, generator=g, dtype=torch.float64)) for _ in range(3)]

    def fit(**kw):
        fitter = kvbridge.AdapterFitter(SRC, TGT, source_layers="all", **kw)
        for i in range(4):
            src, tgt, ids = codes_sample(weights, codes, wz, 400, 0, seed=40 + i)
            fitter.add(src, tgt, target_ids=ids)
        return fitter.fit()

    adapter, plain = fit(target_token_codes=codes), fit()
    assert adapter.has_token_codes and not plain.has_token_codes and plain.token_codes is None
    assert torch.equal(adapter.token_codes, codes) and adapter.token_context == 2
    for with_codes, without in zip(adapter.report["layers"], plain.report["layers"]):
        assert with_codes["r2_key"] > 0.99 and with_codes["r2_value"] > 0.99
        assert without["r2_key"] < with_codes["r2_key"] - 0.2
        assert with_codes["token_ridge_key"] is not None and without["token_ridge_key"] is None

    src, tgt, ids = codes_sample(weights, codes, wz, 61, 9, seed=60, previous=[4])
    with pytest.raises(kvbridge.InvalidArgumentError, match="token ids"):
        adapter.convert(src, 9)
    with pytest.raises(kvbridge.InvalidArgumentError, match="previous"):
        adapter.convert(src, 9, target_ids=ids)
    with pytest.raises(kvbridge.InvalidArgumentError, match="outside"):
        adapter.convert(src, 9, target_ids=[37] + ids[1:], previous_ids=[4])
    out = adapter.convert(src, 9, target_ids=ids, previous_ids=[4])
    ref = adapter.convert(src, 9, target_ids=ids, previous_ids=[4], reference=True)
    err = sum(float(((a - b) ** 2).sum()) for pair in zip(out, tgt) for a, b in zip(*pair))
    norm = sum(float((b ** 2).sum()) for _, pair in zip(out, tgt) for b in pair)
    assert math.sqrt(err / norm) < 0.05
    for (k, v), (rk, rv) in zip(out, ref):
        assert torch.allclose(k, rk, atol=1e-4 * float(rk.abs().max()))
        assert torch.allclose(v, rv, atol=1e-4 * float(rv.abs().max()))

    path = tmp_path / "codes.safetensors"
    adapter.save(path)
    loaded = kvbridge.LinearAdapter.load(path)
    assert loaded.fingerprint == adapter.fingerprint and torch.equal(loaded.token_codes, codes)
    for (k, v), (k0, v0) in zip(loaded.convert(src, 9, target_ids=ids, previous_ids=[4]), out):
        assert torch.equal(k, k0) and torch.equal(v, v0)
    meta, tensors = read_adapter_file(path)
    assert tensors["token_codes"].shape == (37, 3) and meta["token_context"] == "2"
    assert tensors["layers.2.value.token_weight"].shape == (6, 12)

    fitter = kvbridge.AdapterFitter(SRC, TGT, target_token_codes=codes)
    src, tgt, ids = codes_sample(weights, codes, wz, 20, 0, seed=70)
    with pytest.raises(kvbridge.InvalidArgumentError, match="token ids"):
        fitter.add(src, tgt)
    with pytest.raises(kvbridge.InvalidArgumentError, match="target_token_codes"):
        kvbridge.AdapterFitter(SRC, TGT, target_token_codes=codes.masked_fill(codes > 1, math.inf))
    with pytest.raises(kvbridge.InvalidArgumentError, match="token_context"):
        kvbridge.AdapterFitter(SRC, TGT, target_token_codes=codes, token_context=9)
