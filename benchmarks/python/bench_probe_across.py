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
tail). Median milliseconds of --repeats per length, and the ratio load / probe; beside them the
first probe of the run, before the Bridge holds any of the tokenizers' decoded tokens.

A second table times a repeated prompt as the vLLM connector serves one: chunks of 16 tokens
(its block size), the first load converts, and the prompt's own KV is saved after its prefill.
The Bridge then serves it from Gemma's own entries and asks no tokenizer anything
(Bridge::wanted_tokenizers). That load, with both tokenizers registered, is timed against the
same load on a Bridge sharing the store and the adapter without them (which never tokenizes),
alternated.

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
    lengths = [int(x) for x in args.lengths.split(",")]
    prompts = {}
    print("| prompt tokens | served | tail | load(return_kv=False) ms | probe ms | load / probe "
          "| first probe ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n in lengths:
        bridge = kvbridge.Bridge(kvbridge.KVStore(1 << 31), write_back=False)
        bridge.add_tokenizer(src.spec, src.tokenizer)
        bridge.add_tokenizer(tgt.spec, tgt.tokenizer)
        bridge.add_adapter(adapter)
        prompt = tgt.tokenizer(text, add_special_tokens=True)["input_ids"][:n]
        source_ids = src.tokenizer(tgt.tokenizer.decode(prompt, skip_special_tokens=True))["input_ids"]
        with torch.no_grad():
            source_kv = hf.prefix_kv(src.model, source_ids)
        prompts[n] = prompt, source_ids, source_kv
        bridge.save(src.spec, source_ids, source_kv)
        t = time.perf_counter()
        bridge.probe(tgt.spec, prompt)
        first_ms = 1e3 * (time.perf_counter() - t)
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
              f"{load_ms / probe_ms:.1f}x | {first_ms:.1f} |", flush=True)

    print("\n| prompt tokens (repeated) | served | load ms, tokenizers registered | load ms, none "
          "| ratio |")
    print("|---:|---:|---:|---:|---:|")
    for n in lengths:
        prompt, source_ids, source_kv = prompts[n]
        store = kvbridge.KVStore(1 << 31, chunk_tokens=16)
        bridge = kvbridge.Bridge(store)
        bridge.add_tokenizer(src.spec, src.tokenizer)
        bridge.add_tokenizer(tgt.spec, tgt.tokenizer)
        bridge.add_adapter(adapter)
        plain = kvbridge.Bridge(store)  # the same entries and adapter, no tokenizer
        plain.add_adapter(adapter)
        bridge.save(src.spec, source_ids, source_kv)
        if not bridge.load(tgt.spec, prompt, return_kv=False).converted:
            raise SystemExit("the first load did not convert")
        with torch.no_grad():
            bridge.save(tgt.spec, prompt, hf.prefix_kv(tgt.model, prompt))
        first = plain.load(tgt.spec, prompt, return_kv=False)
        across_s, plain_s = [], []
        for _ in range(args.repeats):
            t = time.perf_counter()
            found = bridge.load(tgt.spec, prompt)
            across_s.append(time.perf_counter() - t)
            t = time.perf_counter()
            own = plain.load(tgt.spec, prompt)
            plain_s.append(time.perf_counter() - t)
            if found.converted or found.tokens != first.tokens or own.tokens != first.tokens:
                raise SystemExit(f"the repeated load served {found.tokens} tokens (converted: "
                                 f"{found.converted}), the plain one {own.tokens}")
        if bridge.stats()["cross_tokenizer_loads"] != 1:
            raise SystemExit("a repeated load was tokenized")
        across_ms = 1e3 * statistics.median(across_s)
        plain_ms = 1e3 * statistics.median(plain_s)
        print(f"| {n} | {found.tokens} | {across_ms:.2f} | {plain_ms:.2f} | "
              f"{across_ms / plain_ms:.2f} |", flush=True)


if __name__ == "__main__":
    main()
