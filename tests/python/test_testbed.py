"""The shipped testbed models: offline loading, specs, the HF cache path, tokenizer, losses."""
import json
import math
import warnings

import pytest
import torch

pytest.importorskip("transformers")

import kvbridge  # noqa: E402
from kvbridge import hf, specs  # noqa: E402
from kvbridge.experiments import testbed  # noqa: E402

# float32 logits of an incremental decode vs one full forward: same math, different reduction
# shapes, so they agree to rounding; 1e-4 absolute is far below any real difference (logits ~10).
LOGIT_ATOL = 1e-4


@pytest.fixture(scope="module")
def pair():
    return testbed.load_pair()


@pytest.fixture(scope="module")
def record():
    return json.loads((testbed.MODELS_DIR / "TRAINING.json").read_text())


def heldout_ids(tok, index=0, limit=testbed.MAX_CONTEXT):
    return tok.encode(testbed.texts("heldout")[index])[:limit]


def test_pair_loads_offline_as_float32_eval(pair, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    again = testbed.load_model("testbed-a")
    assert again.spec == pair.source.spec
    assert type(pair.source.model).__name__ == "LlamaForCausalLM"
    assert type(pair.target.model).__name__ == "Qwen2ForCausalLM"
    for tm, name in ((pair.source, "testbed-a"), (pair.target, "testbed-b")):
        assert tm.name == name and tm.spec.name == name
        assert tm.path == testbed.MODELS_DIR / name
        assert not tm.model.training
        assert all(p.dtype == torch.float32 for p in tm.model.parameters())
        assert tm.model.config.vocab_size == pair.tokenizer.vocab_size
        assert tm.model.config.max_position_embeddings >= testbed.MAX_CONTEXT


def test_specs_describe_the_models(pair):
    a, b = pair.source.spec, pair.target.spec
    assert (a.num_layers, a.num_kv_heads, a.head_dim, a.rope_base) == (4, 4, 32, 10000.0)
    assert (b.num_layers, b.num_kv_heads, b.head_dim, b.rope_base) == (6, 2, 32, 50000.0)
    assert pair.target.model.config.num_attention_heads == 6  # grouped: 3 query heads per KV
    for spec in (a, b):
        assert spec.dtype == "float32" and spec.rope_style == "half"
        assert spec.rope_scaling.type == "none"
        assert spec.tokenizer == pair.tokenizer.id
    assert a.version != b.version and len(a.version) == 32
    assert a.fingerprint != b.fingerprint


def test_spec_version_is_the_weights_hash(pair, record):
    for tm in (pair.source, pair.target):
        assert tm.spec.version == record["models"][tm.name]["version"]
        assert tm.spec.version == specs.file_hash(tm.path / "model.safetensors")


@pytest.mark.parametrize("which", ["source", "target"])
def test_kv_shapes_match_spec(pair, which):
    tm = getattr(pair, which)
    ids = torch.tensor([heldout_ids(pair.tokenizer, 3, 57)])
    logits, kv = testbed.prefill(tm, ids)
    assert logits.shape == (1, ids.shape[1], pair.tokenizer.vocab_size)
    assert len(kv) == tm.spec.num_layers
    for k, v in kv:
        assert k.shape == v.shape == (1, tm.spec.num_kv_heads, ids.shape[1], tm.spec.head_dim)
        assert k.dtype == v.dtype == getattr(torch, tm.spec.dtype)


@pytest.mark.parametrize("which", ["source", "target"])
def test_incremental_decoding_equals_full_forward(pair, which):
    tm = getattr(pair, which)
    ids = torch.tensor([heldout_ids(pair.tokenizer, 1, 90)])
    prefix = 61
    with torch.no_grad():
        full = tm.model(ids, use_cache=False).logits
        _, kv = testbed.prefill(tm, ids[:, :prefix])
        cache = hf.to_dynamic_cache(kv)
        steps = []
        for t in range(prefix, ids.shape[1]):
            out = tm.model(ids[:, t:t + 1], cache=cache, use_cache=True)
            cache = out.cache
            steps.append(out.logits)
    assert cache.get_seq_length() == ids.shape[1]
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, prefix:], rtol=0, atol=LOGIT_ATOL)


def test_past_key_values_keyword_still_works(pair):
    # transformers 5.24 renamed past_key_values to cache and keeps the old name as an alias.
    tm = pair.target
    ids = torch.tensor([heldout_ids(pair.tokenizer, 2, 40)])
    with torch.no_grad():
        full = tm.model(ids, use_cache=False).logits
        _, kv = testbed.prefill(tm, ids[:, :30])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            out = tm.model(ids[:, 30:], past_key_values=hf.to_dynamic_cache(kv), use_cache=True)
    torch.testing.assert_close(out.logits, full[:, 30:], rtol=0, atol=LOGIT_ATOL)


def test_tokenizer_round_trips(pair):
    tok = pair.tokenizer
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (256, 257, 259)
    for text in ["", "plain ASCII", "tabs\tand\nnewlines", "Grüße, 東京, ∑ ≠ ∞ 🙂"]:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_id and all(0 <= i < 256 for i in ids[1:])
        assert len(ids) == 1 + len(text.encode("utf-8"))
        assert tok.decode(ids) == text
        assert tok.decode(tok.encode(text, add_eos=True)) == text
    for text in testbed.texts("heldout")[:50]:
        assert tok.decode(torch.tensor(tok.encode(text))) == text
    assert tok.encode("ab", add_bos=False) == [97, 98]
    assert tok.decode([104, 105, 0xE2]) == "hi\ufffd"  # a cut multi-byte character


def test_texts_split_is_fixed_and_disjoint():
    train, heldout = testbed.texts("train"), testbed.texts("heldout")
    assert train == testbed.texts("train") and heldout == testbed.texts("heldout")
    assert len(heldout) > 100
    assert abs(len(train) / len(heldout) - (testbed.HELDOUT_EVERY - 1)) < 0.1
    assert all(t.strip() and "\n%\n" not in t for t in train[:500] + heldout)
    # Duplicate fortunes exist across files, so check the split by position, not content.
    everything = testbed._all_fortunes()
    every = testbed.HELDOUT_EVERY
    assert heldout == list(everything[every - 1::every])
    with pytest.raises(ValueError):
        testbed.texts("test")


def test_heldout_loss_matches_the_training_record(pair, record):
    assert record["max_context"] == testbed.MAX_CONTEXT
    assert record["tokenizer"] == pair.tokenizer.id
    check = testbed.texts("heldout")[:testbed.CHECK_FORTUNES]
    uniform = math.log(pair.tokenizer.vocab_size)
    for tm in (pair.source, pair.target):
        info = record["models"][tm.name]
        assert info["heldout_loss_check_fortunes"] == len(check)
        loss = testbed.sequence_loss(tm, check)
        # Same weights, same float32 forward; only the thread count may change the rounding.
        assert loss == pytest.approx(info["heldout_loss_check"], abs=1e-3)
        # The recorded whole-split loss is near the check subset's and far below uniform.
        assert abs(info["heldout_loss"] - loss) < 0.25 * info["heldout_loss"]
        assert info["heldout_loss"] < 0.6 * uniform


def test_model_spec_reads_rope_scaling():
    from transformers import LlamaConfig, LlamaForCausalLM

    def tiny(rope):
        cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                          max_position_embeddings=64, rope_parameters=rope)
        return LlamaForCausalLM(cfg)

    spec = testbed.model_spec(tiny({"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0}),
                              "tiny", tokenizer="t")
    assert (spec.rope_base, spec.rope_scaling.type, spec.rope_scaling.factor) == (
        500.0, "linear", 2.0)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (1, 1, 8)
    assert len(spec.version) == 32  # no weights file: a hash of the weights in memory
    llama3 = {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    spec = testbed.model_spec(tiny(llama3), "tiny", tokenizer="t")
    assert spec.rope_scaling.type == "llama3"
    assert spec.rope_scaling.original_max_position == 32
    with pytest.raises(ValueError, match="yarn"):
        testbed.model_spec(tiny({"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}),
                           "tiny", tokenizer="t")


def test_shipped_models_fit_the_size_budget():
    total = sum(p.stat().st_size for p in testbed.MODELS_DIR.rglob("*") if p.is_file())
    assert total <= 16 * 1024 * 1024  # 10 MiB for testbed-a and -b, 6 MiB for testbed-c
