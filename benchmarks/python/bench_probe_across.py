#!/usr/bin/env python3
"""Bridge.probe against Bridge.load(return_kv=False) across tokenizers, on the real pair.

A scheduler must know how many prompt tokens a load will serve before a worker loads them (the
vLLM connector's scheduler does, for every new request). Across tokenizers that length depends
on both tokenizations and the alignment; Bridge.load(return_kv=False) finds it by converting,
Bridge.probe by the same lookups and alignment without converting. Both run here in one process
on the same Bridge (no write-back, so every load converts), alternated, and must report the same
tokens, tail and provenance.

SmolLM2-135M saves its cache of a held-out text (kvbridge.experiments.corpus); Gemma-3-270M's
prompt is that text's first N Gemma tokens, with both tokenizers registered and `--adapter` (a
SmolLM2-135M -> Gemma-3-270M adapter file, e.g. the one `kvbridge demo --real` keeps in
~/.cache/kvbridge/adapters or `kvbridge eval --save-adapter` writes; its serving record sets the
tail). Median milliseconds of --repeats per length, and the ratio load / probe.

    .venv/bin/python benchmarks/python/bench_probe_across.py --adapter FILE
"""
import argparse
import statistics
import time

import torch

import kvbridge
from kvbridge import hf, models
from kvbridge.experiments import corpus


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--adapter", required=True, help="a SmolLM2-135M -> Gemma-3-270M adapter file")
    ap.add_argument("--lengths", default="500,2000,4000", help="prompt lengths in Gemma tokens")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    src, tgt = models.load("smollm2-135m"), models.load("gemma3-270m")
    adapter = kvbridge.LinearAdapter.load(args.adapter)
    _, heldout = corpus.split_files(corpus.default_files(), 0.25, 0)
    text = corpus.windows(heldout, 16384, 1)[0]
    print("| prompt tokens | served | tail | load(return_kv=False) ms | probe ms | load / probe |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in (int(x) for x in args.lengths.split(",")):
        bridge = kvbridge.Bridge(kvbridge.KVStore(1 << 31), write_back=False)
        bridge.add_tokenizer(src.spec, src.tokenizer)
        bridge.add_tokenizer(tgt.spec, tgt.tokenizer)
        bridge.add_adapter(adapter)
        prompt = tgt.tokenizer(text, add_special_tokens=True)["input_ids"][:n]
        source_ids = src.tokenizer(tgt.tokenizer.decode(prompt, skip_special_tokens=True))["input_ids"]
        with torch.no_grad():
            bridge.save(src.spec, source_ids, hf.prefix_kv(src.model, source_ids))
        load_s, probe_s = [], []
        for _ in range(args.repeats):
            t = time.perf_counter()
            found = bridge.load(tgt.spec, prompt, return_kv=False)
            load_s.append(time.perf_counter() - t)
            t = time.perf_counter()
            planned = bridge.probe(tgt.spec, prompt)
            probe_s.append(time.perf_counter() - t)
            if planned != found:  # kv is None in both
                raise SystemExit(f"probe {planned} differs from load {found}")
        load_ms, probe_ms = 1e3 * statistics.median(load_s), 1e3 * statistics.median(probe_s)
        print(f"| {n} | {found.tokens} | {found.recompute_tail} | {load_ms:.1f} | {probe_ms:.1f} | "
              f"{load_ms / probe_ms:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
