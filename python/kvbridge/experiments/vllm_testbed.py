"""vLLM engines serving the kvbridge testbed models (for the tests, the example and the
benchmark).

The testbed's byte tokenizer is not a Hugging Face tokenizer, so engines run with
``skip_tokenizer_init=True`` and take token-id prompts; ``tokenizer`` still names its folder,
from which the connector derives the tokenizer id. The CPU attention backend needs a block
size that is a multiple of 32.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence

from kvbridge import _core
from kvbridge.experiments import testbed
from kvbridge._core import InvalidArgumentError

#: Block size (and the connector's chunk) of the testbed engines.
BLOCK_SIZE = 32
#: The shipped testbed-a -> testbed-b adapter.
ADAPTER = testbed.MODELS_DIR.parent / "adapters" / "testbed-a_to_testbed-b.safetensors"


def connector_config(extra: Dict[str, Any]):
    """The KVTransferConfig that enables KVBridgeConnector with `extra`."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector="KVBridgeConnector",
                            kv_connector_module_path="kvbridge.vllm", kv_role="kv_both",
                            kv_connector_extra_config=dict(extra))


def testbed_llm(name: str, extra: Optional[Dict[str, Any]] = None, **kwargs: Any):
    """A vllm.LLM serving testbed model `name` (float32, eager) with KVBridgeConnector
    configured by `extra` (None: no connector); kwargs go to vllm.LLM."""
    from vllm import LLM

    if name not in testbed.MODEL_NAMES:
        raise InvalidArgumentError(f"testbed_llm: expected one of {testbed.MODEL_NAMES}, got {name!r}")
    opts: Dict[str, Any] = dict(
        model=str(testbed.MODELS_DIR / name), tokenizer=str(testbed.tokenizer_folder(name)),
        skip_tokenizer_init=True, served_model_name=name, dtype="float32",
        block_size=BLOCK_SIZE, max_model_len=testbed.MAX_CONTEXT, enforce_eager=True,
        enable_prefix_caching=True, max_num_seqs=16, seed=0)
    if extra is not None:
        opts["kv_transfer_config"] = connector_config(dict({"chunk_tokens": BLOCK_SIZE}, **extra))
    opts.update(kwargs)
    return LLM(**opts)


def greedy(max_tokens: int, logprobs: bool = False):
    """Greedy SamplingParams of exactly `max_tokens` tokens (token ids only)."""
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          logprobs=0 if logprobs else None, detokenize=False)


def token_prompts(prompts: Sequence[Sequence[int]], cache_salt: Optional[str] = None) -> List[dict]:
    """vLLM token-id prompts, with a cache_salt (the connector's tenant) if given."""
    out = []
    for ids in prompts:
        item: Dict[str, Any] = {"prompt_token_ids": [int(t) for t in ids]}
        if cache_salt:
            item["cache_salt"] = cache_salt
        out.append(item)
    return out


def ttft(llm, ids: Sequence[int], cache_salt: Optional[str] = None):
    """(seconds, RequestOutput) of one prompt generating one token: its time to first token
    through the offline API."""
    t0 = time.perf_counter()
    out = llm.generate(token_prompts([ids], cache_salt), greedy(1), use_tqdm=False)[0]
    return time.perf_counter() - t0, out


def heldout_prompts(count: int, min_tokens: int = 120, max_tokens: int = 200,
                    vary: bool = True) -> List[List[int]]:
    """`count` held-out fortunes as token ids ([BOS] + bytes) of at least `min_tokens`,
    truncated to lengths spread over [100, max_tokens] (`vary`) or to `max_tokens`."""
    tok = testbed.load_tokenizer()
    out: List[List[int]] = []
    for text in testbed.texts("heldout"):
        ids = tok.encode(text)
        if len(ids) >= min_tokens:
            n = 100 + (len(out) * 37) % (max_tokens - 100 + 1) if vary else max_tokens
            out.append(ids[:n])
        if len(out) == count:
            return out
    raise InvalidArgumentError(f"heldout_prompts: fewer than {count} held-out fortunes of {min_tokens} "
                               "tokens")


__all__ = ["ADAPTER", "BLOCK_SIZE", "connector_config", "greedy", "heldout_prompts",
           "testbed_llm", "token_prompts", "ttft"]


def damaged_testbed_adapter(pair: Any, directory: str):
    """The shadow checks' damaged adapter (kvbridge.monitor.damaged_adapter on 12 training
    windows of 64 tokens) from a twin of testbed-a's spec named ``testbed-a-damaged`` (so its
    source KV is stored apart from the shipped adapter's) to testbed-b, saved under `directory`
    as damaged.safetensors. pair: testbed.load_pair(). Returns (twin spec, adapter, path)."""
    import os

    from kvbridge import quality
    from kvbridge.experiments.eval import text_windows

    spec_a = pair.source.spec
    fields = {n: getattr(spec_a, n) for n, _, _ in _core.ModelSpec.FIELDS}
    twin = _core.ModelSpec(**dict(fields, name="testbed-a-damaged"))
    adapter = quality.damaged_adapter(pair.source.model, pair.target.model, twin,
                                      pair.target.spec, text_windows(pair, "train", 64, 12))
    path = os.path.join(str(directory), "damaged.safetensors")
    adapter.save(path)
    return twin, adapter, path
