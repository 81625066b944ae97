"""The fitter on a pair of Llama-3-8B-shaped KV caches: memory and time of each phase.

Both models: 32 layers, 8 KV heads of dim 128 (Fl = 2048 features per source layer, O = 1024
outputs per map). Synthetic data with a planted structure: target layer j's keys and values are
a fixed linear function of source layers j and (j + 13) % 32, plus noise. RoPE is left out
(rope_aware=False) because the data carries no positions; it does not change memory or time.
`--planted dense` (default) uses dense random maps; `--planted permuted` uses a random feature
permutation with random scales per source layer, which is as hard for the fitter (it does not
know the structure) but costs nothing to generate, for runs over many tokens.

Prints the accumulator bytes per phase, the peak resident memory of the process (ru_maxrss),
the wall time of each phase, and how many planted layers the probe pass kept as candidates
and fit() selected.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/python/bench_fitter_memory.py
    # an 8B-shaped pair end to end: 72 x 1024 tokens (about 66,000 training tokens), both passes
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/python/bench_fitter_memory.py \
        --samples 72 --tokens 1024 --planted permuted
"""
import argparse
import resource
import time

import torch

import kvbridge


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=512, help="tokens per sample")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-memory-gib", type=float, default=8.0)
    ap.add_argument("--planted", choices=["dense", "permuted"], default="dense")
    args = ap.parse_args()

    L, H, D, T = args.layers, args.kv_heads, args.head_dim, args.tokens
    spec_a = kvbridge.ModelSpec("bench-a", L, H, D, rope_base=500000.0)
    spec_b = kvbridge.ModelSpec("bench-b", L, H, D, rope_base=10000.0)
    W = H * D
    g = torch.Generator().manual_seed(0)
    mix = [torch.randn(2 * W, 2 * W, generator=g) / (2 * W) ** 0.5 for _ in range(2)]
    perm = [torch.randperm(2 * W, generator=g) for _ in range(2)]
    scales = [0.5 + torch.rand(2 * W, generator=g) for _ in range(2)]

    def planted_map(x, k):
        if args.planted == "dense":
            return x @ mix[k]
        return x[:, perm[k]] * scales[k]
    planted = [sorted({j, (j + 13) % L}) for j in range(L)]

    def sample(seed):
        gs = torch.Generator().manual_seed(1000 + seed)
        x = [torch.randn(T, 2 * W, generator=gs) for _ in range(L)]
        src = tuple((xl[:, :W].reshape(1, T, H, D).transpose(1, 2),
                     xl[:, W:].reshape(1, T, H, D).transpose(1, 2)) for xl in x)
        tgt = []
        for j in range(L):
            y = (planted_map(x[j], 0) + planted_map(x[(j + 13) % L], 1)
                 + 0.1 * torch.randn(T, 2 * W, generator=gs))
            tgt.append((y[:, :W].reshape(1, T, H, D).transpose(1, 2),
                        y[:, W:].reshape(1, T, H, D).transpose(1, 2)))
        return src, tuple(tgt)

    budget = int(args.max_memory_gib * 2**30)
    fitter = kvbridge.AdapterFitter(spec_a, spec_b, rope_aware=False, max_memory_bytes=budget)
    Fl, O = 2 * W, W
    one_pass = 16 * (L * Fl + L * (L + 1) // 2 * Fl * Fl + L * (L * Fl * 2 * O + 2 * O + 2))
    print(f"shapes: {L} layers x {H} KV heads x {D}; {args.samples} samples x {T} tokens; "
          f"max_memory_bytes {args.max_memory_gib:.1f} GiB")
    print(f"one-pass accumulators would take {one_pass / 2**30:.1f} GiB; passes: {fitter.passes}")
    start = time.perf_counter()
    fitter_seconds = 0.0
    for p in range(fitter.passes):
        if p > 0:
            t0 = time.perf_counter()
            fitter.next_pass()
            cand = fitter.candidate_layers()
            kept = sum(len(set(c) & set(pl)) for c, pl in zip(cand, planted))
            fitter_seconds += time.perf_counter() - t0
            print(f"next_pass: {time.perf_counter() - t0:.1f} s; candidates per target layer "
                  f"{min(map(len, cand))}..{max(map(len, cand))}; planted layers among them "
                  f"{kept}/{2 * L}", flush=True)
        add_seconds = 0.0
        for i in range(args.samples):
            src, tgt = sample(i)
            t0 = time.perf_counter()
            fitter.add(src, tgt)
            add_seconds += time.perf_counter() - t0
        fitter_seconds += add_seconds
        print(f"pass {p + 1}: accumulators {fitter.memory_bytes / 2**30:.2f} GiB, add "
              f"{add_seconds / args.samples:.1f} s per sample ({add_seconds:.0f} s), train / "
              f"held-out tokens {fitter.train_tokens} / {fitter.holdout_tokens}, peak RSS "
              f"{peak_rss_gib():.2f} GiB", flush=True)
    t0 = time.perf_counter()
    report = fitter.fit().report
    fit_seconds = time.perf_counter() - t0
    fitter_seconds += fit_seconds
    layers = report["layers"]
    selected = sum(len(set(l["source_layers"]) & set(pl)) for l, pl in zip(layers, planted))
    extra = sum(len(set(l["source_layers"]) - set(pl)) for l, pl in zip(layers, planted))
    r2 = [0.5 * (l["r2_key"] + l["r2_value"]) for l in layers]
    print(f"fit: {fit_seconds:.1f} s; planted layers selected {selected}/{2 * L}, "
          f"others selected {extra}; held-out R² mean {sum(r2) / L:.4f} min {min(r2):.4f}")
    print(f"end to end: {time.perf_counter() - start:.0f} s, of which in the fitter "
          f"{fitter_seconds:.0f} s (the rest generates the samples)")
    print(f"peak RSS of the process: {peak_rss_gib():.2f} GiB")


if __name__ == "__main__":
    main()
