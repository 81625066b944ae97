"""What the target's token codes cost a fit: AdapterFitter.fit() of one set of sums with the
codes and without them, alternated in one process, at the shapes of a Gemma-3-270M ->
SmolLM2-135M fit (source layers of 512 features, 192 outputs per map, codes of width 576 with
the token before: 1,152 code features), on random data (the time does not depend on values).

Run as ``python benchmarks/python/bench_token_codes_fit.py [SOURCE_LAYERS_PER_MAP] [THREADS]``.
It prints both times and their ratio: the codes' share of the fit on this machine. The fit's
source layers are given explicitly (the same for every target layer's maps), so the time
without codes is one factorisation and the maps; the codes' terms are refitted per target layer.
"""
import statistics
import sys
import time

import torch

import kvbridge


def main() -> None:
    per_map = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    torch.set_num_threads(threads)
    source = kvbridge.ModelSpec("src", 18, 1, 256, rope_base=10000.0, rope_style="half")
    target = kvbridge.ModelSpec("tgt", 6, 3, 64, rope_base=100000.0, rope_style="half")
    vocab, width, tokens, windows = 4096, 576, 512, 8
    g = torch.Generator().manual_seed(3)
    codes = torch.randn(vocab, width, generator=g)
    layers = [list(range(i, i + per_map)) for i in range(target.num_layers)]
    data = []
    for _ in range(windows):
        src = [(torch.randn(1, 1, tokens, 256, generator=g), torch.randn(1, 1, tokens, 256, generator=g))
               for _ in range(source.num_layers)]
        tgt = [(torch.randn(1, 3, tokens, 64, generator=g), torch.randn(1, 3, tokens, 64, generator=g))
               for _ in range(target.num_layers)]
        data.append((src, tgt, torch.randint(vocab, (tokens,), generator=g).tolist()))

    def fit(with_codes: bool) -> float:
        extra = {"target_token_codes": codes} if with_codes else {}
        fitter = kvbridge.AdapterFitter(source, target, source_layers=layers, **extra)
        for src, tgt, ids in data:
            fitter.add(src, tgt, target_ids=ids if with_codes else None)
        t0 = time.perf_counter()
        fitter.fit()
        return time.perf_counter() - t0

    times = {True: [], False: []}
    for _ in range(3):
        for with_codes in (True, False):
            times[with_codes].append(fit(with_codes))
    a, b = statistics.median(times[True]), statistics.median(times[False])
    print(f"{per_map} source layers per map ({per_map * 512} features), {threads} thread(s): "
          f"fit with codes {a:.2f} s, without {b:.2f} s, ratio {a / b:.2f}")


if __name__ == "__main__":
    main()
