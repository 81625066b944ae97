"""kept and agreement of testbed-b when the prompt caches pass through an int8 store.

On held-out windows (the kvbridge.experiments.eval split and definitions: a prompt of P tokens, the
cache covers its first P - 1, the target runs the rest and is scored on the continuation), compares
four caches for the same prefix:

- own, native store:   testbed-b's own prefill, stored and matched (bit-exact: kept = 1);
- own, int8 store:     the same through KVStore(storage="int8") (quantization alone);
- converted, native:   testbed-a's cache stored natively, matched, converted by the adapter;
- converted, int8:     testbed-a's cache through the int8 store, then converted.

    .venv/bin/python benchmarks/python/bench_int8_kept.py [--windows 64]
"""
import argparse

import torch

import kvbridge
from kvbridge import hf
from kvbridge.experiments import common
from kvbridge.experiments import eval as kveval
from kvbridge.experiments import testbed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--chunk-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    common.set_threads(args.threads)
    common.quiet_model_loading()
    pair = testbed.load_pair()
    adapter = kveval.load_adapter(kveval.DEFAULT_ADAPTER, pair)
    chunk, window = args.chunk_tokens, testbed.MAX_CONTEXT
    # The cached prefix (P - 1 tokens) is a whole number of chunks, so the store keeps all of it.
    prefix = (window * 3 // 4) // chunk * chunk
    continuation = window - prefix - 1
    windows = kveval.text_windows(pair, "heldout", window, args.windows)
    stores = {s: kvbridge.KVStore(capacity_bytes=1 << 30, chunk_tokens=chunk, storage=s)
              for s in ("native", "int8")}
    a, b = pair.source, pair.target

    def through(store, spec, ids, kv):
        store.put(spec, ids, kv)
        hit = store.match(spec, ids)
        assert hit.tokens == len(ids), (hit.tokens, len(ids))
        return hit.kv

    converters = {
        "own, native store": lambda ids: through(stores["native"], b.spec, ids,
                                                 hf.prefix_kv(b.model, ids)),
        "own, int8 store": lambda ids: through(stores["int8"], b.spec, ids,
                                               hf.prefix_kv(b.model, ids)),
        "converted, native store": lambda ids: adapter.convert(
            through(stores["native"], a.spec, ids, hf.prefix_kv(a.model, ids))),
        "converted, int8 store": lambda ids: adapter.convert(
            through(stores["int8"], a.spec, ids, hf.prefix_kv(a.model, ids))),
    }
    with torch.no_grad():
        results = kveval.score_windows(b.model, windows, continuation, pair.tokenizer.bos_id,
                                       lambda ids: list(ids), converters)
    bytes_per = {s: st.stats()["memory"]["bytes_used"] for s, st in stores.items()}
    print(f"{len(windows)} held-out windows of {window} tokens: cached prefix {prefix} tokens "
          f"({prefix // chunk} chunks of {chunk}), {continuation} continuation tokens scored each")
    print()
    print("| cache | kept | agreement | L_conv nats/token |")
    print("|---|---:|---:|---:|")
    for name, m in results.items():
        print(f"| {name} | {m['kept']:.4f} | {m['agreement']:.4f} | {m['loss_conv']:.4f} |")
    print()
    print(f"L_own {results['own, native store']['loss_own']:.4f}, L_none "
          f"{results['own, native store']['loss_none']:.4f}; store bytes int8 / native "
          f"{bytes_per['int8'] / bytes_per['native']:.3f} (float32 models; int8 / bfloat16 "
          f"would be {2 * bytes_per['int8'] / bytes_per['native']:.3f})")


if __name__ == "__main__":
    main()
