"""KVBridgeConnector with real pretrained models on vLLM's CPU engine: SmolLM2-135M (Llama) and
Gemma-3-270M (15 sliding-window layers, 3 full), each served from its kvbridge.models folder by
its path. Seven engine processes, one after another (about a minute each here):

- S0, G0: vLLM without the connector (the reference outputs);
- S1, G1: with the connector and a fresh disk store: the engines' own prefill (must equal S0 /
  G0), saving every prompt;
- S2: a new SmolLM2 process loads its prompts from the disk (same-model reuse);
- G2: a new Gemma process with a SmolLM2 -> Gemma adapter (fitted here on 12 windows, saved to a
  file, given through ``adapters``) loads Gemma's own prompts (one of them past the 512-token
  window; SmolLM2 saved its copies of them in another tenant), then answers texts only SmolLM2 saw from SmolLM2's cache across tokenizers, then
  repeats them after resetting vLLM's prefix cache (native hits on what the converted requests
  saved).

The adapter is fitted on little data (its quality is another matter): the converted answers are
checked to be served by the connector and well formed, not to match Gemma's own prefill.
"""
import json
import threading
import time

import pytest

pytest.importorskip("vllm")

from real_models import GEMMA3, SMOLLM2, folder  # noqa: E402
from test_engine import assert_same_greedy_output, expected_loaded, run_engine  # noqa: E402

MAX_TOKENS = 8
BLOCK_SIZE = 32
MAX_MODEL_LEN = 1024
#: Gemma-3-270M's sliding window: one same-model prompt is longer.
GEMMA_WINDOW = 512
SHORT_PROMPTS, ACROSS_PROMPTS = 4, 3
SMOL_TENANT = "smollm2-own"


def distinct_windows(files, window_bytes, count):
    """`count` corpus windows whose openings differ (no two share a first chunk, so vLLM's own
    prefix cache never serves one prompt from another)."""
    from kvbridge.experiments import corpus

    out, seen = [], set()
    for text in corpus.windows(files, window_bytes, 4 * count):
        if text[:160] not in seen:
            seen.add(text[:160])
            out.append(text)
        if len(out) == count:
            return out
    raise AssertionError(f"fewer than {count} distinct windows of {window_bytes} bytes")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    smol_path, why = folder(SMOLLM2)
    if smol_path is None:
        pytest.skip(why)
    gemma_path, why = folder(GEMMA3)
    if gemma_path is None:
        pytest.skip(why)
    from kvbridge import models
    from kvbridge.experiments import corpus, real_eval

    tmp = tmp_path_factory.mktemp("real")
    train, heldout = corpus.split_files(corpus.stdlib_files())
    short = distinct_windows(heldout[:20], 768, SHORT_PROMPTS + ACROSS_PROMPTS)
    same, across = short[:SHORT_PROMPTS], short[SHORT_PROMPTS:]
    same.append(distinct_windows(heldout[20:], 2400, 1)[0])  # past Gemma's window
    # The adapter: SmolLM2 -> Gemma on 12 training windows (well under a minute on a quiet
    # machine), fitted in a thread while the engines that do not need it run.
    adapter_path = tmp / "smollm2-135m_to_gemma3-270m.safetensors"
    fitted = {}

    def fit():
        try:
            smol, gemma = models.load(smol_path), models.load(gemma_path)
            fitted["specs"] = {"smol": smol.spec, "gemma": gemma.spec}
            started = time.monotonic()
            adapter = real_eval.fit(real_eval.Pair(smol, gemma), corpus.windows(train, 768, 12),
                                    real_eval.RealConfig(window_bytes=768, source_layers="2"),
                                    progress=False)
            fitted["seconds"] = time.monotonic() - started
            adapter.save(str(adapter_path))
        except BaseException as e:  # raised again in the fixture
            fitted["error"] = e

    fitter = threading.Thread(target=fit, name="fit-adapter", daemon=True)
    fitter.start()

    disk = str(tmp / "kv")
    base = {"block_size": BLOCK_SIZE, "max_model_len": MAX_MODEL_LEN, "max_tokens": MAX_TOKENS}

    def engine(name, model, extra, phases):
        return run_engine(tmp, name, dict(base, model=str(model), extra=extra, phases=phases))

    out = {"same": same, "across": across}
    out["S0"] = engine("S0", smol_path, None, [{"name": "own", "texts": same + across}])
    # SmolLM2's copies of Gemma's same-model texts live in another tenant (cache_salt): in the
    # default namespace the adapter would extend Gemma's own whole chunks by converted tokens.
    out["S1"] = engine("S1", smol_path, {"disk_dir": disk},
                       [{"name": "save", "texts": same, "cache_salt": SMOL_TENANT},
                        {"name": "save-across", "texts": across}])
    out["S2"] = engine("S2", smol_path, {"disk_dir": disk},
                       [{"name": "load", "texts": same, "cache_salt": SMOL_TENANT}])
    out["G0"] = engine("G0", gemma_path, None, [{"name": "own", "texts": same + across}])
    out["G1"] = engine("G1", gemma_path, {"disk_dir": disk}, [{"name": "save", "texts": same}])
    fitter.join()
    if "error" in fitted:
        raise fitted["error"]
    out["specs"] = fitted["specs"]
    print(f"adapter fitted in {fitted['seconds']:.1f} s")
    out["G2"] = engine("G2", gemma_path, {
        "disk_dir": disk, "adapters": [str(adapter_path)], "tokenizers": [str(smol_path)],
        # the small adapter's held-out R² is far below the Bridge's default floor
        "min_quality": -1e30,
    }, [{"name": "native", "texts": same}, {"name": "converted", "texts": across},
        {"name": "repeat", "texts": across, "reset_prefix_cache": True}])
    for name in ("S0", "S1", "S2", "G0", "G1", "G2"):
        print(f"engine {name}: started in {out[name]['start_seconds']:.1f} s; phases "
              + ", ".join(f"{k} {v['seconds']:.1f} s" for k, v in out[name]["phases"].items()))
    (tmp / "runs.json").write_text(json.dumps({k: v for k, v in out.items() if k != "specs"},
                                              default=str))
    return out


def rows(runs, engine, phase):
    return runs[engine]["phases"][phase]["rows"]


def stats(runs, engine, phase):
    return runs[engine]["phases"][phase]["stats"]


def test_engines_derive_the_models_specs(runs):
    """The connector's spec of a folder served by its path is kvbridge.models.load's."""
    assert runs["S1"]["spec"] == runs["specs"]["smol"].fingerprint
    assert runs["G1"]["spec"] == runs["G2"]["spec"] == runs["specs"]["gemma"].fingerprint


@pytest.mark.parametrize("model", ["S", "G"])
def test_the_connector_leaves_the_engines_own_output_alone(runs, model):
    """With the connector and nothing to load (S1, G1: fresh store, new process), the engine's
    output is vLLM's without the connector (S0, G0); for Gemma the connector also turns vLLM's
    hybrid KV cache manager off (every layer keeps every token's blocks)."""
    phases = ("save", "save-across") if model == "S" else ("save",)
    saved = [r for p in phases for r in rows(runs, f"{model}1", p)]
    n = len(saved)
    assert_same_greedy_output(rows(runs, f"{model}0", "own")[:n], saved)
    assert all(r["num_cached_tokens"] == 0 for r in saved)
    st = stats(runs, f"{model}1", phases[-1])
    assert st["saves"] == n and st["save_errors"] == 0 and st["tokens_loaded"] == 0
    assert st["tokens_saved"] == sum(len(r["prompt_ids"]) // BLOCK_SIZE * BLOCK_SIZE
                                     for r in saved)


@pytest.mark.parametrize("model,engine,phase", [("S", "S2", "load"), ("G", "G2", "native")])
def test_same_model_reuse_across_processes(runs, model, engine, phase):
    """A new engine process serves the saved prompts from the disk store: every whole chunk
    (at most the prompt minus one token) came from the connector (vLLM's own prefix cache is
    empty in a new process), and the output is vLLM's own without the connector: the same
    greedy tokens, logprobs within LOGPROB_TOL."""
    own = rows(runs, f"{model}0", "own")[:len(runs["same"])]
    loaded = rows(runs, engine, phase)
    for o, r in zip(own, loaded):
        assert r["prompt_ids"] == o["prompt_ids"]
        assert r["num_cached_tokens"] == expected_loaded(r["prompt_ids"]) > 0
    st = stats(runs, engine, phase)
    assert st["loads_native"] == len(loaded) and st["loads_converted"] == 0
    assert st["load_errors"] == 0
    assert st["tokens_loaded"] == sum(r["num_cached_tokens"] for r in loaded)
    assert_same_greedy_output(own, loaded)


def test_gemma_prompt_past_its_sliding_window(runs):
    """The long prompt is past Gemma's 512-token window: its sliding-window layers' blocks
    before the window were saved and loaded too, and the output is vLLM's own."""
    long_row = rows(runs, "G2", "native")[-1]
    assert len(long_row["prompt_ids"]) > GEMMA_WINDOW + BLOCK_SIZE
    assert long_row["num_cached_tokens"] == expected_loaded(long_row["prompt_ids"])
    assert long_row["tokens"] == rows(runs, "G0", "own")[len(runs["same"]) - 1]["tokens"]


def test_gemma_answers_from_smollm2s_cache_across_tokenizers(runs):
    """Texts only SmolLM2 saw: Gemma's engine tokenizes them, the connector finds SmolLM2's
    cache of the same text through the registered tokenizers (as Bridge.load does), converts
    it through the adapter file and vLLM serves those tokens from it."""
    before, after = stats(runs, "G2", "native"), stats(runs, "G2", "converted")
    conv = rows(runs, "G2", "converted")
    own = rows(runs, "G0", "own")[len(runs["same"]):]
    assert all(r["num_cached_tokens"] >= BLOCK_SIZE for r in conv), \
        [r["num_cached_tokens"] for r in conv]
    for key, want in (("loads_converted", len(conv)), ("lookup_hits_converted", len(conv)),
                      ("loads_native", 0), ("load_errors", 0),
                      ("tokens_loaded", sum(r["num_cached_tokens"] for r in conv))):
        assert after[key] - before[key] == want, key
    assert after["bridge"]["unverified_tokens"] >= 0 and after["bridge"]["tokenizer_errors"] == 0
    for o, r in zip(own, conv):  # well formed: Gemma's own ids, the requested length, text
        assert r["prompt_ids"] == o["prompt_ids"]
        assert len(r["tokens"]) == MAX_TOKENS and all(0 <= t < 262144 for t in r["tokens"])
        assert isinstance(r["text"], str) and all(lp <= 0 for lp in r["logprobs"])
    agree = sum(o["tokens"][0] == r["tokens"][0] for o, r in zip(own, conv))
    print(f"G2 converted from SmolLM2: {[r['num_cached_tokens'] for r in conv]} of "
          f"{[len(r['prompt_ids']) for r in conv]} prompt tokens; first token as Gemma's own "
          f"prefill on {agree}/{len(conv)}")


def test_converted_requests_are_saved_and_repeat_natively(runs):
    """What the converted requests computed was saved (with the adapter's provenance): after
    vLLM's prefix cache is reset the same texts are native hits of every whole chunk."""
    conv, rep = stats(runs, "G2", "converted"), stats(runs, "G2", "repeat")
    assert rep["loads_native"] - conv["loads_native"] == len(runs["across"])
    assert rep["loads_converted"] == conv["loads_converted"]
    assert rep["save_errors"] == 0 and rep["saves_purged"] == 0
    for r in rows(runs, "G2", "repeat"):
        assert r["num_cached_tokens"] == expected_loaded(r["prompt_ids"])
        assert len(r["tokens"]) == MAX_TOKENS
