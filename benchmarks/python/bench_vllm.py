"""KVBridgeConnector in vLLM (CPU): testbed-b's time to first token with the connector (A's
converted cache) vs without it, at the longest testbed prompt; and the connector's cost when
nothing is cached (throughput of one workload with the connector on and off).

    .venv-vllm/bin/python benchmarks/python/bench_vllm.py [--prompts 8] [--repeats 2]

Every engine runs in its own process, one after another, all in this run:
1. testbed-a with the connector saves the TTFT prompts (MAX_CONTEXT - 1 = 255 tokens);
2. testbed-b without the connector: TTFT of each prompt (its own prefill, one token);
3. testbed-b with the connector and the shipped adapter: TTFT of each prompt (converted load);
4. throughput: testbed-b off / on / off / on ... (--repeats pairs), each generating
   --gen-tokens for --tput-prompts fresh prompts (unique salts: nothing cached) in one batch.
TTFT is the wall time of a one-prompt, one-token generate() (median over prompts, after a
warm-up); throughput is generated tokens per second of the batch.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# One OpenMP thread for vLLM and kvbridge alike (they share the process): on a shared 2-CPU
# machine more threads make OpenMP barriers wait on other processes.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def role_main(role, args):
    from kvbridge import testbed
    from kvbridge.vllm.testbed import (ADAPTER, greedy, heldout_prompts, testbed_llm,
                                       token_prompts, ttft)

    n_long = testbed.MAX_CONTEXT - 1
    prompts = heldout_prompts(args.prompts, min_tokens=n_long, max_tokens=n_long, vary=False)
    on = {"disk_dir": args.disk_dir}
    out = {}
    if role == "a":
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        llm = testbed_llm("testbed-a", on)
        llm.generate(token_prompts(prompts), greedy(1), use_tqdm=False)
        conn = get_kv_transfer_group()
        conn.flush()
        s = conn.stats()
        out = {"saves": s["saves"], "save_copy_ms_per_prompt":
               1e3 * s["save_copy_seconds"] / max(1, s["saves"]),
               "save_store_ms_per_prompt": 1e3 * s["save_seconds"] / max(1, s["saves"])}
    elif role in ("ttft-off", "ttft-on"):
        extra = dict(on, adapters=[str(ADAPTER)]) if role == "ttft-on" else None
        llm = testbed_llm("testbed-b", extra)
        ttft(llm, prompts[0], cache_salt="warm-up")
        times, cached = [], []
        for ids in prompts:
            t, o = ttft(llm, ids)
            times.append(t)
            cached.append(o.num_cached_tokens)
        out = {"ttft_ms": [1e3 * t for t in times], "num_cached_tokens": cached}
    elif role in ("tput-off", "tput-on"):
        extra = {"disk_dir": args.disk_dir + "-tput"} if role == "tput-on" else None
        llm = testbed_llm("testbed-b", extra)
        work = heldout_prompts(args.tput_prompts, max_tokens=testbed.MAX_CONTEXT - args.gen_tokens)
        llm.generate(token_prompts(work[:2], cache_salt="warm-up"), greedy(4), use_tqdm=False)
        items = [dict(p, cache_salt=f"{role}-{time.time_ns()}-{i}")
                 for i, p in enumerate(token_prompts(work))]
        t0 = time.perf_counter()
        outs = llm.generate(items, greedy(args.gen_tokens), use_tqdm=False)
        dt = time.perf_counter() - t0
        gen = sum(len(o.outputs[0].token_ids) for o in outs)
        out = {"tokens_per_s": gen / dt, "seconds": dt,
               "prompt_tokens": sum(len(p) for p in work), "generated": gen}
    print("RESULT " + json.dumps(out))


def run(role, args, disk_dir):
    cmd = [sys.executable, __file__, "--role", role, "--disk-dir", disk_dir,
           "--prompts", str(args.prompts), "--tput-prompts", str(args.tput_prompts),
           "--gen-tokens", str(args.gen_tokens)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{role} failed")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8, help="TTFT prompts")
    ap.add_argument("--tput-prompts", type=int, default=24)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2, help="off/on throughput pairs")
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--disk-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:
        role_main(args.role, args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        disk = os.path.join(tmp, "kv")
        a = run("a", args, disk)
        off = run("ttft-off", args, disk)
        on = run("ttft-on", args, disk)
        tput = {"off": [], "on": []}
        for _ in range(args.repeats):
            for mode in ("off", "on"):
                tput[mode].append(run(f"tput-{mode}", args, disk)["tokens_per_s"])
    t_off = statistics.median(off["ttft_ms"])
    t_on = statistics.median(on["ttft_ms"])
    print(f"## vLLM connector (`bench_vllm.py`), testbed-b on the CPU, {args.prompts} prompts "
          f"of 255 tokens\n")
    print("| | median TTFT ms | tokens served by the connector |")
    print("|---|---:|---:|")
    print(f"| without the connector | {t_off:.2f} | 0 |")
    print(f"| with the connector (A's cache converted) | {t_on:.2f} | "
          f"{statistics.median(on['num_cached_tokens']):.0f} |")
    print(f"\nTTFT ratio without / with: {t_off / t_on:.2f}x; engine A's save: copy out of the "
          f"paged cache {a['save_copy_ms_per_prompt']:.3f} ms per prompt, store write (background "
          f"thread) {a['save_store_ms_per_prompt']:.3f} ms per prompt\n")
    m_off, m_on = statistics.median(tput["off"]), statistics.median(tput["on"])
    print(f"Nothing cached ({args.tput_prompts} prompts, {args.gen_tokens} tokens each, one "
          f"batch): connector off {', '.join(f'{x:.1f}' for x in tput['off'])} tokens/s, on "
          f"{', '.join(f'{x:.1f}' for x in tput['on'])} tokens/s; median on / off "
          f"{m_on / m_off:.3f}")


if __name__ == "__main__":
    main()
