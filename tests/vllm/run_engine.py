"""One vLLM engine with KVBridgeConnector (or without a connector), run as its own process by
test_engine.py and test_real_models.py: ``python run_engine.py CONFIG.json OUT.json``.

CONFIG: {"model": "testbed-a" | "testbed-b" | a Hugging Face model folder (served by its path,
float32, with its own tokenizer), "extra": {kv_connector_extra_config} or null for an engine
without the connector, "block_size", "max_model_len" (folders only), "prompts": [[ids...]] or
"texts": [str] (folders only: the engine's tokenizer gives the ids), "max_tokens": int,
"phases": [{"name", "cache_salt", "reset_prefix_cache", "prompts" / "texts" (this phase's,
default the config's), "kill_before" (a pid to SIGKILL before the phase, with "kill_port": a
loopback port to wait on until it refuses connections)}]}. OUT: the connector's spec
fingerprint ("" without one), the seconds the engine took to start, and per phase each prompt's
ids, generated tokens and text, their logprobs and num_cached_tokens, and the connector's stats
after it.
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


def folder_llm(folder: str, extra, block_size: int, max_model_len: int):
    """A vllm.LLM serving the model folder by its path (float32, eager, its own tokenizer), with
    KVBridgeConnector configured by `extra` (None: no connector)."""
    from vllm import LLM

    from kvbridge.experiments.vllm_testbed import connector_config

    opts = dict(model=folder, dtype="float32", block_size=block_size,
                max_model_len=max_model_len, enforce_eager=True, enable_prefix_caching=True,
                max_num_seqs=16, seed=0)
    if extra is not None:
        opts["kv_transfer_config"] = connector_config(dict({"chunk_tokens": block_size}, **extra))
    return LLM(**opts)


def main(config_path: str, out_path: str) -> None:
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvbridge.experiments.vllm_testbed import greedy, testbed_llm, token_prompts

    with open(config_path) as f:
        cfg = json.load(f)
    t0 = time.monotonic()
    testbed = cfg["model"].startswith("testbed-")
    if testbed:
        llm = testbed_llm(cfg["model"], cfg["extra"])
        params = greedy(cfg["max_tokens"], logprobs=True)
    else:
        llm = folder_llm(cfg["model"], cfg["extra"], int(cfg.get("block_size", 32)),
                         int(cfg.get("max_model_len", 1024)))
        params = SamplingParams(temperature=0.0, max_tokens=cfg["max_tokens"], ignore_eos=True,
                                logprobs=0)
    conn = get_kv_transfer_group() if cfg["extra"] is not None else None
    result = {"spec": conn.spec.fingerprint if conn else "",
              "start_seconds": time.monotonic() - t0, "phases": {}}
    for phase in cfg["phases"]:
        if phase.get("kill_before"):
            kill_and_wait(int(phase["kill_before"]), int(phase["kill_port"]))
        reset = None
        if phase.get("reset_prefix_cache"):
            # vLLM refuses (False) while blocks are still held, e.g. by a save in flight: then
            # its own prefix cache could serve what the phase means the connector to serve.
            reset = bool(llm.reset_prefix_cache())
        salt = phase.get("cache_salt")
        texts = phase.get("texts", cfg.get("texts"))
        if "prompts" in phase or texts is None:
            prompts = token_prompts(phase.get("prompts", cfg.get("prompts")), salt)
        else:
            prompts = [dict({"prompt": t}, **({"cache_salt": salt} if salt else {}))
                       for t in texts]
        started = time.monotonic()
        outs = llm.generate(prompts, params, use_tqdm=False)
        rows = []
        for out in outs:
            c = out.outputs[0]
            rows.append({"prompt_ids": list(out.prompt_token_ids or []),
                         "tokens": list(c.token_ids), "text": c.text or "",
                         "logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
                         "num_cached_tokens": int(out.num_cached_tokens or 0)})
        seconds = time.monotonic() - started
        if conn is not None:
            conn.flush()
        result["phases"][phase["name"]] = {"rows": rows, "seconds": seconds, "reset": reset,
                                           "stats": conn.stats() if conn else {}}
    with open(out_path, "w") as f:
        json.dump(result, f, default=float)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
