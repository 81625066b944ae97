"""Bridge integrity (issue 33): dropped adapters' KV, non-finite numbers, the verified prefix's
cost on a decode that is not prefix-stable, target offsets checked per token, misbehaving
tokenizers, and the device load's rules. Races are ordered by the C++ tests' hooks
(tests/cpp/test_bridge.cpp); here the outcomes are checked through the Python API."""
import importlib.util
import logging
import math

import numpy as np
import pytest
import torch

import kvbridge
from kvbridge import bridge as bridge_mod
from kvbridge import hf
from kvbridge.experiments import testbed
from conftest import random_kv
from test_adapter import planted_sample, planted_weights, SRC as PSRC, TGT as PTGT
from test_align import bpe  # noqa: F401  (a fixture)
from test_bridge_hetero import SRC, TGT, TEXT, make_bridge, planted  # noqa: F401

BYTE = testbed.load_tokenizer()


def float_kv(spec, tokens, seed):
    return random_kv(spec, tokens, seed)


# ----- dropped adapters ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def same_tok():
    """A same-tokenizer planted adapter PSRC -> PTGT (test_adapter's specs, tokenizer "tok")."""
    src = kvbridge.ModelSpec("src", 2, 2, 8, rope_base=10000.0, rope_style="half", tokenizer="tok")
    tgt = kvbridge.ModelSpec("tgt", 3, 3, 4, rope_base=50000.0, rope_style="interleaved",
                             tokenizer="tok")
    weights = planted_weights(5)
    fitter = kvbridge.AdapterFitter(src, tgt)
    for i in range(4):
        s, t = planted_sample(weights, 97, 11 + 200 * i, seed=i)
        fitter.add(s, t, start_pos=11 + 200 * i)
    return src, tgt, weights, fitter.fit()


def test_saves_naming_a_dropped_adapter_store_nothing(same_tok):
    src, tgt, weights, adapter = same_tok
    bridge = kvbridge.Bridge(kvbridge.KVStore(64 << 20, chunk_tokens=16))
    bridge.add_adapter(adapter)
    tokens = list(range(100, 153))
    s, _ = planted_sample(weights, 53, 0, seed=40)
    bridge.save(src, tokens, s)
    got = bridge.load(tgt, tokens)
    assert got.converted and got.tokens == 48
    derived = float_kv(tgt, 53, 41)
    assert not bridge.adapter_dropped(adapter)
    assert bridge.save(tgt, tokens, derived, converted_from=src.fingerprint,
                       adapter=adapter.fingerprint) == 48
    assert bridge.disable_adapter(adapter)
    assert bridge.adapter_dropped(adapter) and bridge.adapter_dropped(adapter.fingerprint)
    assert bridge.store.match(tgt, tokens, return_kv=False).tokens == 0  # purged
    assert bridge.save(tgt, tokens, derived, converted_from=src.fingerprint,
                       adapter=adapter.fingerprint) == 0
    assert bridge.store.match(tgt, tokens, return_kv=False).tokens == 0
    # Put behind the bridge's back (another process): never served by this bridge.
    bridge.store.put(tgt, tokens, derived, converted_from=src.fingerprint,
                     adapter=adapter.fingerprint)
    hit = bridge.load(tgt, tokens)
    assert hit.tokens == 0 and hit.adapter == ""
    st = bridge.stats()
    assert st["dropped_writes"] == 1 and st["dropped_tokens"] == 48
    assert "kvbridge_bridge_dropped_writes_total 1" in bridge.metrics()
    assert bridge.enable_adapter(adapter) and not bridge.adapter_dropped(adapter)
    assert bridge.load(tgt, tokens).adapter == adapter.fingerprint


# ----- non-finite numbers -------------------------------------------------------------------


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_save_refuses_non_finite_kv(same_tok, bad):
    src, _, _, _ = same_tok
    bridge = kvbridge.Bridge(kvbridge.KVStore(64 << 20, chunk_tokens=16))
    kv = float_kv(src, 40, 3)
    kv[1][1][0, 1, 21, 5] = bad
    with pytest.raises(kvbridge.InvalidArgumentError, match=r"NaN or an infinity \(layer 1, V, "
                                                            r"token 21\)"):
        bridge.save(src, list(range(40)), kv)
    with pytest.raises(ValueError):  # InvalidArgumentError is a ValueError
        bridge.save(src, list(range(40)), kv)
    assert bridge.store.match(src, list(range(40)), return_kv=False).tokens == 0
    assert bridge.stats()["nonfinite_refused"] == 2


def test_a_nan_source_entry_is_never_converted(same_tok):
    src, tgt, weights, adapter = same_tok
    bridge = kvbridge.Bridge(kvbridge.KVStore(64 << 20, chunk_tokens=16))
    bridge.add_adapter(adapter)
    tokens = list(range(7, 60))
    s, _ = planted_sample(weights, 53, 0, seed=44)
    s[0][0][0, 0, 30, 2] = float("nan")
    bridge.store.put(src, tokens, s)  # behind the bridge's back
    got = bridge.load(tgt, tokens)
    assert got.tokens == 0 and not got.converted
    assert bridge.store.match(tgt, tokens, return_kv=False).tokens == 0  # nothing written back
    assert bridge.stats()["nonfinite_refused"] == 1


def test_convert_saturates_float16_instead_of_overflowing():
    """Finite float16 input whose converted float32 values exceed 65504: the output saturates
    at +-65504 instead of becoming infinite (bfloat16's limit is within float32's last binade,
    tests/cpp/test_adapter.cpp checks that cast)."""
    src_spec = kvbridge.ModelSpec("s", 2, 2, 8, dtype="float16")
    tgt_spec = kvbridge.ModelSpec("t", 2, 1, 8, dtype="float16")
    src = random_kv(src_spec, 203, 1)
    # Target = 50 x the source's first head: the adapter amplifies.
    tgt = tuple(tuple((50 * t[:, :1].float()).half() for t in pair) for pair in src)
    fitter = kvbridge.AdapterFitter(src_spec, tgt_spec, source_layers="all")
    fitter.add(src, tgt)
    adapter = fitter.fit()
    big = tuple(tuple((t.float() * 1e4).half() for t in pair) for pair in random_kv(src_spec, 37, 3))
    assert all(bool(torch.isfinite(t).all()) for pair in big for t in pair)
    out = adapter.convert(big)
    flat = torch.cat([t.float().flatten() for pair in out for t in pair])
    assert bool(torch.isfinite(flat).all())
    assert flat.abs().max().item() == 65504.0  # saturated, not inf
    assert (flat.abs() == 65504.0).float().mean().item() > 0.1


# ----- the monitor --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair():
    return testbed.load_pair()


@pytest.fixture(scope="module")
def shipped(pair):
    from kvbridge.experiments import eval as ev

    return ev.load_adapter(ev.DEFAULT_ADAPTER, pair)


def test_monitor_counts_nan_logits_as_a_failed_check_and_never_raises(pair, shipped, caplog):
    from kvbridge import monitor
    from kvbridge.experiments import eval as ev

    # recompute_tail 0: the shipped adapter's recorded 96 would leave nothing of this prompt.
    bridge = kvbridge.Bridge(kvbridge.KVStore(64 << 20, chunk_tokens=16),
                             min_quality=float("-inf"), min_agreement=0.5, min_checks=1,
                             recompute_tail=0)
    bridge.add_adapter(shipped)
    mon = monitor.QualityMonitor(bridge, {pair.target.spec: pair.target.model}, sample_rate=1.0)
    prompt = ev.text_windows(pair, "heldout", 60, 1)[0]
    # A converted entry with a NaN, written behind the bridge's back (an older writer).
    kv = hf.prefix_kv(pair.target.model, prompt[:48])
    kv[0][0][0, 0, 3, 0] = float("nan")
    bridge.store.put(pair.target.spec, prompt[:48], kv,
                     converted_from=pair.source.spec.fingerprint, adapter=shipped.fingerprint)
    with caplog.at_level(logging.WARNING, logger="kvbridge.monitor"):
        hit = mon.load(pair.target.spec, prompt)  # must not raise
    assert hit.tokens == 48 and hit.adapter == shipped.fingerprint
    s = mon.stats()
    assert s["checks"] == 1 and s["nonfinite"] == 1 and s["check_errors"] == 0
    h = s["adapters"][shipped.fingerprint]
    assert h["agreement"] == 0.0 and not h["enabled"] and math.isfinite(h["kl"])
    assert "disabled" in caplog.text
    # Disabled and purged: the NaN entry is not served again.
    assert mon.load(pair.target.spec, prompt).tokens == 0


def test_monitor_check_failures_do_not_reach_the_load(pair, shipped, monkeypatch, caplog):
    from kvbridge import monitor
    from kvbridge.experiments import eval as ev

    bridge = kvbridge.Bridge(kvbridge.KVStore(64 << 20, chunk_tokens=16),
                             min_quality=float("-inf"), recompute_tail=0)  # 60-token prompt
    bridge.add_adapter(shipped)
    mon = monitor.QualityMonitor(bridge, {pair.target.spec: pair.target.model}, sample_rate=1.0)
    prompt = ev.text_windows(pair, "heldout", 60, 2)[1]
    bridge.save(pair.source.spec, prompt, hf.prefix_kv(pair.source.model, prompt))

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory in the shadow prefill")

    monkeypatch.setattr(monitor, "compare", broken)
    with caplog.at_level(logging.WARNING, logger="kvbridge.monitor"):
        hit = mon.load(pair.target.spec, prompt)
    assert hit.converted and hit.kv is not None
    assert mon.stats()["check_errors"] == 1 and "out of memory" in caplog.text


def test_compare_logits_with_non_finite_positions():
    from kvbridge import monitor

    g = torch.Generator().manual_seed(3)
    own = torch.randn(4, 11, generator=g)
    conv = own + 0.01 * torch.randn(4, 11, generator=g)
    conv[1, 4] = float("nan")
    conv[2, 0] = float("inf")
    own[3, 7] = float("nan")  # the model's own prefill says nothing here: left out
    c = monitor.compare_logits(own, conv, torch.tensor([5, 6, 7]))
    assert (c.positions, c.agreed, c.nonfinite, c.loss_positions) == (3, 1, 2, 1)
    assert math.isfinite(c.kl_sum) and math.isfinite(c.loss_gap_sum)
    assert c.agreement == pytest.approx(1 / 3)


# ----- the verified prefix ------------------------------------------------------------------


class CountingTokenizer:
    """The testbed byte tokenizer, optionally with a decode that is not prefix-stable (it
    appends a character to the text of more than one token; single tokens decode right, so the
    per-token span check passes and the prefix search has to find the answer), counting decode
    calls and the ids they decoded; it raises past a budget so that a quadratic search fails
    fast instead of running for minutes."""

    def __init__(self, suffix="", budget=None):
        self.suffix, self.budget = suffix, budget
        self.calls = self.multi = self.ids = 0
        self.id = BYTE.id

    def encode_with_offsets(self, text, add_bos=True):
        return BYTE.encode_with_offsets(text, add_bos=add_bos)

    def decode(self, ids):
        self.calls += 1
        self.ids += len(ids)
        self.multi += len(ids) > 1
        if self.budget is not None and self.ids > self.budget:
            raise AssertionError(f"decode budget exceeded after {self.calls} calls")
        return BYTE.decode(ids) + (self.suffix if len(ids) > 1 else "")


def _prompt(n, seed=0):
    rng = np.random.default_rng(seed)
    texts = testbed.texts("train")
    raw = b""
    while len(raw) < n:
        raw += texts[int(rng.integers(len(texts)))].encode("ascii", "ignore") + b" "
    return [BYTE.bos_id] + list(raw[: n - 1])


@pytest.mark.parametrize("suffix", ["", "!"])
def test_verified_prefix_is_linear_at_32k_tokens(suffix):
    n = 32768
    prompt = _prompt(n)
    tok = CountingTokenizer(suffix, budget=40 * n)
    text, (ids, starts, ends, roles) = bridge_mod._verified_prefix(tok, prompt, {})
    # Multi-token decodes: the prompt once, then O(log n) prefixes (the old search: up to n).
    assert tok.multi <= 2 * math.ceil(math.log2(n)) + 4
    assert tok.ids <= 40 * n
    if suffix:  # no prefix of 2 tokens or more decodes to its own text: the BOS alone
        assert ids == [BYTE.bos_id] and text == ""
    else:
        assert ids == prompt and len(text.encode()) == n - 1


def test_verified_prefix_equals_the_linear_search_where_the_property_is_monotone():
    """A decode that garbles the text whenever the prefix ends past a position p (a character
    the tokenizer cannot restore): the search finds exactly the tokens before p."""
    prompt = _prompt(3000, seed=1)
    for p in (1, 2, 7, 1000, 2998, 2999):
        class Garbling(CountingTokenizer):
            def decode(self, ids):
                return super().decode(ids) + ("?" if len(ids) > p else "")

        tok = Garbling()
        _, (ids, _, _, _) = bridge_mod._verified_prefix(tok, prompt, {})
        assert len(ids) == min(p, len(prompt))
        assert tok.multi <= 2 * math.ceil(math.log2(3000)) + 4


# ----- target offsets checked per token -----------------------------------------------------


class Shifted:
    """A tokenizer whose ordinary tokens' byte offsets are shifted `by` bytes right, the last
    end kept correct (the issue's misaligned target)."""

    def __init__(self, inner, by=7):
        self.inner, self.by = inner, by

    def encode_with_offsets(self, text, add_bos=True):
        ids, offsets, roles = kvbridge.token_offsets(self.inner, text, add_bos=add_bos)
        n = len(text.encode())
        shifted = [(s, e) if r is not None else (min(s + self.by, n), min(e + self.by, n))
                   for (s, e), r in zip(offsets, roles)]
        return ids, shifted, roles

    def decode(self, ids, skip_special_tokens=True):
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_misaligned_target_offsets_are_refused(bpe, planted):  # noqa: F811
    weights, adapter = planted
    al = kvbridge.align_text(BYTE, bpe, TEXT)
    from test_align import _planted

    src, _ = _planted(weights, len(al.source_ids), al.index, 0, seed=9)
    # Aligned offsets: served across tokenizers.
    good = make_bridge(bpe, adapter)
    good.save(SRC, al.source_ids, src)
    assert good.load(TGT, al.target_ids).converted
    # The same prompt through a tokenizer with shifted offsets: nothing converted or stored.
    bridge = kvbridge.Bridge(kvbridge.KVStore(64 << 20, chunk_tokens=1))
    bridge.add_tokenizer(SRC, BYTE)
    bridge.add_tokenizer(TGT, Shifted(bpe))
    bridge.add_adapter(adapter)
    bridge.save(SRC, al.source_ids, src)
    got = bridge.load(TGT, al.target_ids)
    assert got.tokens <= 1  # at most the BOS, which aligns by role
    assert bridge.store.match(TGT, al.target_ids, return_kv=False).tokens <= 1
    assert bridge.stats()["unverified_tokens"] >= len(al.target_ids) - 1


def test_spans_check_accepts_partial_characters_and_refuses_shifts(bpe):  # noqa: F811
    text = "Ünïcödé: naïve café, 日本語 and plain ASCII words."
    raw = text.encode()
    for tok in (bpe, BYTE):
        ids, offsets, roles = kvbridge.token_offsets(tok, text)
        assert bridge_mod._spans_hold_their_text(tok, ids, offsets, roles, raw, {}) == len(ids)
        shifted = Shifted(tok, by=1).encode_with_offsets(text)[1]
        first = next(j for j, r in enumerate(roles) if r is None)
        # Pieces of one character are checked loosely (any range holding a non-ASCII
        # character), so a shift may pass those; the first whole character stops it.
        assert bridge_mod._spans_hold_their_text(tok, ids, shifted, roles, raw, {}) <= first + 2


# ----- misbehaving tokenizers ---------------------------------------------------------------


class Raising:
    def __init__(self, inner, error):
        self.inner, self.error = inner, error

    def encode_with_offsets(self, text, add_bos=True):
        raise self.error

    def decode(self, ids, skip_special_tokens=True):
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


class BytesDecode:
    def __init__(self, inner):
        self.inner = inner

    def encode_with_offsets(self, text, add_bos=True):
        return kvbridge.token_offsets(self.inner, text, add_bos=add_bos)

    def decode(self, ids, skip_special_tokens=True):
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens).encode()


@pytest.mark.parametrize("broken", ["source raises", "target raises", "target decodes bytes"])
def test_a_broken_tokenizer_still_serves_the_native_prefix(bpe, planted, broken, caplog):  # noqa: F811
    _, adapter = planted
    bridge = kvbridge.Bridge(kvbridge.KVStore(64 << 20, chunk_tokens=1))
    src_tok, tgt_tok = BYTE, bpe
    if broken == "source raises":
        src_tok = Raising(BYTE, RuntimeError("tokenizer crashed"))
        src_tok.id = BYTE.id
    elif broken == "target raises":
        tgt_tok = Raising(bpe, RuntimeError("tokenizer crashed"))
    else:
        tgt_tok = BytesDecode(bpe)
    bridge.add_tokenizer(SRC, src_tok)
    bridge.add_tokenizer(TGT, tgt_tok)
    bridge.add_adapter(adapter)
    ids = bpe.encode(TEXT).ids
    own = float_kv(TGT, 10, 12)
    bridge.save(TGT, ids[:10], own)
    with caplog.at_level(logging.WARNING, logger="kvbridge.bridge"):
        got = bridge.load(TGT, ids)
    assert got.tokens == 10 and not got.converted
    assert bridge.stats()["tokenizer_errors"] == 1
    if broken == "target decodes bytes":
        assert "BytesDecode" in caplog.text and "returned bytes, expected a str" in caplog.text
    else:
        assert "tokenizer crashed" in caplog.text


def test_align_names_an_offset_beyond_int64():
    huge = np.array([[0, 2**64 - 1]], dtype=np.uint64)
    with pytest.raises(kvbridge.InvalidArgumentError, match="18446744073709551615"):
        kvbridge.align([(0, 1)], huge)
    with pytest.raises(kvbridge.InvalidArgumentError, match="18446744073709551615"):
        kvbridge.align([(0, 1)], [(0, 2**64 - 1)])


# ----- the vLLM connector's device load (imports nothing from vLLM) -------------------------


def _device_load():
    """kvbridge/vllm/device_load.py without the package's __init__, which needs vLLM."""
    path = kvbridge.__file__.replace("__init__.py", "vllm/device_load.py")
    spec = importlib.util.spec_from_file_location("kvbridge_device_load", path)
    module = importlib.util.module_from_spec(spec)
    import sys

    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_device_load_follows_the_bridge_rules(same_tok):
    device_load = _device_load()
    src, tgt, weights, adapter = same_tok
    bridge = kvbridge.Bridge(kvbridge.KVStore(64 << 20, chunk_tokens=16), write_back=False)
    bridge.add_adapter(adapter)
    tokens = list(range(300, 353))
    s, _ = planted_sample(weights, 53, 0, seed=50)
    bridge.save(src, tokens, s)
    got = device_load.load(bridge, tgt, tokens, "default", "cpu")
    assert got.converted and got.tokens == 48
    # Converted KV the adapter cannot keep finite is not used.
    nan = tuple((k.clone(), v.clone()) for k, v in s)
    nan[1][0][0, 1, 40, 3] = float("nan")
    other = list(range(400, 453))
    bridge.store.put(src, other, nan)
    assert device_load.load(bridge, tgt, other, "default", "cpu").tokens == 0
    # Entries naming a dropped adapter are not used.
    derived = float_kv(tgt, 53, 51)
    bridge.store.put(tgt, tokens, derived, converted_from=src.fingerprint,
                     adapter=adapter.fingerprint)
    assert device_load.load(bridge, tgt, tokens, "default", "cpu").adapter == adapter.fingerprint
    bridge.disable_adapter(adapter)
    bridge.store.put(tgt, tokens, derived, converted_from=src.fingerprint,
                     adapter=adapter.fingerprint)  # another process, after the purge
    got = device_load.load(bridge, tgt, tokens, "default", "cpu")
    assert got.tokens == 0 and got.adapter == ""
