"""The testbed's tokenizers (byte-level for testbed-a/b, BPE for testbed-c): offsets, roles,
round trips, the plain-tokenizers and transformers views of testbed-c's file, spec rules."""
import importlib.util
import json
import pathlib
import random
import sys

import pytest
import torch

pytest.importorskip("tokenizers")

import kvbridge  # noqa: E402
from kvbridge import specs  # noqa: E402
from kvbridge.experiments import testbed  # noqa: E402

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


def _vllm_options(monkeypatch):
    """kvbridge/vllm/options.py (the connector's spec rule) without the vllm package: its
    module imports kvbridge only, but the package's __init__ imports vLLM."""
    path = pathlib.Path(kvbridge.__file__).parent / "vllm" / "options.py"
    name = "kvbridge_vllm_options_under_test"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_testbed_c_spec_has_its_own_tokenizer_and_vllm_agrees(monkeypatch):
    from transformers import AutoConfig

    c, a = testbed.load_model("testbed-c"), testbed.load_model("testbed-a")
    assert type(c.model).__name__ == "Qwen3ForCausalLM"
    assert c.tokenizer is testbed.load_tokenizer("testbed-c")
    assert c.spec.tokenizer == c.tokenizer.id == specs.tokenizer_id(c.path)
    assert c.spec.tokenizer.startswith("tok-") and c.spec.tokenizer != a.spec.tokenizer
    assert c.spec.version == specs.weights_version(c.path) != a.spec.version
    assert (c.spec.num_layers, c.spec.num_kv_heads, c.spec.head_dim, c.spec.rope_base) == (
        4, 2, 40, 1e6)
    assert c.model.config.vocab_size == c.tokenizer.vocab_size
    options = _vllm_options(monkeypatch)
    engine = options.engine_spec(AutoConfig.from_pretrained(c.path), str(c.path),
                                 str(testbed.tokenizer_folder("testbed-c")), ["testbed-c"],
                                 torch.float32, "auto", options.parse_options({}, 32))
    assert engine == c.spec
    # vLLM given no tokenizer folder falls back to the model folder: the same id for testbed-c
    engine = options.engine_spec(AutoConfig.from_pretrained(c.path), str(c.path), None,
                                 ["testbed-c"], torch.float32, "auto",
                                 options.parse_options({}, 32))
    assert engine == c.spec


def test_load_pair_of_different_tokenizers():
    pair = testbed.load_pair("testbed-a", "testbed-c")
    assert pair.tokenizer is None
    assert pair.source.tokenizer.id != pair.target.tokenizer.id
    assert testbed.load_pair().tokenizer is testbed.load_tokenizer("testbed-a")
    with pytest.raises(ValueError, match="both"):
        testbed.load_pair("testbed-c", "testbed-c")


def test_per_byte_loss_equals_per_token_loss_for_bytes_and_differs_for_bpe():
    texts = testbed.texts("heldout")[:12]
    a, c = testbed.load_model("testbed-a"), testbed.load_model("testbed-c")
    assert testbed.sequence_loss(a, texts, per="byte") == pytest.approx(
        testbed.sequence_loss(a, texts), rel=1e-12)
    per_token, per_byte = (testbed.sequence_loss(c, texts, per=p) for p in ("token", "byte"))
    assert per_token > 1.5 * per_byte  # a BPE token stands for more than one byte
    with pytest.raises(ValueError, match="per"):
        testbed.sequence_loss(c, texts, per="char")


def test_testbed_c_losses_match_the_training_record():
    record = json.loads((testbed.MODELS_DIR / "TRAINING.json").read_text())
    info = record["models"]["testbed-c"]
    c = testbed.load_model("testbed-c")
    assert info["class"] == "Qwen3ForCausalLM" and info["version"] == c.spec.version
    assert info["tokenizer"]["id"] == c.tokenizer.id
    assert info["tokenizer"]["vocab_size"] == c.tokenizer.vocab_size
    check = testbed.texts("heldout")[:testbed.CHECK_FORTUNES]
    assert info["heldout_loss_check_fortunes"] == len(check)
    # Same weights, same float32 forward; only the thread count may change the rounding.
    assert testbed.sequence_loss(c, check) == pytest.approx(info["heldout_loss_check"], abs=1e-3)
    # Per byte, testbed-c is within 15% of testbed-a (the byte-level model of the same corpus).
    a_per_byte = record["models"]["testbed-a"]["heldout_loss"]  # per token = per byte for a
    assert abs(info["heldout_loss_per_byte"] - a_per_byte) < 0.15 * a_per_byte
