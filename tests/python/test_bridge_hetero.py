"""Bridge across tokenizers: a target served from a source with another tokenizer (the testbed
byte tokenizer and a small BPE trained in test_align), through an adapter fitted on a planted map
of aligned samples; round trips, prefixes the source has only partly, prompts whose decode and
re-encode is not exact, and the refusals."""
import dataclasses

import pytest
import torch

import kvbridge
from kvbridge.experiments import testbed
from test_adapter import planted_weights
from test_align import _planted, bpe  # noqa: F401  (bpe is a fixture)

BYTE = testbed.load_tokenizer()
SRC = kvbridge.ModelSpec("src", 2, 2, 8, rope_base=10000.0, rope_style="half",
                         tokenizer=BYTE.id)
TGT = kvbridge.ModelSpec("tgt", 3, 3, 4, rope_base=50000.0, rope_style="interleaved",
                         tokenizer="bpe-test")


@pytest.fixture(scope="module")
def planted(bpe):  # noqa: F811
    weights = planted_weights(11)
    fitter = kvbridge.AdapterFitter(SRC, TGT, alignment_policy="seen")
    for i, text in enumerate(testbed.texts("train")[:40]):
        al = kvbridge.align_text(BYTE, bpe, text)
        fitter.add(*_planted(weights, len(al.source_ids), al.index, 0, seed=i),
                   alignment=al.index)
    return weights, fitter.fit()


def make_bridge(bpe, adapter, chunk=1):  # noqa: F811
    bridge = kvbridge.Bridge(kvbridge.KVStore(64 << 20, chunk_tokens=chunk))
    bridge.add_tokenizer(SRC, BYTE)
    bridge.add_tokenizer(TGT, bpe)
    bridge.add_adapter(adapter)
    return bridge


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


TEXT = "Ünïcödé fortunes: a bird in the hand is worth two in the bush, they say."


def test_round_trip_across_tokenizers(bpe, planted):  # noqa: F811
    weights, adapter = planted
    bridge = make_bridge(bpe, adapter)
    al = kvbridge.align_text(BYTE, bpe, TEXT)
    src, tgt = _planted(weights, len(al.source_ids), al.index, 0, seed=123)
    assert bridge.save(SRC, al.source_ids, src) == len(al.source_ids)
    planned = bridge.probe(TGT, al.target_ids)  # the load's length, without converting
    assert planned.kv is None and planned.converted
    assert (bridge.stats()["probes"], bridge.stats()["conversions"]) == (1, 0)
    assert bridge.stats()["cross_tokenizer_loads"] == 0
    got = bridge.load(TGT, al.target_ids)
    assert planned == dataclasses.replace(got, kv=None)  # every field as the load reports it
    n = len(al.target_ids)
    assert got.converted and got.source == "src" and got.tokens == n - 1  # byte source: all seen
    want = adapter.convert(src, alignment=al.index[: n - 1])
    for (k, v), (wk, wv), (tk, tv) in zip(got.kv, want, tgt):
        assert torch.allclose(k, wk, atol=1e-5) and torch.allclose(v, wv, atol=1e-5)
        assert rel(k, tk[:, :, : n - 1]) < 1e-3 and rel(v, tv[:, :, : n - 1]) < 1e-3
    stats = bridge.stats()
    assert (stats["aligned_hits"], stats["converted_hits"], stats["cross_tokenizer_loads"]) == (1, 1, 1)
    assert stats["unverified_tokens"] == 0
    # written back: the next load is the target's own cache
    planned = bridge.probe(TGT, al.target_ids)
    again = bridge.load(TGT, al.target_ids)
    assert not planned.converted and planned.tokens == again.tokens
    assert (planned.native_tokens, planned.adapter) == (again.native_tokens, again.adapter)
    assert not again.converted and again.tokens == n - 1 and again.adapter == adapter.fingerprint
    for (k, v), (k0, v0) in zip(again.kv, got.kv):
        assert torch.equal(k, k0) and torch.equal(v, v0)


@pytest.mark.parametrize("tail", [0, 3])
def test_a_prompt_whose_own_entries_cover_it_is_not_tokenized(bpe, planted, monkeypatch, tail):  # noqa: F811
    """Once a load has written its conversion back (n - 1 less the tail), no adapter across
    tokenizers can serve more: the next loads and probes ask no tokenizer anything
    (Bridge::wanted_tokenizers) and serve the same. Without a write-back every load tokenizes,
    but each tokenizer decodes a token id alone once (the Bridge keeps the pieces)."""
    from kvbridge import bridge as bridge_mod

    weights, adapter = planted
    calls = {"offsets": 0, "multi": 0}
    singles = []  # (tokenizer, id) of every one-token decode
    token_offsets, decode = bridge_mod.token_offsets, bridge_mod._decode

    def counted_offsets(tokenizer, text, *args, **kwargs):
        calls["offsets"] += 1
        return token_offsets(tokenizer, text, *args, **kwargs)

    def counted_decode(tokenizer, ids, name=""):
        if len(ids) == 1:
            singles.append((id(tokenizer), ids[0]))
        else:
            calls["multi"] += 1
        return decode(tokenizer, ids, name)

    monkeypatch.setattr(bridge_mod, "token_offsets", counted_offsets)
    monkeypatch.setattr(bridge_mod, "_decode", counted_decode)
    al = kvbridge.align_text(BYTE, bpe, TEXT)
    n = len(al.target_ids)
    src, _ = _planted(weights, len(al.source_ids), al.index, 0, seed=5)
    for write_back in (True, False):
        bridge = kvbridge.Bridge(kvbridge.KVStore(64 << 20, chunk_tokens=1),
                                 write_back=write_back, recompute_tail=tail)
        bridge.add_tokenizer(SRC, BYTE)
        bridge.add_tokenizer(TGT, bpe)
        bridge.add_adapter(adapter)
        bridge.save(SRC, al.source_ids, src)
        first = bridge.load(TGT, al.target_ids)
        assert first.converted and first.tokens == n - 1 - tail
        assert calls["offsets"] == 2 and calls["multi"] > 0  # the target's text and the source's
        assert len(singles) == len(set(singles)) > 0
        for _ in range(2):
            calls.update(offsets=0, multi=0)
            del singles[:]
            again, planned = bridge.load(TGT, al.target_ids), bridge.probe(TGT, al.target_ids)
            assert again.tokens == planned.tokens == n - 1 - tail
            assert again.converted == planned.converted == (not write_back)
            if write_back:  # the own entries cover all an aligned candidate could serve
                assert calls == {"offsets": 0, "multi": 0} and not singles
                assert bridge.stats()["cross_tokenizer_loads"] == 1
                for (k, v), (k0, v0) in zip(again.kv, first.kv):
                    assert torch.equal(k, k0) and torch.equal(v, v0)
            else:  # tokenized again (load and probe), no token decoded alone again
                assert calls["offsets"] == 4 and not singles
                assert bridge.stats()["cross_tokenizer_loads"] == 2 + _
        calls.update(offsets=0, multi=0)
        del singles[:]


def test_partial_source_prefix_serves_the_text_inside_it(bpe, planted):  # noqa: F811
    weights, adapter = planted
    bridge = make_bridge(bpe, adapter)
    al = kvbridge.align_text(BYTE, bpe, TEXT)
    src, _ = _planted(weights, len(al.source_ids), al.index, 0, seed=5)
    cut = 31  # source tokens cached: BOS and 30 bytes of the text
    bridge.save(SRC, al.source_ids[:cut], tuple((k[:, :, :cut], v[:, :, :cut]) for k, v in src))
    got = bridge.load(TGT, al.target_ids)
    m = got.tokens
    ends = [e for _, e in al.target_offsets]
    assert 0 < m < len(al.target_ids) - 1
    assert ends[m - 1] <= cut - 1 < ends[m]  # the longest prefix whose text the source saw
    want = adapter.convert(src, alignment=al.index[:m])
    for (k, v), (wk, wv) in zip(got.kv, want):
        assert torch.allclose(k, wk, atol=1e-5) and torch.allclose(v, wv, atol=1e-5)


def test_reverse_direction_and_native_prefix(bpe):  # noqa: F811
    # BPE source -> byte target: the target's own cache holds a prefix, the rest is converted.
    src_spec = kvbridge.ModelSpec("src", 2, 2, 8, rope_base=10000.0, rope_style="half",
                                  tokenizer="bpe-test")
    tgt_spec = kvbridge.ModelSpec("tgt", 3, 3, 4, rope_base=50000.0, rope_style="interleaved",
                                  tokenizer=BYTE.id)
    weights = planted_weights(2)
    fitter = kvbridge.AdapterFitter(src_spec, tgt_spec, alignment_policy="covering")
    for i, text in enumerate(testbed.texts("train")[:40]):
        al = kvbridge.align_text(bpe, BYTE, text, policy="covering")
        fitter.add(*_planted(weights, len(al.source_ids), al.index, 0, seed=i),
                   alignment=al.index)
    adapter = fitter.fit()
    bridge = kvbridge.Bridge(kvbridge.KVStore(64 << 20, chunk_tokens=1))
    bridge.add_tokenizer(src_spec, bpe)
    bridge.add_tokenizer(tgt_spec, BYTE)
    bridge.add_adapter(adapter)
    al = kvbridge.align_text(bpe, BYTE, TEXT, policy="covering")
    src, tgt = _planted(weights, len(al.source_ids), al.index, 0, seed=8)
    bridge.save(src_spec, al.source_ids, src)
    bridge.save(tgt_spec, al.target_ids[:10], tuple((k[:, :, :10], v[:, :, :10]) for k, v in tgt))
    got = bridge.load(tgt_spec, al.target_ids)
    assert got.converted and got.native_tokens == 10 and got.tokens > 10
    m = got.tokens
    for (k, v), (tk, tv) in zip(got.kv, tgt):
        assert torch.equal(k[:, :, :10], tk[:, :, :10])  # the native part as stored
        assert rel(k[:, :, 10:], tk[:, :, 10:m]) < 1e-3 and rel(v[:, :, 10:], tv[:, :, 10:m]) < 1e-3


def test_unverified_tokens_are_not_served_across(bpe, planted):  # noqa: F811
    weights, adapter = planted
    bridge = make_bridge(bpe, adapter)
    al = kvbridge.align_text(BYTE, bpe, TEXT)
    src, _ = _planted(weights, len(al.source_ids), al.index, 0, seed=6)
    bridge.save(SRC, al.source_ids, src)
    # A prompt that is not the tokenizer's own encoding of its text: the text cut inside a
    # token of several (ASCII) characters and each part encoded alone. The re-encoding differs
    # from the junction on.
    ids, offsets, roles = kvbridge.token_offsets(bpe, TEXT)
    ascii_start = len(TEXT.encode("utf-8")) - len(TEXT[TEXT.index("fortunes"):])
    start = next(s for (s, e), r in zip(offsets, roles)
                 if r is None and s >= ascii_start and e - s >= 3)
    cut = start + 1 - (len(TEXT.encode("utf-8")) - len(TEXT))  # bytes to characters (ASCII)
    head, tail = TEXT[:cut], TEXT[cut:]
    prompt = bpe.encode(head).ids + bpe.encode(tail, add_special_tokens=False).ids
    canonical = bpe.encode(TEXT).ids
    junction = next(i for i, (a, b) in enumerate(zip(prompt, canonical)) if a != b)
    got = bridge.load(TGT, prompt)
    assert 0 < got.tokens <= junction
    assert bridge.stats()["unverified_tokens"] == len(prompt) - got.tokens


def test_refusals(bpe, planted):  # noqa: F811
    weights, adapter = planted
    # an adapter between tokenizers fitted without an alignment policy
    plain = kvbridge.AdapterFitter(SRC, TGT)
    for i in range(3):
        al = kvbridge.align_text(BYTE, bpe, testbed.texts("train")[i])
        plain.add(*_planted(weights, len(al.source_ids), al.index, 0, seed=i),
                  alignment=al.index)
    bridge = kvbridge.Bridge(kvbridge.KVStore(1 << 20, chunk_tokens=1))
    with pytest.raises(kvbridge.InvalidArgumentError, match="alignment policy"):
        bridge.add_adapter(plain.fit())
    # a tokenizer whose own id is not the spec's
    other = kvbridge.ModelSpec("src", 2, 2, 8, rope_base=10000.0, tokenizer="not-bytes")
    with pytest.raises(kvbridge.InvalidArgumentError, match="tokenizer id"):
        bridge.add_tokenizer(other, BYTE)
    with pytest.raises(TypeError):
        bridge.add_tokenizer(TGT, object())
    # an adapter whose spec's tokenizer id is not the one registered for that model
    bridge.add_tokenizer(kvbridge.ModelSpec("tgt", 3, 3, 4, tokenizer="another"), bpe)
    with pytest.raises(kvbridge.InvalidArgumentError, match="registered for tgt"):
        bridge.add_adapter(adapter)
    with pytest.raises(kvbridge.InvalidArgumentError, match="already has"):
        bridge.add_tokenizer(TGT, bpe)
    # without the target's tokenizer the adapter is registered but never used across
    bare = kvbridge.Bridge(kvbridge.KVStore(64 << 20, chunk_tokens=1))
    bare.add_adapter(adapter)
    al = kvbridge.align_text(BYTE, bpe, TEXT)
    bare.save(SRC, al.source_ids, _planted(weights, len(al.source_ids), al.index, 0, seed=1)[0])
    assert bare.load(TGT, al.target_ids).tokens == 0
    assert bare.stats()["cross_tokenizer_loads"] == 0
