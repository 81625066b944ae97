"""Per-layer attention (kvbridge.LayerAttention, ModelSpec(layer_attention=[...])): the value
type, the spec's identity and its fingerprint encoding (docs/hashing.md, checked against an
independent implementation), adapter files, and fits and converts that un-rotate and re-rotate
each layer with its own RoPE."""
import json
import math
import pathlib
import pickle
import struct

import pytest
import torch
import xxhash

import kvbridge
from conftest import random_kv
from test_adapter import adapter_checksum, read_adapter_file

LA = kvbridge.LayerAttention
ADAPTERS = pathlib.Path(kvbridge.__file__).parent / "experiments" / "testbed" / "adapters"


def gemma_like(**kw):
    """A small Gemma-3-like spec: 5 sliding-window layers (base 1e4, window 512) per full
    attention layer (base 1e6), 12 layers."""
    layers = [LA(1e6) if (i + 1) % 6 == 0 else LA(1e4, sliding_window=512) for i in range(12)]
    return kvbridge.ModelSpec("gemma-ish", 12, 1, 8, dtype="bfloat16", layer_attention=layers,
                              **kw)


def test_layer_attention_value():
    a = LA()
    assert (a.rope_base, a.rope_scaling, a.sliding_window) == (10000.0, kvbridge.RopeScaling(), 0)
    assert [f[0] for f in LA.FIELDS] == ["rope_base", "rope_scaling", "sliding_window"]
    b = LA(rope_base=1e6, rope_scaling=None, sliding_window=512)
    assert b.rope_scaling == kvbridge.RopeScaling()  # None: no scaling
    assert b == LA(1e6, kvbridge.RopeScaling(), 512) and b != a
    assert hash(b) == hash(LA(1e6, sliding_window=512))
    assert pickle.loads(pickle.dumps(b)) == b
    scaled = LA(5e5, kvbridge.RopeScaling("llama3", 8.0, 1.0, 4.0, 8192), 3)
    assert pickle.loads(pickle.dumps(scaled)) == scaled
    assert repr(b).startswith("LayerAttention(rope_base=1000000.0, rope_scaling=RopeScaling(")
    assert repr(b).endswith("sliding_window=512)")
    assert eval(repr(scaled), {"LayerAttention": LA, "RopeScaling": kvbridge.RopeScaling}) == scaled
    with pytest.raises(TypeError, match="rope_base"):
        LA(rope_base="1e4")
    with pytest.raises(TypeError, match="sliding_window"):
        LA(sliding_window=2.0)
    with pytest.raises(TypeError, match="rope_scaling"):
        LA(rope_scaling="none")


def test_spec_layer_attention_identity():
    g = gemma_like()
    assert isinstance(g.layer_attention, list) and len(g.layer_attention) == 12
    assert g.layer(5) == LA(1e6) and g.layer(0).sliding_window == 512
    assert not g.uniform_attention()
    assert g == gemma_like() and hash(g) == hash(gemma_like())
    assert pickle.loads(pickle.dumps(g)) == g
    flipped = list(g.layer_attention)
    flipped[3] = LA(1e4, sliding_window=256)
    assert kvbridge.ModelSpec("gemma-ish", 12, 1, 8, dtype="bfloat16",
                              layer_attention=flipped) != g
    # Without entries: every layer from the spec-wide fields; an empty list is the same spec,
    # with the fingerprint it had before layer_attention existed.
    plain = kvbridge.ModelSpec("m", 3, 2, 4, rope_base=5e5)
    assert plain.layer_attention == [] and plain.uniform_attention()
    assert plain.layer(2) == LA(5e5)
    assert kvbridge.ModelSpec("m", 3, 2, 4, rope_base=5e5, layer_attention=[]) == plain
    explicit = kvbridge.ModelSpec("m", 3, 2, 4, rope_base=5e5, layer_attention=[LA(5e5)] * 3)
    assert explicit.uniform_attention() and explicit != plain
    assert explicit.fingerprint != plain.fingerprint
    with pytest.raises(kvbridge.InvalidArgumentError, match="layer"):
        plain.layer(3)
    # A pickle state from before layer_attention (one element fewer) still loads.
    old = kvbridge.ModelSpec.__new__(kvbridge.ModelSpec)
    old.__setstate__(plain.__getstate__()[:-1])
    assert old == plain


def encode_fingerprint(spec):
    """docs/hashing.md's encoding, written independently of the library."""
    def field(key, value):
        k, v = key.encode(), value.encode()
        return struct.pack("<I", len(k)) + k + struct.pack("<I", len(v)) + v

    def scaling(prefix, s):
        return (field(prefix + "type", s.type) + field(prefix + "factor", "%.17g" % s.factor)
                + field(prefix + "low_freq_factor", "%.17g" % s.low_freq_factor)
                + field(prefix + "high_freq_factor", "%.17g" % s.high_freq_factor)
                + field(prefix + "original_max_position", str(s.original_max_position)))

    enc = b"kvbridge.ModelSpec.v1"
    for key in ("name", "version", "tokenizer"):
        enc += field(key, getattr(spec, key))
    for key in ("num_layers", "num_kv_heads", "head_dim"):
        enc += field(key, str(getattr(spec, key)))
    enc += field("dtype", spec.dtype) + field("rope_base", "%.17g" % spec.rope_base)
    enc += field("rope_style", spec.rope_style) + scaling("rope_scaling.", spec.rope_scaling)
    if spec.layer_attention:
        enc += field("layer_attention", str(len(spec.layer_attention)))
        for i, a in enumerate(spec.layer_attention):
            p = f"layer_attention.{i}."
            enc += field(p + "rope_base", "%.17g" % a.rope_base)
            enc += scaling(p + "rope_scaling.", a.rope_scaling)
            enc += field(p + "sliding_window", str(a.sliding_window))
    return xxhash.xxh3_128(enc).hexdigest()


def test_fingerprint_encoding():
    linear = kvbridge.RopeScaling("linear", 8.0)
    pinned = kvbridge.ModelSpec("gemma-ish", 3, 1, 4, dtype="bfloat16", layer_attention=[
        LA(sliding_window=512), LA(sliding_window=512), LA(1e6, linear)])
    # The same value tests/cpp/test_model_spec.cpp pins.
    assert pinned.fingerprint == encode_fingerprint(pinned) == "8db50e085962ab3f88fe429da49d78df"
    for spec in (gemma_like(version="r2", tokenizer="tok"),
                 kvbridge.ModelSpec("m", 2, 3, 6, rope_style="interleaved", layer_attention=[
                     LA(2.5e4, kvbridge.RopeScaling("llama3", 4.0, 0.5, 2.0, 1 << 20), 7),
                     LA(0.1, sliding_window=1)]),
                 kvbridge.ModelSpec("plain", 4, 2, 8)):
        assert spec.fingerprint == encode_fingerprint(spec)


@pytest.mark.parametrize("layers, match", [
    ([LA()] * 2, r"layer_attention must be empty or hold one entry per layer \(3\), got 2"),
    ([LA(), LA(-1.0), LA()], r"layer_attention\[1\]\.rope_base"),
    ([LA(), LA(), LA(math.nan)], r"layer_attention\[2\]\.rope_base"),
    ([LA(rope_scaling=kvbridge.RopeScaling("linear", 0.0)), LA(), LA()],
     r"layer_attention\[0\]\.rope_scaling\.factor"),
    ([LA(), LA(sliding_window=-4), LA()], r"layer_attention\[1\]\.sliding_window")])
def test_validate_names_the_entry(layers, match):
    with pytest.raises(kvbridge.InvalidArgumentError, match=match):
        kvbridge.ModelSpec("m", 3, 2, 4, layer_attention=layers)


# Source: two RoPE groups (base 1e4 with a window, then 1e6); target: per-layer bases in the
# interleaved style, one with linear scaling. The spec-wide bases rule no layer.
SRC = kvbridge.ModelSpec("src-l", 4, 2, 8, rope_base=3000.0, layer_attention=[
    LA(1e4, sliding_window=16), LA(1e4, sliding_window=16), LA(1e6), LA(1e6)])
TGT = kvbridge.ModelSpec("tgt-l", 3, 3, 4, rope_style="interleaved", rope_base=7000.0,
                         layer_attention=[LA(1e6), LA(1e4, sliding_window=8),
                                          LA(2e5, kvbridge.RopeScaling("linear", 2.0))])
PLANTED = [[0, 2], [1, 3], [2]]


def inv_freq(a, dim):
    inv = 1.0 / a.rope_base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    return inv / a.rope_scaling.factor if a.rope_scaling.type == "linear" else inv


def rope(x, a, positions, style, inverse=False):
    """x [1, heads, tokens, dim] rotated (or un-rotated) at `positions` with layer a's RoPE."""
    dim = x.shape[-1]
    ang = torch.as_tensor(positions, dtype=torch.float64)[:, None] * inv_freq(a, dim)[None, :]
    cos, sin = ang.cos(), ang.sin() * (-1 if inverse else 1)
    x = x.double()
    if style == "half":
        p, q = x[..., : dim // 2], x[..., dim // 2:]
        return torch.cat([p * cos - q * sin, q * cos + p * sin], dim=-1)
    p, q = x[..., 0::2], x[..., 1::2]
    return torch.stack([p * cos - q * sin, q * cos + p * sin], dim=-1).flatten(-2)


def rows(t):
    """[1, heads, tokens, dim] -> [tokens, heads * dim]"""
    return t.double().transpose(1, 2).reshape(t.shape[2], -1)


def planted_sample(weights, tokens, start_pos, seed):
    g = torch.Generator().manual_seed(seed)
    free = [(torch.randn(1, 2, tokens, 8, generator=g, dtype=torch.float64),
             torch.randn(1, 2, tokens, 8, generator=g, dtype=torch.float64)) for _ in range(4)]
    pos = list(range(start_pos, start_pos + tokens))
    target = []
    for j, (layers, (w_k, b_k, w_v, b_v)) in enumerate(zip(PLANTED, weights)):
        x = torch.cat([rows(t) for l in layers for t in free[l]], dim=1)
        k = (x @ w_k + b_k).reshape(1, tokens, 3, 4).transpose(1, 2)
        v = (x @ w_v + b_v).reshape(1, tokens, 3, 4).transpose(1, 2)
        target.append((rope(k, TGT.layer(j), pos, "interleaved").float(), v.float()))
    source = [(rope(k, SRC.layer(l), pos, "half").float(), v.float())
              for l, (k, v) in enumerate(free)]
    return tuple(source), tuple(target)


@pytest.fixture(scope="module")
def planted():
    g = torch.Generator().manual_seed(11)
    weights = [tuple(torch.randn(*shape, generator=g, dtype=torch.float64) * 0.3
                     for shape in ((len(layers) * 32, 12), (12,), (len(layers) * 32, 12), (12,)))
               for layers in PLANTED]

    def cast(kv, spec):
        return tuple(tuple(t.to(getattr(torch, spec.dtype)) for t in pair) for pair in kv)

    def fit(src_spec, tgt_spec):
        fitter = kvbridge.AdapterFitter(src_spec, tgt_spec, source_layers=PLANTED)
        for i in range(4):
            src, tgt = planted_sample(weights, 80, 9 + 250 * i, seed=30 + i)
            fitter.add(cast(src, src_spec), cast(tgt, tgt_spec), start_pos=9 + 250 * i)
        return fitter.fit()

    return weights, fit


def test_fit_recovers_planted_map_with_per_layer_bases(planted):
    weights, fit = planted
    adapter = fit(SRC, TGT)
    for layer in adapter.report["layers"]:
        assert layer["r2_key"] > 0.9999 and layer["r2_value"] > 0.9999
    src, tgt = planted_sample(weights, 23, 3000, seed=99)
    for (k, v), (k0, v0) in zip(adapter.convert(src, 3000), tgt):
        assert (k - k0).norm() < 1e-3 * k0.norm() and (v - v0).norm() < 1e-3 * v0.norm()
    # The same data with every layer on the spec-wide base: the keys cannot be fitted.
    flat = fit(kvbridge.ModelSpec("src-l", 4, 2, 8, rope_base=3000.0),
               kvbridge.ModelSpec("tgt-l", 3, 3, 4, rope_style="interleaved", rope_base=7000.0))
    assert all(layer["r2_key"] < 0.9 for layer in flat.report["layers"])


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("bfloat16", 2e-2)])
def test_convert_is_per_layer_unrotate_gemm_rotate(planted, dtype, tol, tmp_path):
    _, fit = planted
    adapter = fit(SRC, TGT)
    adapter.save(tmp_path / "a.safetensors")  # the weights, as the file holds them
    _, tensors = read_adapter_file(tmp_path / "a.safetensors")
    src = random_kv(SRC, 29, 4, strided=True)
    ref = adapter.convert(src, 611, reference=True)
    pos = list(range(611, 640))
    for j, ((k_ref, v_ref), layers) in enumerate(zip(ref, PLANTED)):
        assert adapter.report["layers"][j]["source_layers"] == layers
        x = torch.cat([rows(rope(src[l][0], SRC.layer(l), pos, "half", inverse=True))
                       if kind == 0 else rows(src[l][1]) for l in layers for kind in (0, 1)], 1)
        k, v = ((x @ tensors[f"layers.{j}.{kind}.weight"].double()
                 + tensors[f"layers.{j}.{kind}.bias"].double()).reshape(1, 29, 3, 4)
                for kind in ("key", "value"))
        k = rope(k.transpose(1, 2), TGT.layer(j), pos, "interleaved")
        assert torch.allclose(k_ref.double(), k, atol=1e-5 * k.abs().max().item())
        assert torch.allclose(v_ref.double(), v.transpose(1, 2), atol=1e-5 * v.abs().max().item())
    # The CPU fast path in another dtype against the reference in that dtype.
    s2 = kvbridge.ModelSpec("src-l", 4, 2, 8, dtype=dtype, rope_base=3000.0,
                            layer_attention=SRC.layer_attention)
    t2 = kvbridge.ModelSpec("tgt-l", 3, 3, 4, dtype=dtype, rope_style="interleaved",
                            rope_base=7000.0, layer_attention=TGT.layer_attention)
    adapter2 = fit(s2, t2) if dtype != "float32" else adapter
    src2 = random_kv(s2, 301, 5, strided=True)
    for pair, pair0 in zip(adapter2.convert(src2, 77), adapter2.convert(src2, 77, reference=True)):
        for a, b in zip(pair, pair0):
            scale = b.float().abs().max().item()
            assert (a.float() - b.float()).abs().max().item() <= tol * scale


def test_adapter_file_round_trip(planted, tmp_path):
    _, fit = planted
    adapter = fit(SRC, TGT)
    path = tmp_path / "layered.safetensors"
    adapter.save(path)
    loaded = kvbridge.LinearAdapter.load(path)
    assert loaded.source == SRC and loaded.target == TGT
    assert loaded.source.layer_attention == SRC.layer_attention
    assert loaded.fingerprint == adapter.fingerprint
    src = random_kv(SRC, 13, 6)
    for (k, v), (k0, v0) in zip(loaded.convert(src, 2), adapter.convert(src, 2)):
        assert torch.equal(k, k0) and torch.equal(v, v0)
    meta, tensors = read_adapter_file(path)
    assert meta["format_version"] == "2"
    target = json.loads(meta["target_spec"])
    assert target["layer_attention"][1] == {
        "rope_base": 1e4, "sliding_window": 8,
        "rope_scaling": {"type": "none", "factor": 1.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position": 8192}}
    # What a reader from before layer_attention sees: the key ignored, the fields then do not
    # match the spec's fingerprint, and the file is refused (the same edit, checksum redone).
    from safetensors.torch import save_file
    del target["layer_attention"]
    meta["target_spec"] = json.dumps(target)
    meta["checksum"] = adapter_checksum(meta, tensors)
    edited = tmp_path / "edited.safetensors"
    save_file(tensors, str(edited), metadata=meta)
    with pytest.raises(kvbridge.CorruptError, match="target_spec: fingerprint"):
        kvbridge.LinearAdapter.load(edited)


@pytest.mark.parametrize("name", sorted(p.name for p in ADAPTERS.glob("*.safetensors")))
def test_files_without_layer_attention_load_as_before(name, tmp_path):
    adapter = kvbridge.LinearAdapter.load(ADAPTERS / name)
    meta, _ = read_adapter_file(ADAPTERS / name)
    for spec, key in ((adapter.source, "source_spec"), (adapter.target, "target_spec")):
        assert spec.layer_attention == [] and spec.uniform_attention()
        assert "layer_attention" not in json.loads(meta[key])
        assert spec.fingerprint == json.loads(meta[key])["fingerprint"]
    # Its fingerprint is the checksum of its content without the serving record the shipped
    # files carry (benchmarks/recorded/120-quality-levers.md names the testbed-b one).
    assert "serving" in meta and adapter.serving is not None
    if name == "testbed-a_to_testbed-b.safetensors":
        assert adapter.fingerprint == "c65f5989c19ab4ba90480b04a024afeb"
    adapter.serving = None
    saved = tmp_path / "plain.safetensors"
    adapter.save(saved)
    assert read_adapter_file(saved)[0]["checksum"] == adapter.fingerprint
