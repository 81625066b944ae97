"""The default fitter (source_layers="auto") on synthetic samples of a real pair's shapes.

SmolLM2-135M (30 layers x 3 KV heads x 64) and Gemma-3-270M (18 layers x 1 KV head x 256):
`--direction forward` fits 30 -> 18 (Fl = 384 features per source layer, O = 256 outputs per
map), `--direction reverse` 18 -> 30 (Fl = 512, O = 192). The samples are random but correlated
like real KV: every source layer's keys and values are a linear function of one low-rank
per-token process (a latent walk across depth, so neighbouring layers resemble each other), plus
noise; target layer j is a linear function of the source layers around its relative depth
(`--planted` of them) plus noise. RoPE is left out (rope_aware=False: the data carries no
positions; fit() does the same work either way).

Prints the time of add() (all samples) and of fit() (the part this benchmark is about), the
selection per target layer with the held-out R² after each added source layer, and the peak
resident memory.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/python/bench_fit_real_shapes.py --direction forward
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/python/bench_fit_real_shapes.py --direction reverse
"""
import argparse
import os
import resource
import time

import torch

import kvbridge

SMOL = ("smollm2-135m", 30, 3, 64)
GEMMA = ("gemma-3-270m", 18, 1, 256)


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--direction", choices=["forward", "reverse"], default="forward")
    ap.add_argument("--tokens", type=int, default=24576, help="tokens in all")
    ap.add_argument("--sample-tokens", type=int, default=2048, help="tokens per add()")
    ap.add_argument("--rank", type=int, default=96, help="rank of the latent process")
    ap.add_argument("--planted", type=int, default=4,
                    help="source layers each target layer is a function of")
    ap.add_argument("--noise", type=float, default=0.3)
    ap.add_argument("--max-source-layers", type=int, default=8)
    ap.add_argument("--min-gain", type=float, default=None,
                    help="FitOptions.min_gain (default: the fitter's); a negative one makes every "
                         "target layer take max_source_layers layers, the most work")
    ap.add_argument("--exact-candidates", type=int, default=None,
                    help="FitOptions.exact_candidates (default: the fitter's)")
    ap.add_argument("--progress", action="store_true", help="show fit()'s progress bar")
    ap.add_argument("--quiet", action="store_true", help="no per-layer selection table")
    args = ap.parse_args()

    src_shape, tgt_shape = (SMOL, GEMMA) if args.direction == "forward" else (GEMMA, SMOL)
    (sn, Ls, Hs, Ds), (tn, Lt, Ht, Dt) = src_shape, tgt_shape
    source = kvbridge.ModelSpec(sn, Ls, Hs, Ds)
    target = kvbridge.ModelSpec(tn, Lt, Ht, Dt)
    Ws, Wt, R = Hs * Ds, Ht * Dt, args.rank
    g = torch.Generator().manual_seed(0)
    # Latent walk across depth: layer l reads the latent through mix[l] = mix[l-1] + a step.
    mix, m = [], torch.randn(R, 2 * Ws, generator=g) / R ** 0.5
    for _ in range(Ls):
        m = m + 0.5 * torch.randn(R, 2 * Ws, generator=g) / R ** 0.5
        mix.append(m.clone())
    planted = []
    for j in range(Lt):
        centre = round(j * (Ls - 1) / max(Lt - 1, 1))
        lo = min(max(centre - args.planted // 2, 0), Ls - args.planted)
        planted.append(list(range(lo, lo + args.planted)))
    maps = [torch.randn(len(p) * 2 * Ws, 2 * Wt, generator=g) / (len(p) * 2 * Ws) ** 0.5
            for p in planted]

    extra = {} if args.exact_candidates is None else {"exact_candidates": args.exact_candidates}
    if args.min_gain is not None:
        extra["min_gain"] = args.min_gain
    fitter = kvbridge.AdapterFitter(source, target, rope_aware=False,
                                    max_source_layers=args.max_source_layers, **extra)
    print(f"{args.direction}: {sn} ({Ls} x {Hs} x {Ds}) -> {tn} ({Lt} x {Ht} x {Dt}); "
          f"{args.tokens} tokens in samples of {args.sample_tokens}; latent rank {R}, "
          f"{args.planted} planted source layers per target layer, noise {args.noise}; "
          f"passes {fitter.passes}, accumulators {fitter.memory_bytes / 2**30:.2f} GiB")
    t_add, done, seed = 0.0, 0, 0
    while done < args.tokens:
        T = min(args.sample_tokens, args.tokens - done)
        gs = torch.Generator().manual_seed(1000 + seed)
        z = torch.randn(T, R, generator=gs)
        x = [z @ mix[l] + args.noise * torch.randn(T, 2 * Ws, generator=gs) for l in range(Ls)]
        y = [torch.cat([x[l] for l in planted[j]], 1) @ maps[j]
             + args.noise * torch.randn(T, 2 * Wt, generator=gs) for j in range(Lt)]

        def kv(feats, H, D):
            W = H * D
            return tuple((f[:, :W].reshape(T, H, D).transpose(0, 1)[None].contiguous(),
                          f[:, W:].reshape(T, H, D).transpose(0, 1)[None].contiguous())
                         for f in feats)
        src, tgt = kv(x, Hs, Ds), kv(y, Ht, Dt)
        t0 = time.perf_counter()
        fitter.add(src, tgt)
        t_add += time.perf_counter() - t0
        done += T
        seed += 1
    print(f"add: {t_add:.1f} s; train / held-out tokens {fitter.train_tokens} / "
          f"{fitter.holdout_tokens}")
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        adapter = fitter.fit(progress=args.progress)
    except TypeError:  # a fitter without progress reporting
        adapter = fitter.fit()
    t_fit, c_fit = time.perf_counter() - t0, time.process_time() - c0
    report = adapter.report
    r2 = [0.5 * (lf["r2_key"] + lf["r2_value"]) for lf in report["layers"]]
    sizes = [len(lf["source_layers"]) for lf in report["layers"]]
    hits = sum(len(set(lf["source_layers"]) & set(p)) for lf, p in zip(report["layers"], planted))
    print(f"fit: {t_fit:.1f} s (CPU {c_fit:.1f} s, load average {os.getloadavg()[0]:.1f}); source layers per target layer {min(sizes)}..{max(sizes)} "
          f"(mean {sum(sizes) / len(sizes):.1f}); planted layers selected {hits}/"
          f"{sum(len(p) for p in planted)}; held-out R² mean {sum(r2) / len(r2):.4f} "
          f"min {min(r2):.4f}; peak RSS {peak_rss_gib():.2f} GiB")
    if not args.quiet:
        for j, lf in enumerate(report["layers"]):
            steps = lf.get("selection", [])
            path = " ".join(f"{'+' if s['accepted'] else 'x'}{s['source_layer']}:"
                            f"{0.5 * (s['r2_key'] + s['r2_value']):.4f}" for s in steps)
            print(f"  target {j:2d}: planted {planted[j]} chose {lf['source_layers']} "
                  f"R² K {lf['r2_key']:.4f} V {lf['r2_value']:.4f}"
                  + (f"; path {path}" if path else ""))


if __name__ == "__main__":
    main()
