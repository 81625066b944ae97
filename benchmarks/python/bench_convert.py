#!/usr/bin/env python3
"""CPU convert throughput against torch.matmul of the same GEMMs, on the same threads.

The adapter maps a (layers x 8 KV heads x 128) source to a target of the same shape, each target
layer drawing on one source layer (features 2 * 8 * 128 = 2048, outputs 1024 per map), with
random weights written straight into an adapter file, so no fit is timed. kvbridge's convert
does the whole job (un-rotate, GEMMs, bias, rotate, cast, layout); the peer does only the GEMMs
(torch.matmul on matrices already in place, in the cache's dtype: a bfloat16 convert runs its
GEMMs in bfloat16 on AMX or AVX512-BF16 where the CPU has them, as torch does) with torch.set_num_threads equal to
the OpenMP threads kvbridge uses. GFLOP/s count the GEMM FLOPs only (2 * tokens * features * outputs
per map), so the ratio is the share of the peer's GEMM speed that the full conversion keeps.

Also prints a FLOP-based estimate of convert against prefill for Llama-3-8B-shaped pairs.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/python/bench_convert.py
"""
import argparse
import json
import os
import tempfile
import time

import torch
from safetensors.torch import save_file

import kvbridge

HEADS, HEAD_DIM = 8, 128


def make_adapter(layers, dtype, path):
    src = kvbridge.ModelSpec("bench-src", layers, HEADS, HEAD_DIM, dtype=dtype)
    tgt = kvbridge.ModelSpec("bench-tgt", layers, HEADS, HEAD_DIM, dtype=dtype, rope_base=500000.0)
    g = torch.Generator().manual_seed(0)
    f, o = 2 * HEADS * HEAD_DIM, HEADS * HEAD_DIM
    tensors = {}
    for j in range(layers):
        for kind in ("key", "value"):
            tensors[f"layers.{j}.{kind}.weight"] = torch.randn(f, o, generator=g) / f ** 0.5
            tensors[f"layers.{j}.{kind}.bias"] = torch.randn(o, generator=g)

    def spec_json(s):
        return json.dumps(dict(
            name=s.name, version=s.version, tokenizer=s.tokenizer, num_layers=s.num_layers,
            num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, dtype=s.dtype,
            rope_base=s.rope_base, rope_style=s.rope_style,
            rope_scaling=dict(type="none", factor=1.0, low_freq_factor=1.0,
                              high_freq_factor=4.0, original_max_position=8192),
            fingerprint=s.fingerprint))

    fit = dict(layers=[dict(r2_key=0.0, r2_value=0.0, ridge_key=0.0, ridge_value=0.0)] * layers,
               train_tokens=0, holdout_tokens=0)
    meta = dict(format="kvbridge.adapter", format_version="1", source_spec=spec_json(src),
                target_spec=spec_json(tgt), layer_map=json.dumps([[j] for j in range(layers)]),
                rope_aware="true", fit_report=json.dumps(fit))
    save_file(tensors, path, metadata=meta)
    # Written here by the safetensors package, so without a checksum: trusted, not verified.
    return kvbridge.LinearAdapter.load(path, allow_unchecked=True), src, tensors


def best_of(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    threads = int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1))
    torch.set_num_threads(threads)
    f, o = 2 * HEADS * HEAD_DIM, HEADS * HEAD_DIM

    print(f"{args.layers} layers x {HEADS} KV heads x {HEAD_DIM} head dim on both sides, one "
          f"source layer per target layer; {threads} threads; best of {args.repeats}.\n")
    print("| dtype | tokens | kvbridge convert GFLOP/s | torch.matmul GEMMs GFLOP/s | ratio | >= 80%? |")
    print("|---|---:|---:|---:|---:|:---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in ("float32", "bfloat16"):
            adapter, src_spec, tensors = make_adapter(args.layers, dtype, os.path.join(tmp, "a.safetensors"))
            weights = [tensors[f"layers.{j}.{k}.weight"] for j in range(args.layers) for k in ("key", "value")]
            for tokens in args.tokens:
                g = torch.Generator().manual_seed(1)
                kv = tuple((torch.randn(1, HEADS, tokens, HEAD_DIM, generator=g).to(getattr(torch, dtype)),
                            torch.randn(1, HEADS, tokens, HEAD_DIM, generator=g).to(getattr(torch, dtype)))
                           for _ in range(args.layers))
                x = torch.randn(tokens, f, generator=g).to(getattr(torch, dtype))
                weights_dt = [w.to(getattr(torch, dtype)) for w in weights]
                flops = 2.0 * tokens * f * o * 2 * args.layers
                t_conv = best_of(lambda: adapter.convert(kv, start_pos=100), args.repeats)
                t_gemm = best_of(lambda: [torch.matmul(x, w) for w in weights_dt], args.repeats)
                ours, peer = flops / t_conv / 1e9, flops / t_gemm / 1e9
                print(f"| {dtype} | {tokens} | {ours:.1f} | {peer:.1f} | {ours / peer:.0%} | "
                      f"{'yes' if ours / peer >= 0.8 else '**no**'} |")

    print("\nFLOP estimate, Llama-3-8B-shaped source and target (32 layers, 8 KV heads x 128, "
          "4096 wide, 8.0e9 parameters), per prompt token:\n")
    print("| source layers per target layer | convert FLOPs | prefill FLOPs (2 x params) | prefill / convert |")
    print("|---:|---:|---:|---:|")
    for k in (1, 4, 8):
        conv = 2 * (k * f) * o * 2 * 32
        prefill = 2 * 8.0e9
        print(f"| {k} | {conv:.2e} | {prefill:.2e} | {prefill / conv:.0f}x |")
    print("\n(prefill also pays attention, 4 x layers x width x position FLOPs per token, which grows"
          " with prompt length; convert does not.)")


if __name__ == "__main__":
    main()
