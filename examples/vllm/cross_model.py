"""Engine B answers prompts from engine A's converted prompt caches, inside vLLM.

Engine A (testbed-a) prefills held-out prompts and its KVBridgeConnector saves them to a disk
directory; then engine B (testbed-b, another model) starts with the shipped testbed-a ->
testbed-b adapter and answers the same prompts: its connector loads A's entries, converts them
and writes them into B's paged cache, so B computes only the last prompt token. For each prompt
B also runs its own prefill (as another tenant, cache_salt, so nothing cached is found) and
the script prints B's time to first token both ways, the tokens loaded, and how often B's first
token with the converted cache equals the one after its own prefill.

    .venv-vllm/bin/python examples/vllm/cross_model.py [--prompts 8] [--disk-dir DIR]

Each engine runs in its own process, one after the other (a disk directory holds one live
store at a time; concurrent engines need the shared-disk store or Redis).
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def run_a(disk_dir, count):
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvbridge.experiments.vllm_testbed import (greedy, heldout_prompts, testbed_llm,
                                                   token_prompts)

    llm = testbed_llm("testbed-a", {"disk_dir": disk_dir})
    llm.generate(token_prompts(heldout_prompts(count, min_tokens=224, max_tokens=224, vary=False)), greedy(1), use_tqdm=False)
    conn = get_kv_transfer_group()
    conn.flush()
    s = conn.stats()
    print(f"engine A (testbed-a): saved {s['tokens_saved']} tokens of {s['saves']} prompts "
          f"(copy out of the paged cache {1e3 * s['save_copy_seconds']:.1f} ms in all)")


def run_b(disk_dir, count):
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvbridge.experiments.vllm_testbed import ADAPTER, heldout_prompts, testbed_llm, ttft

    llm = testbed_llm("testbed-b", {"disk_dir": disk_dir, "adapters": [str(ADAPTER)]})
    prompts = heldout_prompts(count, min_tokens=224, max_tokens=224, vary=False)
    ttft(llm, prompts[0], cache_salt="warm-up")
    own_t, conv_t, loaded, agree = [], [], [], 0
    for i, ids in enumerate(prompts):
        t_own, own = ttft(llm, ids, cache_salt="own-prefill")
        t_conv, conv = ttft(llm, ids)
        own_t.append(t_own)
        conv_t.append(t_conv)
        loaded.append(conv.num_cached_tokens)
        agree += own.outputs[0].token_ids[0] == conv.outputs[0].token_ids[0]
    s = get_kv_transfer_group().stats()
    print(f"engine B (testbed-b), {count} prompts of {len(prompts[0])} tokens:")
    print(f"  TTFT own prefill     median {1e3 * statistics.median(own_t):7.2f} ms")
    print(f"  TTFT with connector  median {1e3 * statistics.median(conv_t):7.2f} ms "
          f"({statistics.median(own_t) / statistics.median(conv_t):.2f}x)")
    print(f"  tokens loaded per prompt: {loaded} (converted loads: {s['loads_converted']})")
    print(f"  first-token agreement with own prefill: {agree}/{count}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--disk-dir", default=None, help="default: a temporary directory")
    ap.add_argument("--engine", choices=("a", "b"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine:
        (run_a if args.engine == "a" else run_b)(args.disk_dir, args.prompts)
        return
    with tempfile.TemporaryDirectory() as tmp:
        disk = args.disk_dir or tmp
        for engine in ("a", "b"):
            subprocess.run([sys.executable, __file__, "--engine", engine, "--disk-dir", disk,
                            "--prompts", str(args.prompts)], check=True)


if __name__ == "__main__":
    main()
