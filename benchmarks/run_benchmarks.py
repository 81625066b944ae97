#!/usr/bin/env python3
"""Runs the kvbridge C++ benchmark program and prints markdown tables of ratios.

    python3 benchmarks/run_benchmarks.py [--binary build-bench/benchmarks/cpp/kvbridge_bench]

The program runs with --benchmark_repetitions=N --benchmark_report_aggregates_only=true and
random interleaving of the repetitions (so slow drift of a noisy machine spreads over all
benchmarks instead of biasing one); the tables use the medians. For the Redis tier benchmarks
it starts a redis-server (no persistence) on a free loopback port when one is installed and
passes its URL in KVBRIDGE_BENCH_REDIS_URL. Standard library only.
"""

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_BINARY = os.path.join(REPO, "build-bench", "benchmarks", "cpp", "kvbridge_bench")
PROMPTS = [1024, 8192, 32768, 131072]
SIZES_MIB = [1, 4, 16, 64]
NS_TARGET = 100.0  # ns per 16 tokens, hashed and looked up
BW_TARGET = 70.0  # % of memcpy bandwidth
TIER_TARGET = 70.0  # % of the plain file read / raw hiredis peer


@contextlib.contextmanager
def redis_server():
    """Yields the URL of a fresh redis-server on a free loopback port, or None."""
    binary = shutil.which("redis-server") or (
        "/usr/bin/redis-server" if os.access("/usr/bin/redis-server", os.X_OK) else None)
    if binary is None:
        yield None
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", "/tmp", "--protected-mode", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                time.sleep(0.01)
        yield f"redis://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def run(binary, repetitions, min_time, raw_out, bench_filter=None):
    cmd = [
        binary,
        "--benchmark_format=json",
        f"--benchmark_repetitions={repetitions}",
        "--benchmark_report_aggregates_only=true",
        "--benchmark_enable_random_interleaving=true",
    ]
    if min_time is not None:
        cmd.append(f"--benchmark_min_time={min_time}")
    if bench_filter:
        cmd.append(f"--benchmark_filter={bench_filter}")
    print("running: " + " ".join(cmd), file=sys.stderr)
    with redis_server() as url:
        env = dict(os.environ)
        if url:
            env["KVBRIDGE_BENCH_REDIS_URL"] = url
        proc = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, universal_newlines=True,
                              env=env)
    if raw_out:
        with open(raw_out, "w") as f:
            f.write(proc.stdout)
    return json.loads(proc.stdout)


def largest_cv(report):
    """(cv, run_name) of the noisiest benchmark, by CPU time across repetitions."""
    cvs = [(float(b["cpu_time"]), b["run_name"]) for b in report["benchmarks"]
           if b.get("run_type") == "aggregate" and b.get("aggregate_name") == "cv"]
    return max(cvs) if cvs else None


def medians(report):
    out = {}
    errors = []
    for b in report["benchmarks"]:
        if b.get("error_occurred"):
            errors.append(f"{b.get('run_name', b['name'])}: {b.get('error_message')}")
            continue
        if b.get("run_type") == "aggregate" and b.get("aggregate_name") == "median":
            out[b["run_name"]] = b
        elif b.get("run_type") == "iteration" and b.get("repetitions", 1) == 1:
            out.setdefault(b["run_name"], b)  # a single repetition has no aggregates
    return out, errors


def fmt(x, digits=1, suffix=""):
    return "n/a" if x is None else f"{x:.{digits}f}{suffix}"


def get(med, name, field):
    b = med.get(name)
    return None if b is None or field not in b else float(b[field])


def gbps(med, name):
    v = get(med, name, "bytes_per_second")
    return None if v is None else v / 1e9


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def prefix_table(med):
    lines = [
        "| prompt tokens | kvbridge match, chunk 16 | kvbridge match_length, chunk 16 "
        "| kvbridge match, chunk 256 "
        "| kvbridge hashing only, chunk 16 | sha256 C++ (EVP_Digest) | sha256 C++ (reused EVP ctx) "
        "| kvbridge speedup vs EVP_Digest | kvbridge speedup vs reused ctx "
        f"| chunk 16 <= {NS_TARGET:.0f} ns? |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for n in PROMPTS:
        k16 = get(med, f"BM_KVStoreMatch/tokens:{n}/chunk:16", "ns_per_16_tokens")
        len16 = get(med, f"BM_KVStoreMatchLength/tokens:{n}/chunk:16", "ns_per_16_tokens")
        k256 = get(med, f"BM_KVStoreMatch/tokens:{n}/chunk:256", "ns_per_16_tokens")
        h16 = get(med, f"BM_PrefixHashesOnly/tokens:{n}/chunk:16", "ns_per_16_tokens")
        s1 = get(med, f"BM_Sha256ChainMatch_EVPDigest/tokens:{n}", "ns_per_16_tokens")
        s2 = get(med, f"BM_Sha256ChainMatch_ReusedCtx/tokens:{n}", "ns_per_16_tokens")
        ok = "n/a" if k16 is None else ("yes" if k16 <= NS_TARGET else "**no**")
        lines.append(
            f"| {n} | {fmt(k16)} | {fmt(len16)} | {fmt(k256)} | {fmt(h16)} | {fmt(s1)} | {fmt(s2)} "
            f"| {fmt(ratio(s1, k16), 1, 'x')} | {fmt(ratio(s2, k16), 1, 'x')} | {ok} |"
        )
    return lines


def bandwidth_table(med):
    lines = [
        "| entry size | memcpy GB/s | put GB/s | put % of memcpy | match+copy_to GB/s "
        "| match+copy_to % of memcpy | aligned_alloc+memcpy GB/s (diagnostic) "
        f"| put page faults / call | both >= {BW_TARGET:.0f}%? |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for mib in SIZES_MIB:
        mc, put, mat, alloc = (gbps(med, f"{name}/MiB:{mib}") for name in (
            "BM_Memcpy", "BM_StorePut", "BM_StoreMatchCopy", "BM_AllocMemcpy"))
        pp = ratio(put, mc)
        mp = ratio(mat, mc)
        pp = None if pp is None else 100 * pp
        mp = None if mp is None else 100 * mp
        ok = "n/a" if pp is None or mp is None else (
            "yes" if pp >= BW_TARGET and mp >= BW_TARGET else "**no**")
        lines.append(
            f"| {mib} MiB | {fmt(mc, 2)} | {fmt(put, 2)} | {fmt(pp, 0, '%')} | {fmt(mat, 2)} "
            f"| {fmt(mp, 0, '%')} | {fmt(alloc, 2)} "
            f"| {fmt(get(med, f'BM_StorePut/MiB:{mib}', 'page_faults'), 0)} | {ok} |"
        )
    return lines


def pct(a, b):
    r = ratio(a, b)
    return None if r is None else 100 * r


def verdict(*values):
    if any(v is None for v in values):
        return "n/a"
    return "yes" if all(v >= TIER_TARGET for v in values) else "**no**"


def disk_table(med):
    lines = [
        "| entry size | plain read GB/s | disk tier read GB/s | % of plain read "
        f"| >= {TIER_TARGET:.0f}%? |",
        "|---:|---:|---:|---:|:---:|",
    ]
    for mib in SIZES_MIB:
        plain = gbps(med, f"BM_PlainFileRead/MiB:{mib}/real_time")
        tier = gbps(med, f"BM_DiskTierRead/MiB:{mib}/real_time")
        p = pct(tier, plain)
        lines.append(f"| {mib} MiB | {fmt(plain, 2)} | {fmt(tier, 2)} | {fmt(p, 0, '%')} "
                     f"| {verdict(p)} |")
    return lines


def redis_table(med):
    lines = [
        "| value size | raw GET GB/s | tier get GB/s | get % of raw | raw SET GB/s "
        f"| tier put GB/s | put % of raw | both >= {TIER_TARGET:.0f}%? |",
        "|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for mib in SIZES_MIB:
        rg = gbps(med, f"BM_RawHiredisGet/MiB:{mib}/real_time")
        tg = gbps(med, f"BM_RedisTierGet/MiB:{mib}/real_time")
        rs = gbps(med, f"BM_RawHiredisSet/MiB:{mib}/real_time")
        tp = gbps(med, f"BM_RedisTierPut/MiB:{mib}/real_time")
        g, p = pct(tg, rg), pct(tp, rs)
        lines.append(f"| {mib} MiB | {fmt(rg, 2)} | {fmt(tg, 2)} | {fmt(g, 0, '%')} "
                     f"| {fmt(rs, 2)} | {fmt(tp, 2)} | {fmt(p, 0, '%')} | {verdict(g, p)} |")
    return lines


def filter_table(med):
    off = "BM_RedisMissLookup/filter:0/real_time"
    on = "BM_RedisMissLookup/filter:1/real_time"
    lines = [
        "| filter | Redis round trips per lookup | sure misses per lookup | us per lookup |",
        "|---|---:|---:|---:|",
    ]
    for name, label in ((off, "off"), (on, "on")):
        t = get(med, name, "real_time")
        unit = med.get(name, {}).get("time_unit", "ns")
        us = None if t is None else t / {"ns": 1e3, "us": 1.0, "ms": 1e-3, "s": 1e-6}[unit]
        lines.append(f"| {label} | {fmt(get(med, name, 'round_trips_per_lookup'), 2)} "
                     f"| {fmt(get(med, name, 'filter_negatives_per_lookup'), 2)} | {fmt(us, 1)} |")
    t_off, t_on = get(med, off, "real_time"), get(med, on, "real_time")
    lines += ["", f"Lookups of never-stored prefixes with the filter: "
                  f"{fmt(ratio(t_off, t_on), 1, 'x')} faster, and no round trip where the filter "
                  "answers."]
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--binary", default=DEFAULT_BINARY)
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--min-time", default=None,
                    help="--benchmark_min_time per repetition (default: the library's, 0.5 s)")
    ap.add_argument("--raw-json", default=None, help="also save the program's JSON here")
    ap.add_argument("--filter", default=None, help="--benchmark_filter (default: all)")
    args = ap.parse_args()

    report = run(args.binary, args.repetitions, args.min_time, args.raw_json, args.filter)
    med, errors = medians(report)
    ctx = report.get("context", {})
    build = ctx.get("library_build_type")
    out = [
        "Google Benchmark" + (f" (libbenchmark built as {build})" if build else "") + ", "
        f"{ctx.get('num_cpus', '?')} CPUs at {ctx.get('mhz_per_cpu', '?')} MHz, "
        f"median of {args.repetitions} repetitions (CPU time, randomly interleaved).",
        "",
        "#### Prefix match, ns per 16 tokens (lower is better)",
        "",
        *prefix_table(med),
        "",
        "#### Put / match bandwidth vs memcpy (higher is better)",
        "",
        *bandwidth_table(med),
        "",
        "#### Disk tier read vs a plain sequential read of a file of the same size "
        "(wall time, higher is better)",
        "",
        *disk_table(med),
        "",
        "#### Redis tier vs a raw hiredis GET / SET loop, same value size "
        "(wall time, higher is better)",
        "",
        *redis_table(med),
        "",
        "#### Redis filter: remote calls saved on lookups of never-stored prefixes",
        "",
        *filter_table(med),
    ]
    cv = largest_cv(report)
    if cv is not None:
        out += ["", f"Noise: the largest coefficient of variation of CPU time across the "
                    f"repetitions was {100 * cv[0]:.0f}% ({cv[1]})."]
    if errors:
        out += ["", "Benchmarks that reported an error:", ""] + [f"- {e}" for e in errors]
    print("\n".join(out))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
