"""What the target's token codes cost a conversion: LinearAdapter.convert of one source cache
with an adapter that takes the codes and with one that does not, alternated in one process
(medians of 9 after 2 warm-ups), at about 512 and 2,048 target tokens of held-out text.

Run as ``python benchmarks/python/bench_token_codes_convert.py WITH.safetensors
WITHOUT.safetensors [THREADS]`` with two SmolLM2-135M -> Gemma-3-270M adapters, e.g. from
``kvbridge eval ... --save-adapter`` with the default ``--token-codes 64`` and with
``--token-codes 0``: fitted on the same windows they draw on the same source layers (the
selection does not see the codes), so the ratio is the codes' term alone.
"""
import statistics
import sys
import time

import torch

import kvbridge
from kvbridge import hf, models
from kvbridge.experiments import corpus, eval_cross, real_eval


def main() -> None:
    with_path, without_path = sys.argv[1], sys.argv[2]
    threads = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    torch.set_num_threads(threads)
    pair = real_eval.Pair(models.load("smollm2-135m"), models.load("gemma3-270m"))
    with_codes = kvbridge.LinearAdapter.load(with_path)
    without = kvbridge.LinearAdapter.load(without_path)
    if not with_codes.has_token_codes or without.has_token_codes:
        raise SystemExit("expected an adapter with token codes, then one without")
    layers = [[l["source_layers"] for l in a.report["layers"]] for a in (with_codes, without)]
    print("same source layers:", layers[0] == layers[1])
    _, heldout = corpus.split_files(corpus.default_files())
    text = "\n".join(corpus.read_text(p) for p in heldout[:8])
    for n in (512, 2048):
        prompt = real_eval.prompt_of_tokens(pair.target, text, n)
        src, tgt = real_eval.encode(pair.source, prompt), real_eval.encode(pair.target, prompt)
        m = len(tgt.ids) - 1
        cached = eval_cross.Encoded(tgt.ids[:m], tgt.offsets[:m], tgt.roles[:m])
        index, _ = eval_cross.alignment("covering", src, cached)
        src_kv = hf.prefix_kv(pair.source.model, src.ids)
        runs = {"with": lambda: with_codes.convert(src_kv, alignment=index, target_ids=cached.ids),
                "without": lambda: without.convert(src_kv, alignment=index)}
        times = {k: [] for k in runs}
        for i in range(11):
            for name, run in runs.items():
                t0 = time.perf_counter()
                run()
                if i >= 2:
                    times[name].append(time.perf_counter() - t0)
        a, b = statistics.median(times["with"]), statistics.median(times["without"])
        print(f"{m} target tokens, {threads} thread(s): with codes {1e3 * a:.1f} ms, without "
              f"{1e3 * b:.1f} ms, ratio {a / b:.3f}")


if __name__ == "__main__":
    main()
