"""Profiles kvbridge's load in the engine step (kvbridge.vllm.worker.WorkerSide.load_op,
cProfile) for the prompts a vs_lmcache.py sitting saved: a new SmolLM2 engine on that
sitting's kvbridge store serves each prompt once, as vs_lmcache.py's engine B does.

    .venv-lmcache/bin/python benchmarks/vllm/profile_load.py WORK/r2-kvbridge-B.json [--top 25]

WORK/r2-kvbridge-B.json is the engine config vs_lmcache.py wrote (its prompts, model and store
folder). Prints per prompt the load's wall time and TTFT, then the profile of all loads.
"""
import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.path.insert(0, HERE)
    import vs_lmcache
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from kvbridge.vllm import worker

    with open(args.config) as f:
        cfg = json.load(f)
    vs_lmcache.hide_llvmlite_from_kernel_scan()
    prof = cProfile.Profile()
    load_op = worker.WorkerSide.load_op
    walls = []

    def profiled(self, op):
        t = time.perf_counter()
        prof.enable()
        try:
            return load_op(self, op)
        finally:
            prof.disable()
            walls.append(time.perf_counter() - t)

    worker.WorkerSide.load_op = profiled
    llm = LLM(model=cfg["model"], dtype="float32", block_size=vs_lmcache.BLOCK_SIZE,
              max_model_len=cfg["max_model_len"], enforce_eager=True, enable_prefix_caching=True,
              max_num_seqs=16, seed=0, kv_transfer_config=KVTransferConfig(
                  kv_connector="KVBridgeConnector", kv_connector_module_path="kvbridge.vllm",
                  kv_role="kv_both",
                  kv_connector_extra_config=dict({"chunk_tokens": vs_lmcache.BLOCK_SIZE},
                                                 **cfg["extra"])))
    one = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate(["A short warm-up."], one, use_tqdm=False)
    for item in cfg["prompts"]:
        llm.reset_prefix_cache()
        n = len(walls)
        t = time.perf_counter()
        out = llm.generate([item["text"]], one, use_tqdm=False)[0]
        ttft = time.perf_counter() - t
        load = sum(walls[n:])
        print(f"{item['length']} tokens: TTFT {1e3 * ttft:.0f} ms, {out.num_cached_tokens} "
              f"from the connector, load_op {1e3 * load:.0f} ms")
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(args.top)
    print(s.getvalue())


if __name__ == "__main__":
    main()
