"""KVBridgeConnector in vLLM (CPU): testbed-b's time to first token with the connector (A's
converted cache) vs without it, at the longest testbed prompt, with where the connector's time
goes; and the connector's cost when nothing is cached, as CPU seconds per generated token of
one workload with the connector on and off.

    .venv-vllm/bin/python benchmarks/python/bench_vllm.py [--prompts 8] [--repeats 9]
        [--skip-ttft] [--skip-cost]

Every engine runs in-process (uniprocess executor, VLLM_ENABLE_V1_MULTIPROCESSING=0), so the
process's CPU time (time.process_time: every thread, the connector's save thread included)
covers the engine's work and the connector's.

TTFT (engines one after another, each its own process):
1. testbed-a with the connector saves the TTFT prompts (MAX_CONTEXT - 1 = 255 tokens);
2. testbed-b without the connector: TTFT of each prompt (its own prefill, one token);
3. testbed-b with the connector and the shipped adapter: TTFT of each prompt (converted load),
   and the connector's and the Bridge's counters split it into the scheduler's probe (store
   lookup: disk read, checksum, promotion to memory), the worker's Bridge.load (store lookup and
   copy, conversion, the rest: the copy out to tensors; the connector's Bridge writes nothing back) and the scatter into vLLM's blocks.
TTFT is the wall time of a one-prompt, one-token generate() (median over prompts, after a
warm-up).

Cost when nothing is cached: two engine processes of testbed-b, connector off and connector on
(the shipped adapter, as B serves; disk tier, or memory only with --cost-store memory; or,
with --cost-store noop, a connector that does nothing, noop_connector.py, which measures what
vLLM's own connector plumbing costs per step), both alive, driven alternately (off, on, on, off, ...: the idle one waits on a pipe and uses no CPU),
each run generating --gen-tokens for --cost-prompts prompts in one batch under fresh cache salts
(no hit in vLLM's prefix cache nor in the store; the connector probes, and saves every prompt).
Per run: CPU seconds of generate() plus the wait for the background saves, per generated token;
and generate()'s wall time (what a client sees; the saves are not waited for).
Reported: the medians per mode and their ratios.
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


def loadavg():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


class Timed:
    """Wraps a callable, summing its wall time."""

    def __init__(self, fn):
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1


def ttft_role(role, args):
    from kvbridge.experiments import testbed
    from kvbridge.experiments.vllm_testbed import (ADAPTER, greedy, heldout_prompts, testbed_llm,
                                       token_prompts, ttft)

    n_long = testbed.MAX_CONTEXT - 1
    prompts = heldout_prompts(args.prompts, min_tokens=n_long, max_tokens=n_long, vary=False)
    on = {"disk_dir": args.disk_dir}
    if role == "a":
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        llm = testbed_llm("testbed-a", on)
        llm.generate(token_prompts(prompts), greedy(1), use_tqdm=False)
        conn = get_kv_transfer_group()
        conn.flush()
        s = conn.stats()
        return {"saves": s["saves"], "save_copy_ms_per_prompt":
                1e3 * s["save_copy_seconds"] / max(1, s["saves"]),
                "save_store_ms_per_prompt": 1e3 * s["save_seconds"] / max(1, s["saves"])}
    # Instrument the worker's two steps (in-process: the connector calls these module
    # attributes).
    from kvbridge.bridge import Bridge
    from kvbridge.vllm import paged

    bridge_load = Timed(Bridge.load)
    scatter = Timed(paged.scatter)
    Bridge.load = lambda self, *a, **k: bridge_load(self, *a, **k)
    paged.scatter = scatter
    extra = dict(on, adapters=[str(ADAPTER)]) if role == "ttft-on" else None
    llm = testbed_llm("testbed-b", extra)
    ttft(llm, prompts[0], cache_salt="warm-up")
    before = _counters(extra is not None)
    bridge_load.seconds = scatter.seconds = 0.0
    times, cached = [], []
    for ids in prompts:
        t, o = ttft(llm, ids)
        times.append(t)
        cached.append(o.num_cached_tokens)
    out = {"ttft_ms": [1e3 * t for t in times], "num_cached_tokens": cached}
    if extra is not None:
        after = _counters(True)
        d = {k: after[k] - before[k] for k in after}
        n = len(prompts)
        out["per_prompt_ms"] = {
            "scheduler probe (store lookup: disk read, verify, promote)":
                1e3 * d["lookup_seconds"] / n,
            "worker load (Bridge.load + scatter)": 1e3 * d["load_seconds"] / n,
            "  Bridge.load": 1e3 * bridge_load.seconds / n,
            "    store lookup and copy (memory)": 1e3 * d["bridge_lookup_seconds"] / n,
            "    conversion": 1e3 * d["convert_seconds"] / n,
            "    rest (copy out to tensors)":
                1e3 * (bridge_load.seconds - d["bridge_lookup_seconds"]
                       - d["convert_seconds"]) / n,
            "  scatter into vLLM's blocks": 1e3 * scatter.seconds / n,
        }
        out["loads_converted"] = d["loads_converted"]
        out["load_errors"] = d["load_errors"]
    return out


def _counters(enabled):
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    if not enabled:
        return {}
    s = get_kv_transfer_group().stats()
    return {"lookup_seconds": s["lookup_seconds"], "load_seconds": s["load_seconds"],
            "loads_converted": s["loads_converted"], "load_errors": s["load_errors"],
            "bridge_lookup_seconds": s["bridge"]["lookup_seconds"],
            "convert_seconds": s["bridge"]["convert_seconds"]}


def cost_role(role, args):
    """A long-lived engine: 'run TAG' on stdin runs the workload once, a RESULT line answers."""
    from kvbridge.experiments import testbed
    from kvbridge.experiments.vllm_testbed import (ADAPTER, greedy, heldout_prompts, testbed_llm,
                                       token_prompts)

    extra, kwargs = None, {}
    if role == "cost-on" and args.cost_store == "noop":
        from vllm.config import KVTransferConfig

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="NoopConnector", kv_connector_module_path="noop_connector",
            kv_role="kv_both")
    elif role == "cost-on":
        extra = {"adapters": [str(ADAPTER)]}
        if args.cost_store == "disk":
            extra["disk_dir"] = args.disk_dir + "-cost"
    llm = testbed_llm("testbed-b", extra, **kwargs)
    conn = None
    if extra is not None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        conn = get_kv_transfer_group()
    work = heldout_prompts(args.cost_prompts, max_tokens=testbed.MAX_CONTEXT - args.gen_tokens)
    params = greedy(args.gen_tokens)

    def once(tag):
        items = [dict(p, cache_salt=f"{role}-{tag}-{i}")
                 for i, p in enumerate(token_prompts(work))]
        before = conn.stats() if conn else None
        c0, t0 = time.process_time(), time.perf_counter()
        outs = llm.generate(items, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        if conn:
            conn.flush()  # the background saves' CPU time belongs to this run
        cpu = time.process_time() - c0
        gen = sum(len(o.outputs[0].token_ids) for o in outs)
        res = {"cpu_s": cpu, "wall_s": wall, "generated": gen,
               "cached": sum(int(o.num_cached_tokens or 0) for o in outs)}
        if conn:
            after = conn.stats()
            res["connector_s"] = {k: after[k] - before[k] for k in
                                  ("lookup_seconds", "save_copy_seconds", "save_seconds")}
            res["tokens_loaded"] = after["tokens_loaded"] - before["tokens_loaded"]
            res["saves"] = after["saves"] - before["saves"]
        return res

    once("warm-up")
    print("READY", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        print("RESULT " + json.dumps(once(cmd[1])), flush=True)


class CostEngine:
    def __init__(self, role, args, disk_dir, log_dir):
        self.role = role
        self.log = open(os.path.join(log_dir, f"{role}.log"), "w")
        self.proc = subprocess.Popen(_child_cmd(role, args, disk_dir), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)
        self._until("READY")

    def _until(self, marker):
        for line in self.proc.stdout:
            if line.startswith(marker):
                return line[len(marker):].strip()
        self.log.flush()
        raise SystemExit(f"{self.role} ended early; see its log {self.log.name}")

    def run(self, tag):
        self.proc.stdin.write(f"run {tag}\n")
        self.proc.stdin.flush()
        return json.loads(self._until("RESULT "))

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=300)
        self.log.close()


def _child_cmd(role, args, disk_dir):
    return [sys.executable, __file__, "--role", role, "--disk-dir", disk_dir,
            "--prompts", str(args.prompts), "--cost-prompts", str(args.cost_prompts),
            "--gen-tokens", str(args.gen_tokens), "--cost-store", args.cost_store]


def run_once(role, args, disk_dir):
    proc = subprocess.run(_child_cmd(role, args, disk_dir), capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{role} failed")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def report_ttft(args, a, off, on, load_before, load_after):
    t_off = statistics.median(off["ttft_ms"])
    t_on = statistics.median(on["ttft_ms"])
    print(f"### TTFT, testbed-b, {args.prompts} prompts of 255 tokens, one token each "
          f"(load average {load_before} before, {load_after} after)\n")
    print("| testbed-b | median TTFT ms | min | max | tokens served by the connector |")
    print("|---|---:|---:|---:|---:|")
    print(f"| without the connector | {t_off:.2f} | {min(off['ttft_ms']):.2f} | "
          f"{max(off['ttft_ms']):.2f} | 0 |")
    print(f"| with the connector (A's cache converted) | {t_on:.2f} | {min(on['ttft_ms']):.2f} | "
          f"{max(on['ttft_ms']):.2f} | {statistics.median(on['num_cached_tokens']):.0f} |")
    print(f"\nTTFT ratio without / with: {t_off / t_on:.2f}x (converted loads "
          f"{on['loads_converted']}, load errors {on['load_errors']}); engine A's save: copy "
          f"out of the paged cache {a['save_copy_ms_per_prompt']:.3f} ms per prompt, store "
          f"write (background thread) {a['save_store_ms_per_prompt']:.3f} ms per prompt\n")
    print("Where the connector's time goes, mean ms per prompt:\n")
    print("| step | ms |")
    print("|---|---:|")
    for name, ms in on["per_prompt_ms"].items():
        print(f"| {name.strip()}{' (part of the line above)' if name.startswith('    ') else ''}"
              f" | {ms:.2f} |")
    print()


def report_cost(args, runs, load_before, load_after):
    med = {m: {k: statistics.median(r[k] / r["generated"] if k == "cpu_s" else r[k]
                                    for r in runs[m]) for k in ("cpu_s", "wall_s")}
           for m in runs}
    peer = "a no-op connector" if args.cost_store == "noop" else f"{args.cost_store} store"
    print(f"### Cost when nothing is cached ({peer}): {args.cost_prompts} "
          f"prompts, {args.gen_tokens} tokens each, one batch, {args.repeats} runs per mode "
          f"alternated (load average "
          f"{load_before} before, {load_after} after)\n")
    print("| connector | median CPU ms per generated token | runs (CPU ms per token) | "
          "median wall s | runs (wall s) |")
    print("|---|---:|---|---:|---|")
    def cpu_ms(r):
        return 1e3 * r["cpu_s"] / r["generated"]

    for m in ("off", "on"):
        cpu_runs = ", ".join(f"{cpu_ms(r):.3f}" for r in runs[m])
        wall_runs = ", ".join(f"{r['wall_s']:.3f}" for r in runs[m])
        print(f"| {m} | {1e3 * med[m]['cpu_s']:.3f} | {cpu_runs} | {med[m]['wall_s']:.3f} | "
              f"{wall_runs} |")
    pairs = ", ".join(f"{cpu_ms(a) / cpu_ms(b):.3f}" for a, b in zip(runs["on"], runs["off"]))
    print(f"\nRatio on / off: CPU per token {med['on']['cpu_s'] / med['off']['cpu_s']:.3f}, "
          f"wall {med['on']['wall_s'] / med['off']['wall_s']:.3f}. Run i on / run i off, CPU "
          f"per token: {pairs}")
    conn = [r["connector_s"] for r in runs["on"] if "connector_s" in r]
    if not conn:  # the no-op peer has no timers
        return
    per_run = {k: 1e3 * statistics.median(c[k] for c in conn) for k in conn[0]}
    gen = statistics.median(r["generated"] for r in runs["on"])
    print(f"\nConnector timers, median ms per run ({gen:.0f} generated tokens, "
          f"{runs['on'][0]['saves']} saves, {runs['on'][0]['tokens_loaded']} tokens loaded): "
          + ", ".join(f"{k} {v:.2f}" for k, v in per_run.items()))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8, help="TTFT prompts")
    ap.add_argument("--cost-prompts", type=int, default=24)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=9, help="cost runs per mode")
    ap.add_argument("--cost-store", choices=("disk", "memory", "noop"), default="disk",
                    help="the connector-on engine's store tiers in the cost runs; noop: a "
                         "connector that does nothing (noop_connector.py) instead of kvbridge's, "
                         "to measure vLLM's own per-step connector cost")
    ap.add_argument("--skip-ttft", action="store_true")
    ap.add_argument("--skip-cost", action="store_true")
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--disk-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role in ("cost-on", "cost-off"):
        cost_role(args.role, args)
        return
    if args.role:
        print("RESULT " + json.dumps(ttft_role(args.role, args)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        disk = os.path.join(tmp, "kv")
        print(f"## vLLM connector (`bench_vllm.py`), testbed-b on the CPU\n")
        if not args.skip_ttft:
            l0 = loadavg()
            a = run_once("a", args, disk)
            off = run_once("ttft-off", args, disk)
            on = run_once("ttft-on", args, disk)
            report_ttft(args, a, off, on, l0, loadavg())
        if not args.skip_cost:
            engines = {}
            try:
                for m in ("off", "on"):
                    engines[m] = CostEngine(f"cost-{m}", args, disk, tmp)
                l0 = loadavg()
                runs = {"off": [], "on": []}
                for i in range(args.repeats):
                    order = ("off", "on") if i % 2 == 0 else ("on", "off")
                    for m in order:
                        runs[m].append(engines[m].run(f"r{i}"))
                l1 = loadavg()
            finally:
                for e in engines.values():
                    e.close()
            for r in runs["on"] + runs["off"]:
                assert r["cached"] == 0, "a cost run hit a cache"
            report_cost(args, runs, l0, l1)


if __name__ == "__main__":
    main()
