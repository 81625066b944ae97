#!/usr/bin/env python3
"""Fits the shipped testbed-a -> testbed-b adapter and writes it into the package.

    python scripts/fit_testbed_adapter.py [--windows N] [--variant rope_auto|rope_all|naive]

Run it whenever the testbed weights change: the adapter's specs carry the weights' version
fingerprint, and kvbridge.eval.load_adapter (used by the demo and `kvbridge eval --adapter`)
refuses an adapter whose fingerprints differ from the loaded models'.
"""
import argparse
import pathlib

from kvbridge import eval as kv_eval
from kvbridge import testbed


SHIPPED = (pathlib.Path(__file__).resolve().parents[1] / "python" / "kvbridge" / "testbed"
           / "adapters" / "testbed-a_to_testbed-b.safetensors")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("--windows", type=int, default=kv_eval.EvalConfig.train_windows,
                   help="training windows of testbed.MAX_CONTEXT tokens")
    p.add_argument("--variant", choices=list(kv_eval.VARIANTS), default="rope_auto")
    p.add_argument("--out", default=str(SHIPPED),
                   help="where to write it (default: the source tree's shipped adapter; "
                   "reinstall the package afterwards)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch and native threads (see kvbridge.eval.set_threads); 0: default")
    args = p.parse_args()
    kv_eval.set_threads(args.threads)
    kv_eval.quiet_model_loading()
    pair = testbed.load_pair()
    adapter = kv_eval.fit_default(pair, args.out, windows=args.windows, variant=args.variant)
    r2 = kv_eval.layer_r2(adapter)
    print(f"wrote {args.out}: {adapter.source.name} {adapter.source.version} -> "
          f"{adapter.target.name} {adapter.target.version}, {r2['train_tokens']} training "
          f"tokens, min held-out R² {r2['quality']:.4f}")


if __name__ == "__main__":
    main()
