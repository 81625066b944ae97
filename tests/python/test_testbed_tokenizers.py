"""The testbed's tokenizers (byte-level for testbed-a/b, BPE for testbed-c): offsets, roles,
round trips, the plain-tokenizers and transformers views of testbed-c's file, spec rules."""
import json
import random

import pytest
import torch

pytest.importorskip("tokenizers")

from kvbridge import specs, testbed  # noqa: E402

MIXED = "Grüße, 東京 🙂 naïve <eos> x\tend\n"


def spelled(tok, text, ids, offsets, roles):
    """Checks that the ordinary tokens' ranges tile the text's bytes in order, specials have
    empty ranges, and each range holds the bytes the token stands for."""
    raw = text.encode("utf-8")
    pos = 0
    for i, (s, e), role in zip(ids, offsets, roles):
        if role is None:
            assert s == pos and e > s
            piece = bytes([i]) if isinstance(tok, testbed.ByteTokenizer) else tok.token_bytes(i)
            assert raw[s:e] == piece
            pos = e
        else:
            assert s == e
    assert pos == len(raw)


@pytest.fixture(scope="module")
def bpe():
    return testbed.load_tokenizer("testbed-c")


def test_byte_tokenizer_offsets_and_roles():
    tok = testbed.load_tokenizer("testbed-b")
    assert tok is testbed.load_tokenizer("testbed-a") and tok.tokenizer_id == tok.id
    ids, offsets, roles = tok.encode_with_offsets("aé", add_eos=True)
    assert ids == [tok.bos_id, 97, 0xC3, 0xA9, tok.eos_id]
    assert offsets == [(0, 0), (0, 1), (1, 2), (2, 3), (3, 3)]
    assert roles == ["bos", None, None, None, "eos"]
    assert tok.encode_with_offsets("", add_bos=False) == ([], [], [])
    for text in (MIXED, testbed.texts("heldout")[5]):
        for add_bos in (True, False):
            ids, offsets, roles = tok.encode_with_offsets(text, add_bos=add_bos, add_eos=True)
            assert ids == tok.encode(text, add_bos=add_bos, add_eos=True)
            spelled(tok, text, ids, offsets, roles)


def test_load_tokenizer_rejects_unknown_names():
    with pytest.raises(ValueError, match="testbed-c"):
        testbed.load_tokenizer("testbed-z")
    with pytest.raises(ValueError):
        testbed.tokenizer_folder("gpt2")


def test_bpe_is_a_byte_level_bpe_of_the_training_split(bpe):
    assert (bpe.bos_id, bpe.eos_id, bpe.pad_id) == (0, 1, 2)
    merges = len(json.loads(bpe.path.read_text())["model"]["merges"])
    assert 1000 <= merges <= 2000
    assert bpe.vocab_size == len(testbed.BPE_SPECIAL_TOKENS) + 256 + merges
    assert bpe.path == testbed.tokenizer_folder("testbed-c") / "tokenizer.json"
    # BPE compresses the corpus it was trained on: several bytes per token.
    sample = testbed.texts("heldout")[:200]
    n_bytes = sum(len(t.encode("utf-8")) for t in sample)
    n_tokens = sum(len(bpe.encode(t, add_bos=False)) for t in sample)
    assert n_bytes / n_tokens > 2.0


def test_bpe_round_trips_and_offsets(bpe):
    rng = random.Random(7)
    texts = [MIXED, "", " leading and trailing  ", "<bos><pad>"] + rng.sample(
        testbed.texts("heldout"), 40)
    for text in texts:
        ids = bpe.encode(text)
        assert ids[0] == bpe.bos_id and bpe.decode(ids) == text
        assert bpe.decode(torch.tensor(bpe.encode(text, add_eos=True))) == text
        ids, offsets, roles = bpe.encode_with_offsets(text, add_eos=True)
        assert ids == bpe.encode(text, add_eos=True)
        assert roles[0] == "bos" and roles[-1] == "eos" and roles.count(None) == len(ids) - 2
        spelled(bpe, text, ids, offsets, roles)
    # special-token text inside a text is ordinary bytes, as for the byte tokenizer
    ids = bpe.encode("<eos>", add_bos=False)
    assert bpe.eos_id not in ids and bpe.decode(ids) == "<eos>"
    assert bpe.decode([bpe.bos_id, bpe.pad_id]) == ""


def test_bpe_offsets_split_multibyte_characters_exactly(bpe):
    # A rare character is not a single token: its bytes spread over several tokens, whose
    # ranges end inside the character rather than all covering it.
    ids, offsets, roles = bpe.encode_with_offsets("\u0fff", add_bos=False)
    assert len(ids) == 3 and offsets == [(0, 1), (1, 2), (2, 3)]
    assert bpe.decode(ids[:1]) == "\ufffd"  # a cut character decodes to U+FFFD


def test_bpe_file_loads_as_plain_tokenizers_and_transformers(bpe):
    from tokenizers import Tokenizer

    plain = Tokenizer.from_file(str(bpe.path))
    text = testbed.texts("heldout")[11]
    assert plain.encode(text).ids == bpe.encode(text)  # its post-processor adds <bos>
    assert plain.encode(text, add_special_tokens=False).ids == bpe.encode(text, add_bos=False)
    from transformers import AutoTokenizer

    fast = AutoTokenizer.from_pretrained(testbed.tokenizer_folder("testbed-c"))
    assert fast(text)["input_ids"] == bpe.encode(text)
    assert (fast.bos_token_id, fast.eos_token_id, fast.pad_token_id) == (
        bpe.bos_id, bpe.eos_id, bpe.pad_id)
