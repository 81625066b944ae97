"""kvbridge.align / token_offsets / align_text: hand-made tables through the Python wrapper, real
tokenizations (the testbed byte tokenizer, a small BPE trained here, the same BPE as a transformers
fast tokenizer) against a brute-force reference of both policies."""
import random

import numpy as np
import pytest
import torch

import kvbridge
from kvbridge.experiments import testbed
from test_adapter import planted_sample, planted_weights

tokenizers = pytest.importorskip("tokenizers")

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé: naïve café, 日本語のテキスト, emoji 🎉 and €uro signs.",
    "A fortune a day keeps the doctor away; a fortune cookie is not a fortune.",
    "    indented\n\tand tabbed\nlines,   with  spaces.",
]


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE with a BOS added by its post-processor and a special marker."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<|sep|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(testbed.texts("train")[:300] + TEXTS[:1], trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok


def reference_align(src, tgt, policy, src_roles=None, tgt_roles=None):
    """Brute force over every source token, straight from the policies' definitions."""
    src_roles = src_roles or [None] * len(src)
    tgt_roles = tgt_roles or [None] * len(tgt)
    out = []
    used = {}
    for (s, e), role in zip(tgt, tgt_roles):
        pick = -1
        if role is not None:
            cands = [i for i, (ss, se) in enumerate(src) if src_roles[i] == role and ss == s]
            k = used.get((role, s), 0)
            used[(role, s)] = k + 1
            pick = cands[k] if k < len(cands) else -1
        else:
            for i, (ss, se) in enumerate(src):
                if src_roles[i] is not None:
                    continue
                if policy == "seen" and se <= e:
                    pick = i
                if policy == "covering" and e > s and ss <= e - 1 < se:
                    pick = i
        out.append(pick)
    return out


def test_hand_made_tables_and_inputs():
    # "hello world": target words over source pieces, and the reverse
    src = [(0, 2), (2, 5), (5, 6), (6, 9), (9, 11)]
    tgt = np.array([[0, 5], [5, 11]], dtype=np.int32)
    assert kvbridge.align(src, tgt).tolist() == [1, 4]
    got = kvbridge.align(tgt, src, policy="covering")
    assert got.dtype == np.int64 and got.tolist() == [0, 0, 1, 1, 1]
    assert kvbridge.align(tgt, src, policy="seen").tolist() == [-1, 0, 0, 0, 1]
    # special tokens by role; a target BOS without a source BOS is -1
    assert kvbridge.align([(0, 4)], [(0, 0), (0, 4)], target_roles=["bos", None]).tolist() == [-1, 0]
    assert kvbridge.align([(0, 0), (0, 4)], [(0, 0), (0, 4)], source_roles=["bos", None],
                          target_roles=["bos", None]).tolist() == [0, 1]
    assert kvbridge.align([], []).tolist() == []


def test_rejects_bad_arguments():
    with pytest.raises(kvbridge.InvalidArgumentError, match="policy"):
        kvbridge.align([(0, 1)], [(0, 1)], policy="nearest")
    with pytest.raises(TypeError):
        kvbridge.align([(0.0, 1.5)], [(0, 1)])
    with pytest.raises(kvbridge.InvalidArgumentError, match="shape"):
        kvbridge.align([(0, 1, 2)], [(0, 1)])
    with pytest.raises(kvbridge.InvalidArgumentError, match="goes back"):
        kvbridge.align([(0, 3), (1, 2)], [(0, 1)])
    with pytest.raises(kvbridge.InvalidArgumentError, match="roles"):
        kvbridge.align([(0, 1)], [(0, 1)], source_roles=[None, None])
    with pytest.raises(kvbridge.InvalidArgumentError, match="must be empty"):
        kvbridge.align([(0, 1)], [(0, 1)], source_roles=["bos"])
    with pytest.raises(TypeError, match="tokenizer"):
        kvbridge.token_offsets(object(), "text")


def _check_tiles(text, offsets, roles):
    """Ordinary tokens' byte ranges tile the text (pieces of one character share its range)."""
    raw = text.encode("utf-8")
    spans = [o for o, r in zip(offsets, roles) if r is None]
    dedup = [s for k, s in enumerate(spans) if k == 0 or s != spans[k - 1]]
    assert b"".join(raw[s:e] for s, e in dedup) == raw
    assert all(s <= e for s, e in dedup)


def test_byte_tokenizer_offsets():
    tok = testbed.load_tokenizer()
    text = TEXTS[1]
    ids, offsets, roles = kvbridge.token_offsets(tok, text)
    assert ids == tok.encode(text)
    assert offsets[0] == (0, 0) and roles[0] == "bos" and roles[1:] == [None] * (len(ids) - 1)
    raw = text.encode("utf-8")
    assert all(raw[s:e] == bytes([i]) for i, (s, e) in zip(ids[1:], offsets[1:]))
    ids, offsets, roles = kvbridge.token_offsets(tok, "", add_bos=False)
    assert ids == [] and offsets == [] and roles == []


def test_byte_offsets_of_characters_of_every_utf8_length():
    """The vectorized character-to-byte table against each character's own encoding, on seeded
    random text of 1- to 4-byte characters (and the empty and all-ASCII cases)."""
    import sys

    byte_offsets = sys.modules["kvbridge.align"]._byte_offsets
    rng = random.Random(7)
    ranges = [(0x20, 0x7E), (0x80, 0x7FF), (0x800, 0xD7FF), (0xE000, 0xFFFF), (0x10000, 0x10FFFF)]
    texts = ["", "plain ascii", "".join(chr(rng.randint(*rng.choice(ranges))) for _ in range(4099))]
    for text in texts:
        want = [0]
        for c in text:
            want.append(want[-1] + len(c.encode("utf-8")))
        got = byte_offsets(text)
        assert got.dtype == np.int64 and got.tolist() == want

@pytest.mark.parametrize("text", TEXTS)
def test_bpe_offsets_are_bytes(bpe, text):
    ids, offsets, roles = kvbridge.token_offsets(bpe, text)
    assert ids == bpe.encode(text).ids
    assert roles[0] == "bos" and offsets[0] == (0, 0)
    _check_tiles(text, offsets, roles)
    # every multi-byte character's range is whole bytes of it
    raw = text.encode("utf-8")
    for (s, e), r in zip(offsets, roles):
        if r is None:
            raw[s:e].decode("utf-8")  # raises if the range cut a character


def test_special_marker_in_text(bpe):
    text = "first part<|sep|>second part"
    ids, offsets, roles = kvbridge.token_offsets(bpe, text)
    k = roles.index("<|sep|>")
    assert ids[k] == bpe.token_to_id("<|sep|>")
    assert offsets[k] == (10, 10)
    _check_tiles(text.replace("<|sep|>", ""), [(s - 7 * (s > 10), e - 7 * (e > 10))
                                                for s, e in offsets], roles)


@pytest.mark.parametrize("policy", kvbridge.ALIGN_POLICIES)
@pytest.mark.parametrize("direction", ["bytes->bpe", "bpe->bytes"])
def test_real_tokenizations_match_reference(bpe, policy, direction):
    byte_tok = testbed.load_tokenizer()
    src_tok, tgt_tok = (byte_tok, bpe) if direction == "bytes->bpe" else (bpe, byte_tok)
    rng = random.Random(7)
    texts = TEXTS + rng.sample(testbed.texts("heldout"), 20)
    for text in texts:
        al = kvbridge.align_text(src_tok, tgt_tok, text, policy=policy)
        assert al.policy == policy and len(al.index) == len(al.target_ids)
        assert al.index.tolist() == reference_align(al.source_offsets, al.target_offsets, policy,
                                                    al.source_roles, al.target_roles)
        assert al.index[0] == 0  # BOS to BOS
        if direction == "bytes->bpe":
            # a byte source has every boundary: each target token maps to the byte ending with it
            for j in range(1, len(al.target_ids)):
                assert al.source_offsets[al.index[j]][1] == al.target_offsets[j][1]


def test_transformers_fast_tokenizer(bpe):
    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>",
                                                eos_token="</s>")
    for text in TEXTS:
        ids, offsets, roles = kvbridge.token_offsets(fast, text)
        assert (ids, offsets, roles) == kvbridge.token_offsets(bpe, text)


SRC = kvbridge.ModelSpec("src", 2, 2, 8, rope_base=10000.0, rope_style="half")
TGT = kvbridge.ModelSpec("tgt", 3, 3, 4, rope_base=50000.0, rope_style="interleaved")


def _planted(weights, n_source, index, start_pos, seed):
    """Source KV for n_source tokens and the planted target KV of source token index[j] for each
    target token j (tests/python/test_adapter.py's planted_sample)."""
    return planted_sample(weights, n_source, start_pos, seed, index=index)


@pytest.mark.parametrize("direction", ["bytes->bpe", "bpe->bytes"])
def test_planted_map_through_two_tokenizations(bpe, direction):
    byte_tok = testbed.load_tokenizer()
    src_tok, tgt_tok = (byte_tok, bpe) if direction == "bytes->bpe" else (bpe, byte_tok)
    weights = planted_weights(3)
    fitter = kvbridge.AdapterFitter(SRC, TGT, alignment_policy="seen")
    texts = testbed.texts("train")[300:330]
    paired = 0
    for i, text in enumerate(texts):
        al = kvbridge.align_text(src_tok, tgt_tok, text, policy="seen")
        src, tgt = _planted(weights, len(al.source_ids), al.index, 0, seed=i)
        fitter.add(src, tgt, alignment=al.index)
        paired += int((al.index >= 0).sum())
    assert fitter.train_tokens + fitter.holdout_tokens == paired
    adapter = fitter.fit()
    assert adapter.report["alignment_policy"] == "seen"
    for layer in adapter.report["layers"]:
        assert layer["r2_key"] > 0.9999 and layer["r2_value"] > 0.9999
    # held-out text, converted through its alignment, is the planted target
    text = testbed.texts("heldout")[5]
    al = kvbridge.align_text(src_tok, tgt_tok, text)
    keep = np.flatnonzero(al.index >= 0)
    src, tgt = _planted(weights, len(al.source_ids), al.index, 0, seed=99)
    out = adapter.convert(src, alignment=al.index[keep], target_start_pos=int(keep[0]))
    assert keep[0] == 0 and (np.diff(keep) == 1).all()  # a prefix: positions line up
    for (k, v), (tk, tv) in zip(out, tgt):
        assert k.shape[2] == len(keep)
        for a, b in ((k, tk[:, :, keep]), (v, tv[:, :, keep])):
            assert ((a - b).norm() / b.norm()).item() < 1e-3
    ref = adapter.convert(src, alignment=al.index[keep], reference=True)
    for (k, v), (rk, rv) in zip(out, ref):
        assert torch.allclose(k, rk, atol=1e-4 * rk.abs().max().item())
    with pytest.raises(kvbridge.InvalidArgumentError, match="alignment"):
        adapter.convert(src, alignment=[len(al.source_ids)])
    with pytest.raises(TypeError):
        adapter.convert(src, alignment=[0.5])
    with pytest.raises(kvbridge.InvalidArgumentError, match="policy"):
        kvbridge.AdapterFitter(SRC, TGT, alignment_policy="nearest")


def test_aligned_adapter_file_records_the_policy(bpe, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file
    from test_adapter import adapter_checksum

    byte_tok = testbed.load_tokenizer()
    fitter = kvbridge.AdapterFitter(SRC, TGT, alignment_policy="covering")
    weights = planted_weights(4)
    for i, text in enumerate(testbed.texts("train")[:12]):
        al = kvbridge.align_text(byte_tok, bpe, text, policy="covering")
        fitter.add(*_planted(weights, len(al.source_ids), al.index, 0, seed=i),
                   alignment=al.index)
    adapter = fitter.fit()
    assert adapter.alignment_policy == "covering"
    path = tmp_path / "aligned.safetensors"
    adapter.save(path)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    assert meta["format_version"] == "3" and meta["alignment_policy"] == "covering"
    loaded = kvbridge.LinearAdapter.load(path)
    assert loaded.alignment_policy == "covering" and loaded.fingerprint == adapter.fingerprint

    def rewrite(mutate, fix_checksum=True):
        m = dict(meta)
        mutate(m)
        if fix_checksum:
            m["checksum"] = adapter_checksum(m, tensors)
        p = tmp_path / "bad.safetensors"
        save_file(tensors, str(p), metadata=m)
        return p

    for mutate, needle in [
        (lambda m: m.update(alignment_policy="nearest"), "policy"),
        (lambda m: m.pop("alignment_policy"), "alignment_policy"),
        (lambda m: m.update(format_version="2"), "alignment_policy"),
    ]:
        with pytest.raises(kvbridge.CorruptError, match=needle):
            kvbridge.LinearAdapter.load(rewrite(mutate))
    with pytest.raises(kvbridge.CorruptError, match="checksum"):
        kvbridge.LinearAdapter.load(rewrite(lambda m: m.update(alignment_policy="seen"), False))
