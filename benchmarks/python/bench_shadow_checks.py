"""Shadow checks inside vLLM on the testbed (benchmarks/recorded/175-shadow-checks.md): testbed-b
served with the shipped testbed-a -> testbed-b adapter and a damaged one (fitted on mismatched
pairs, from testbed-a's spec under another name), the Bridge's default floor, every converted
request checked. Prints per adapter the checks, rolling agreement, KL, loss gap, the check at
which it was disabled, and the time of the users' batches and of their checks.

    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python benchmarks/python/bench_shadow_checks.py \
        [--prompts 24] [--logprobs -1]
"""
import argparse
import json
import os
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=24, help="held-out prompts per adapter")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--positions", type=int, default=8)
    ap.add_argument("--logprobs", type=int, default=-1,
                    help="logprobs per position of the twins: -1 the whole vocabulary (exact "
                         "KL), k a top-k list (KL a lower bound)")
    args = ap.parse_args()

    import tempfile

    import kvbridge
    from kvbridge import hf
    from kvbridge.experiments import testbed
    from kvbridge.experiments import vllm_testbed as engines
    from kvbridge.vllm import shadow
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    pair = testbed.load_pair()
    spec_a = pair.source.spec
    twin, damaged, path = engines.damaged_testbed_adapter(pair, tempfile.mkdtemp())
    shipped = kvbridge.LinearAdapter.load(str(engines.ADAPTER))
    llm = engines.testbed_llm("testbed-b", {"adapters": [str(engines.ADAPTER), path],
                                            "min_quality": float("-inf")},
                              worker_extension_cls=shadow.EXTENSION, max_logprobs=-1)
    conn = get_kv_transfer_group()
    prompts = engines.heldout_prompts(2 * args.prompts)
    sets = {"shipped": (shipped, spec_a, prompts[:args.prompts]),
            "damaged": (damaged, twin, prompts[args.prompts:])}
    for _, spec, ps in sets.values():
        for p in ps:
            conn.bridge.save(spec, p, hf.prefix_kv(pair.source.model, p))
    sc = shadow.ShadowChecks(llm, sample_rate=1.0, seed=0, positions=args.positions,
                             logprobs=args.logprobs)
    params = engines.greedy(8)
    result = {"options": {k: conn.bridge.__getattribute__(k)
                          for k in ("min_agreement", "check_window", "min_checks")},
              "positions": args.positions, "logprobs": args.logprobs, "adapters": {}}
    for name, (adapter, _, ps) in sets.items():
        serve = check = 0.0
        converted = disabled_at = 0
        for i in range(0, len(ps), args.batch):
            t0 = time.perf_counter()
            outs = llm.generate(engines.token_prompts(ps[i:i + args.batch]), params,
                                use_tqdm=False)
            t1 = time.perf_counter()
            conv = [o for o in outs if sc._eligible(o) and sc._draw()]
            converted += len(conv)
            if conv:
                sc.check(conv)
            check += time.perf_counter() - t1
            serve += t1 - t0
            h = sc.stats()["connector"]["adapters"][adapter.fingerprint]
            if not h["enabled"] and not disabled_at:
                disabled_at = h["checks"]
        h = sc.stats()["connector"]["adapters"][adapter.fingerprint]
        result["adapters"][name] = {
            "fingerprint": adapter.fingerprint, "requests": len(ps),
            "converted_requests": converted, "checks": h["checks"],
            "window_positions": h["window_positions"], "agreement": h["agreement"],
            "kl": h["kl"], "loss_gap": h["loss_gap"], "enabled": h["enabled"],
            "disabled_at_check": disabled_at, "serve_seconds": serve, "check_seconds": check}
    result["loadavg"] = open("/proc/loadavg").read().split()[:3]
    print("RESULT " + json.dumps(result, default=float))


if __name__ == "__main__":
    main()
