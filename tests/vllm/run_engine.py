"""One vLLM engine serving a testbed model with KVBridgeConnector, run as its own process by
test_engine.py: ``python run_engine.py CONFIG.json OUT.json``.

CONFIG: {"model": "testbed-a" | "testbed-b", "extra": {kv_connector_extra_config},
"prompts": [[ids...]], "max_tokens": int, "phases": [{"name", "cache_salt",
"reset_prefix_cache", "prompts" (this phase's, default the config's), "kill_before" (a pid to
SIGKILL before the phase, with "kill_port": a loopback port to wait on until it refuses
connections)}]}. OUT: the connector's spec fingerprint and, per phase, each prompt's generated
tokens, their logprobs and num_cached_tokens, and the connector's stats after it.
"""
import json
import os
import signal
import socket
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# The engine core runs in this process, so the connector's stats() and flush() are reachable.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def kill_and_wait(pid: int, port: int, timeout_s: float = 10.0) -> None:
    """SIGKILLs `pid` and waits until nothing listens on loopback `port` any more."""
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        except OSError:
            return
        time.sleep(0.02)
    raise RuntimeError(f"process {pid} still listens on port {port} after SIGKILL")


def main(config_path: str, out_path: str) -> None:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvbridge.vllm.testbed import greedy, testbed_llm, token_prompts

    with open(config_path) as f:
        cfg = json.load(f)
    llm = testbed_llm(cfg["model"], cfg["extra"])
    conn = get_kv_transfer_group()
    result = {"spec": conn.spec.fingerprint, "phases": {}}
    for phase in cfg["phases"]:
        if phase.get("kill_before"):
            kill_and_wait(int(phase["kill_before"]), int(phase["kill_port"]))
        if phase.get("reset_prefix_cache"):
            llm.reset_prefix_cache()
        prompts = phase.get("prompts", cfg["prompts"])
        outs = llm.generate(token_prompts(prompts, phase.get("cache_salt")),
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
