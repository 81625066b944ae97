"""Shadow checks inside vLLM (kvbridge.vllm.shadow).

check_from_logprobs against the float64 full-vocabulary reference (kvbridge.monitor.
compare_logits) needs no engine. The rest share ONE engine serving testbed-b with two adapters:
the shipped testbed-a -> testbed-b one, and a deliberately damaged one (fitted on mismatched
pairs) from "testbed-a-damaged", testbed-a's spec under another name, so both can convert
testbed-a's KV into testbed-b's for different prompts. The engine runs in this process, so the
test saves the sources' KV straight into the connector's store.
"""
import gc
import math
import os

import pytest
import torch

pytest.importorskip("vllm")

import kvbridge  # noqa: E402
from kvbridge import _core, hf, monitor  # noqa: E402
from kvbridge.experiments import testbed  # noqa: E402
from kvbridge.experiments import vllm_testbed as engines  # noqa: E402
from kvbridge.experiments.vllm_testbed import (ADAPTER, greedy, heldout_prompts,  # noqa: E402
                                               token_prompts)
from kvbridge.vllm import shadow  # noqa: E402
from kvbridge.vllm.metadata import OUTCOME_KEY  # noqa: E402

#: The Bridge's default floor (the connector passes the Bridge's defaults through).
FLOOR = dict((n, d) for n, _, d, _ in _core.Bridge.OPTIONS)["min_agreement"]
MIN_CHECKS = 4
CHECK_WINDOW = 16
POSITIONS = 8
NUM_SHIPPED = 8
NUM_DAMAGED = MIN_CHECKS + 2
MAX_TOKENS = 4


# ----------------------------------------------------------------------------- no engine


def _steps(logprobs: torch.Tensor, k: int, next_tokens, round_to=None):
    """Per position a {token: logprob} mapping of the top-k (k=-1: all) plus the true next
    token, as vLLM returns them."""
    lp = logprobs if round_to is None else logprobs.to(round_to).double()
    out = []
    for i in range(lp.shape[0]):
        ids = range(lp.shape[1]) if k == -1 else lp[i].topk(k).indices.tolist()
        step = {int(t): float(lp[i, t]) for t in ids}
        if i < len(next_tokens):
            step[int(next_tokens[i])] = float(lp[i, int(next_tokens[i])])
        out.append(step)
    return out


def _coarse_kl(lp_own, lp_conv, own_steps, conv_steps):
    """KL over the tokens both mappings hold plus one bucket for the rest, in float64 torch."""
    total = 0.0
    for i, (a, b) in enumerate(zip(own_steps, conv_steps)):
        mask = torch.zeros(lp_own.shape[1], dtype=torch.bool)
        mask[[t for t in a if t in b]] = True
        p, q = lp_own[i].exp(), lp_conv[i].exp()
        kl = (p[mask] * (lp_own[i][mask] - lp_conv[i][mask])).sum()
        pr, qr = p[~mask].sum(), q[~mask].sum()
        if pr > 0:
            kl = kl + pr * (pr.log() - qr.log())
        total += max(0.0, float(kl))
    return total


@pytest.fixture
def random_logits():
    """Seeded logits at 7 positions over 37 tokens (odd sizes), the converted ones a noisy
    copy of the own ones (some argmaxes flip), both strided views."""
    gen = torch.Generator().manual_seed(11)
    own = torch.randn(37, 7, generator=gen, dtype=torch.float64).mul(3).t()  # stride (1, 7)
    conv = (own + 1.5 * torch.randn(7, 37, generator=gen, dtype=torch.float64))[:, :]
    assert not own.is_contiguous()
    next_tokens = torch.randint(0, 37, (6,), generator=gen)  # the last position has none
    return own, conv, next_tokens


def test_check_from_full_vocab_logprobs_equals_the_reference(random_logits):
    own, conv, nxt = random_logits
    ref = monitor.compare_logits(own, conv, nxt)
    lp_own, lp_conv = torch.log_softmax(own, -1), torch.log_softmax(conv, -1)
    got = shadow.check_from_logprobs(_steps(lp_own, -1, nxt), _steps(lp_conv, -1, nxt),
                                     nxt.tolist())
    assert 0 < ref.agreed < ref.positions  # the data exercises both outcomes
    assert (got.positions, got.agreed, got.loss_positions) == (ref.positions, ref.agreed,
                                                               ref.loss_positions)
    assert got.kl_sum > 0.1
    assert math.isclose(got.kl_sum, ref.kl_sum, rel_tol=1e-9, abs_tol=1e-12)
    assert math.isclose(got.loss_gap_sum, ref.loss_gap_sum, rel_tol=1e-9, abs_tol=1e-12)


def test_check_from_float32_logprobs_is_close(random_logits):
    """vLLM's logprobs are float32: the rounding moves the figures by float32 amounts only."""
    own, conv, nxt = random_logits
    ref = monitor.compare_logits(own, conv, nxt)
    lp_own, lp_conv = torch.log_softmax(own, -1), torch.log_softmax(conv, -1)
    got = shadow.check_from_logprobs(_steps(lp_own, -1, nxt, torch.float32),
                                     _steps(lp_conv, -1, nxt, torch.float32), nxt.tolist())
    assert got.agreed == ref.agreed
    assert abs(got.kl_sum - ref.kl_sum) < 1e-4
    assert abs(got.loss_gap_sum - ref.loss_gap_sum) < 1e-4


@pytest.mark.parametrize("k", [1, 3, 10])
def test_check_from_top_k_logprobs(random_logits, k):
    """Top-k: agreement and loss gap exact, KL the coarse-grained one (a lower bound)."""
    own, conv, nxt = random_logits
    ref = monitor.compare_logits(own, conv, nxt)
    lp_own, lp_conv = torch.log_softmax(own, -1), torch.log_softmax(conv, -1)
    a, b = _steps(lp_own, k, nxt), _steps(lp_conv, k, nxt)
    got = shadow.check_from_logprobs(a, b, nxt.tolist())
    assert got.agreed == ref.agreed and got.positions == ref.positions
    assert math.isclose(got.loss_gap_sum, ref.loss_gap_sum, rel_tol=1e-9, abs_tol=1e-12)
    assert math.isclose(got.kl_sum, _coarse_kl(lp_own, lp_conv, a, b), rel_tol=1e-9,
                        abs_tol=1e-12)
    assert 0 <= got.kl_sum <= ref.kl_sum + 1e-12


def test_check_from_logprobs_identical_and_errors():
    steps = [{3: -0.1, 5: -2.5, 1: -3.0}, {5: -0.2, 3: -1.8}]
    same = shadow.check_from_logprobs(steps, steps, [5])
    assert (same.agreed, same.kl_sum, same.loss_gap_sum) == (2, 0.0, 0.0)
    # ties go to the lower token id on both sides
    assert shadow.check_from_logprobs([{4: -0.7, 2: -0.7}], [{2: -0.7, 9: -0.9}], []).agreed == 1
    with pytest.raises(ValueError, match="equal non-empty"):
        shadow.check_from_logprobs(steps, steps[:1], [])
    with pytest.raises(ValueError, match="equal non-empty"):
        shadow.check_from_logprobs([], [], [])
    with pytest.raises(ValueError, match="next_tokens"):
        shadow.check_from_logprobs(steps, steps, [5, 3, 1])
    with pytest.raises(ValueError, match="true next token 7"):
        shadow.check_from_logprobs(steps, steps, [7])
    with pytest.raises(ValueError, match="no logprobs"):
        shadow.check_from_logprobs([{}], [{1: 0.0}], [])


def test_quality_options_pass_through_with_the_bridge_defaults():
    from kvbridge.vllm import options

    defaults = {n: d for n, _, d, _ in _core.Bridge.OPTIONS}
    plain = options.parse_options({}, 32)
    assert plain.quality == ()
    for key in options.QUALITY_KEYS:
        assert plain.option(key) == defaults[key]
    given = options.parse_options({"min_agreement": 0.7, "check_window": 9, "min_checks": 3}, 32)
    bridge = kvbridge.Bridge(kvbridge.KVStore(1 << 16, 16), **given.bridge_options())
    assert (bridge.min_agreement, bridge.check_window, bridge.min_checks) == (0.7, 9, 3)
    assert given.option("min_quality") == 0.5


def test_recompute_tail_passes_through_with_the_adapters_own_by_default():
    from kvbridge.vllm import options

    plain = options.parse_options({}, 32)
    assert plain.serving == () and plain.option("recompute_tail") == -1
    bridge = kvbridge.Bridge(kvbridge.KVStore(1 << 16, 16), **plain.bridge_options())
    assert bridge.recompute_tail == -1  # each adapter's recorded tail
    for value in (0, 7, -1):
        given = options.parse_options({"recompute_tail": value}, 32)
        assert given.bridge_options()["recompute_tail"] == value
    for bad in (-2, 1.5, "3"):
        with pytest.raises(ValueError, match="recompute_tail"):
            options.parse_options({"recompute_tail": bad}, 32)


@pytest.mark.parametrize("extra,match", [
    ({"min_agreement": "0.9"}, "min_agreement must be a number"),
    ({"min_checks": 2.5}, "min_checks must be a count"),
    ({"min_agreement": 1.5}, "bad quality option"),
    ({"check_window": 4, "min_checks": 5}, "bad quality option"),
    ({"check_window": 0}, "bad quality option"),
])
def test_quality_options_rejected(extra, match):
    from kvbridge.vllm import options

    with pytest.raises(ValueError, match=match):
        options.parse_options(extra, 32)


def test_shadow_params_of_a_request():
    from types import SimpleNamespace

    from kvbridge.vllm.metadata import SHADOW_KEY
    from kvbridge.vllm.scheduler import shadow_params

    def parse(params):
        return shadow_params(SimpleNamespace(kv_transfer_params=params))

    assert parse(None) == ("", None, 0)
    assert parse({"namespace": "t"}) == ("", None, 0)
    assert parse({SHADOW_KEY: {"role": "own"}}) == ("own", None, 0)
    assert parse({SHADOW_KEY: {"role": "converted", "namespace": "t", "positions": 8}}) == (
        "converted", "t", 8)
    for bad in ({"role": "twin"}, {"role": "converted"}, "own",
                {"role": "converted", "namespace": "t", "positions": 0},
                {"role": "converted", "namespace": "t", "positions": True}):
        with pytest.raises(ValueError, match=SHADOW_KEY):
            parse({SHADOW_KEY: bad})


def test_disabled_adapters_are_not_probed(tmp_path):
    """The scheduler's probe skips an adapter the Bridge disabled, and sees it again once
    re-enabled; loads report the adapter behind their tokens."""
    from kvbridge.vllm import metadata, options, registry, worker

    shipped = kvbridge.LinearAdapter.load(str(ADAPTER))
    shared = registry.Shared(options.parse_options({"adapters": [str(ADAPTER)]}, 32),
                               shipped.target)
    assert [a.fingerprint for a in shared.usable_adapters()] == [shipped.fingerprint]
    assert shared.bridge.disable_adapter(shipped)
    assert shared.usable_adapters() == []
    assert shared.bridge.enable_adapter(shipped)
    assert [a.fingerprint for a in shared.usable_adapters()] == [shipped.fingerprint]
    # hit_info: "" for the model's own KV
    spec = shipped.target
    gen = torch.Generator().manual_seed(3)
    tokens = list(range(7, 7 + 40))
    kv = tuple((torch.randn(1, spec.num_kv_heads, 32, spec.head_dim, generator=gen),
                torch.randn(1, spec.num_kv_heads, 32, spec.head_dim, generator=gen))
               for _ in range(spec.num_layers))
    shared.bridge.save(spec, tokens[:32], kv)
    from kvbridge.vllm import paged

    layers = [paged.kv_views(torch.zeros(2, spec.num_kv_heads, 32, 2 * spec.head_dim), "cpu",
                             spec.head_dim) for _ in range(spec.num_layers)]
    info = {}
    op = metadata.LoadOp("r", tokens, "default", 0, 32, [1])
    assert worker.load_into_blocks(shared.bridge, spec, layers, 32, op, info) == (32, False,
                                                                                    set())
    assert info == {"converted_from": "", "adapter": ""}


# ----------------------------------------------------------------------------- one engine


def _loaded(out):
    """(tokens loaded, adapter) of a finished request, from the connector's outcome."""
    found = (out.kv_transfer_params or {}).get(OUTCOME_KEY) or {}
    return int(found.get("tokens_loaded", 0)), found.get("adapter", "")


def _health(stats, adapter):
    return stats["connector"]["adapters"][adapter.fingerprint]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Every phase against one engine; the tests below assert on what each phase saw."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the connector lives in this process
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    tmp = tmp_path_factory.mktemp("shadow")
    pair = testbed.load_pair()
    spec_a, spec_b = pair.source.spec, pair.target.spec
    twin_spec, damaged, damaged_path = engines.damaged_testbed_adapter(pair, tmp)
    shipped = kvbridge.LinearAdapter.load(str(ADAPTER))

    llm = engines.testbed_llm("testbed-b", {"adapters": [str(ADAPTER), str(damaged_path)],
                                    "min_quality": float("-inf"), "min_checks": MIN_CHECKS,
                                    "check_window": CHECK_WINDOW},
                      worker_extension_cls=shadow.EXTENSION, max_logprobs=-1)
    conn = get_kv_transfer_group()
    prompts = heldout_prompts(NUM_SHIPPED + NUM_DAMAGED)
    good, bad = prompts[:NUM_SHIPPED], prompts[NUM_SHIPPED:]
    for p in good:
        conn.bridge.save(spec_a, p, hf.prefix_kv(pair.source.model, p))
    for p in bad:
        conn.bridge.save(twin_spec, p, hf.prefix_kv(pair.source.model, p))
    params = greedy(MAX_TOKENS)
    r = {"pair": pair, "shipped": shipped, "damaged": damaged, "good": good, "bad": bad,
         "conn": conn}

    sc = shadow.ShadowChecks(llm, sample_rate=1.0, seed=0, positions=POSITIONS)
    r["good_out"] = sc.generate(token_prompts(good), params, use_tqdm=False)
    r["after_good"] = sc.stats()
    conn.flush()  # the user requests' saves, with the conversion's provenance
    r["good_written"] = [conn.bridge.store.match(spec_b, p, return_kv=False) for p in good]
    # The same checks again, returned, against the Hugging Face model in float64 (below).
    r["good_checks"] = sc.check(r["good_out"][:3])
    r["hf_checks"] = []
    for p in good[:3]:
        hit = conn.bridge.load(spec_b, p)
        r["hf_checks"].append(monitor.compare(pair.target.model, p, hit.kv, POSITIONS))
    r["bad_first"] = sc.generate(token_prompts(bad[:MIN_CHECKS - 1]), params, use_tqdm=False)
    r["before_catch"] = sc.stats()
    r["bad_catch"] = sc.generate(token_prompts(bad[MIN_CHECKS - 1:MIN_CHECKS]), params,
                                 use_tqdm=False)
    r["after_catch"] = sc.stats()
    r["metrics"] = sc.metrics_text()
    r["fallback"] = sc.generate(token_prompts(bad[MIN_CHECKS:] + bad[:1]), params,
                                use_tqdm=False)
    # the model's own prefill of the same prompts (another tenant: nothing to load)
    r["own"] = llm.generate(token_prompts(bad[MIN_CHECKS:] + bad[:1], "own-prefill"), params,
                            use_tqdm=False)
    r["after_fallback"] = sc.stats()
    r["enabled"] = sc.enable(damaged.fingerprint)
    r["enable_unknown"] = sc.enable("0" * 32)
    # bad[1] was converted before the disable (which reset vLLM's prefix cache and purged the
    # written-back entries) and not served since: a converted load again
    r["reenabled"] = sc.generate(token_prompts(bad[1:2]), params, use_tqdm=False)
    r["after_enable"] = sc.stats()
    plain = shadow.ShadowChecks(llm, sample_rate=0.0)
    r["plain"] = plain.generate(token_prompts(good[:4]), params, use_tqdm=False)
    r["plain_stats"] = plain.stats()
    r["direct"] = llm.generate(token_prompts(good[:4]), params, use_tqdm=False)
    r["bad_config"] = []
    for kwargs in ({"sample_rate": 1.5}, {"positions": 0}, {"logprobs": 0}):
        try:
            shadow.ShadowChecks(llm, **kwargs)
        except ValueError as e:
            r["bad_config"].append(str(e))
    yield r
    del llm, sc, plain, conn
    gc.collect()


def test_converted_loads_report_their_adapter(run):
    for out in run["good_out"]:
        tokens, adapter = _loaded(out)
        assert tokens > 0 and out.num_cached_tokens == tokens
        assert adapter == run["shipped"].fingerprint
    for out in run["bad_first"] + run["bad_catch"]:
        assert _loaded(out)[1] == run["damaged"].fingerprint


def test_shipped_adapter_stays_enabled(run):
    s = run["after_good"]
    h = _health(s, run["shipped"])
    print(f"shipped adapter, {h['checks']} checks: agreement {h['agreement']:.3f}, KL "
          f"{h['kl']:.4f}, loss gap {h['loss_gap']:+.4f}")
    assert s["eligible"] == s["sampled"] == s["checks"] == NUM_SHIPPED and s["skipped"] == 0
    assert h["enabled"] and h["checks"] == NUM_SHIPPED and h["disables"] == 0
    assert h["window_positions"] == NUM_SHIPPED * POSITIONS
    assert h["agreement"] >= FLOOR
    assert 0 < h["kl"] < 0.5 and abs(h["loss_gap"]) < 0.5
    c = s["connector"]
    assert c["shadow_checks"] == NUM_SHIPPED and c["shadow_loads"] == NUM_SHIPPED
    assert c["shadow_disables"] == 0
    # the twins wrote nothing: saves are the user requests' only, stored as derived from the
    # shipped adapter (the connector's Bridge writes nothing back itself)
    assert c["saves"] == NUM_SHIPPED and c["save_errors"] == 0
    assert run["conn"].bridge.stats()["written_back_tokens"] == 0
    for written in run["good_written"]:
        assert written.tokens > 0 and written.adapter == run["shipped"].fingerprint
        assert written.converted_from == run["shipped"].source.fingerprint
    assert _health(run["after_catch"], run["shipped"])["enabled"]


def test_vllm_checks_match_the_float64_model(run):
    """The checks made from vLLM's logprobs equal kvbridge.monitor.compare's on the Hugging
    Face model (float64 figures from its float32 logits) for the same prompts and cut."""
    for got, ref in zip(run["good_checks"], run["hf_checks"]):
        assert got is not None
        assert (got.positions, got.loss_positions) == (ref.positions, ref.loss_positions)
        assert abs(got.agreed - ref.agreed) <= 1  # a near-tie may flip between kernels
        assert abs(got.kl_sum - ref.kl_sum) <= 1e-3 + 1e-2 * ref.kl_sum
        assert abs(got.loss_gap_sum - ref.loss_gap_sum) <= 1e-3 + 1e-2 * abs(ref.loss_gap_sum)


def test_damaged_adapter_is_disabled_within_min_checks(run):
    before = _health(run["before_catch"], run["damaged"])
    assert before["enabled"] and before["checks"] == MIN_CHECKS - 1
    s = run["after_catch"]
    h = _health(s, run["damaged"])
    print(f"damaged adapter, {h['checks']} checks: agreement {h['agreement']:.3f}, KL "
          f"{h['kl']:.4f}, loss gap {h['loss_gap']:+.4f}")
    assert not h["enabled"] and h["checks"] == MIN_CHECKS and h["disables"] == 1
    assert h["agreement"] < FLOOR
    assert s["disables"] == 1
    assert s["connector"]["shadow_disables"] == 1
    assert s["connector"]["bridge"]["quality_disables"] == 1


def test_disabled_adapter_loads_fall_back_to_own_prefill(run):
    for out, own in zip(run["fallback"], run["own"]):
        assert out.num_cached_tokens == 0 and _loaded(out)[0] == 0
        assert list(out.outputs[0].token_ids) == list(own.outputs[0].token_ids)
    s = run["after_fallback"]
    assert s["checks"] == run["after_catch"]["checks"]  # nothing converted, nothing checked
    assert s["connector"]["bridge"]["adapters_disabled"] == 1


def test_reenable(run):
    assert run["enabled"] and not run["enable_unknown"]
    out = run["reenabled"][0]
    assert out.num_cached_tokens > 0 and _loaded(out)[1] == run["damaged"].fingerprint
    h = _health(run["after_enable"], run["damaged"])
    assert h["enabled"] and h["window_checks"] == 1  # a fresh window: not judged yet
    assert run["after_enable"]["enables"] == 1


def test_prometheus_shows_per_adapter_figures(run):
    text = run["metrics"]
    for adapter, enabled in ((run["shipped"], 1), (run["damaged"], 0)):
        fp = adapter.fingerprint
        assert f'kvbridge_bridge_adapter_enabled{{adapter="{fp}"' in text
        line = next(x for x in text.splitlines()
                    if x.startswith(f'kvbridge_bridge_adapter_enabled{{adapter="{fp}"'))
        assert float(line.rsplit(" ", 1)[1]) == enabled
        assert f'kvbridge_bridge_adapter_agreement{{adapter="{fp}"' in text
    assert "kvbridge_bridge_quality_disables_total 1" in text


def test_sample_rate_zero_is_plain_generate(run):
    for a, b in zip(run["plain"], run["direct"]):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
    s = run["plain_stats"]
    assert s["eligible"] == s["sampled"] == s["checks"] == 0
    assert s["connector"]["shadow_checks"] == run["after_enable"]["connector"]["shadow_checks"]


def test_bad_configuration_is_refused(run):
    assert len(run["bad_config"]) == 3
    assert "sample_rate" in run["bad_config"][0] and "positions" in run["bad_config"][1]
    assert "logprobs" in run["bad_config"][2]
