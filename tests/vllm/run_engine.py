"""One vLLM engine serving a testbed model with KVBridgeConnector, run as its own process by
test_engine.py: ``python run_engine.py CONFIG.json OUT.json``.

CONFIG: {"model": "testbed-a" | "testbed-b", "extra": {kv_connector_extra_config},
"prompts": [[ids...]], "max_tokens": int, "phases": [{"name", "cache_salt",
"reset_prefix_cache"}]}. OUT: the connector's spec fingerprint and, per phase, each prompt's
generated tokens, their logprobs and num_cached_tokens, and the connector's stats after it.
"""
import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# The engine core runs in this process, so the connector's stats() and flush() are reachable.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main(config_path: str, out_path: str) -> None:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvbridge.vllm.testbed import greedy, testbed_llm, token_prompts

    with open(config_path) as f:
        cfg = json.load(f)
    llm = testbed_llm(cfg["model"], cfg["extra"])
    conn = get_kv_transfer_group()
    result = {"spec": conn.spec.fingerprint, "phases": {}}
    for phase in cfg["phases"]:
        if phase.get("reset_prefix_cache"):
            llm.reset_prefix_cache()
        outs = llm.generate(token_prompts(cfg["prompts"], phase.get("cache_salt")),
                            greedy(cfg["max_tokens"], logprobs=True), use_tqdm=False)
        rows = []
        for out in outs:
            c = out.outputs[0]
            rows.append({"tokens": list(c.token_ids),
                         "logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
                         "num_cached_tokens": int(out.num_cached_tokens or 0)})
        conn.flush()
        result["phases"][phase["name"]] = {"rows": rows, "stats": conn.stats()}
    with open(out_path, "w") as f:
        json.dump(result, f, default=float)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
