#!/usr/bin/env python3
"""Fits the shipped testbed-a -> testbed-b adapter and writes it into the package.

    python scripts/fit_testbed_adapter.py [--windows N] [--variant rope_auto|rope_all|naive]
        [--refine-epochs E] [--refine-windows N] [--refine-lr LR]

With --refine-epochs E > 0 the closed-form fit is then refined end to end
(kvbridge.experiments.refine: KL to testbed-b's own next-token distributions on training windows the
fit did not use, seeded, held-out early stop) and the refined adapter is what is written. One thread
(the default) makes both steps deterministic.

The written adapter records its serving defaults (LinearAdapter.serving): the tail levers
``--tails`` are scored on held-out windows as ``kvbridge eval`` scores them, and the least tail
whose agreement reaches testbed.SERVING_AGREEMENT_GOAL is what a plain kvbridge.Bridge serves
it with.

Run it whenever the testbed weights change: the adapter's specs carry the weights' version
fingerprint, and kvbridge.experiments.eval.load_adapter (used by the demo and `kvbridge eval
--adapter`)
refuses an adapter whose fingerprints differ from the loaded models'.
"""
import argparse
import pathlib

from kvbridge.experiments import common
from kvbridge.experiments import eval as kv_eval
from kvbridge.experiments import refine
from kvbridge.experiments import testbed


SHIPPED = (pathlib.Path(__file__).resolve().parents[1] / "python" / "kvbridge" / "experiments"
           / "testbed" / "adapters" / "testbed-a_to_testbed-b.safetensors")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("--windows", type=int, default=kv_eval.EvalConfig.train_windows,
                   help="training windows of testbed.MAX_CONTEXT tokens")
    p.add_argument("--variant", choices=list(kv_eval.VARIANTS), default="rope_auto")
    p.add_argument("--out", default=str(SHIPPED),
                   help="where to write it (default: the source tree's shipped adapter; "
                   "reinstall the package afterwards)")
    p.add_argument("--refine-epochs", type=int, default=0,
                   help="epochs of end-to-end refinement after the fit (0: none)")
    p.add_argument("--refine-windows", type=int, default=refine.RefineConfig.train_windows,
                   help="training windows for the refinement (after the fit's windows)")
    p.add_argument("--refine-lr", type=float, default=refine.RefineConfig.lr)
    p.add_argument("--seed", type=int, default=0, help="refinement seed")
    p.add_argument("--tails", type=int, nargs="+", default=[0, 32, 64, 96],
                   help="tail recompute lengths to measure for the serving defaults")
    p.add_argument("--threads", type=int, default=1,
                   help="torch and native threads (see kvbridge.experiments.common.set_threads); "
                   "0: default")
    args = p.parse_args()
    common.set_threads(args.threads)
    common.quiet_model_loading()
    pair = testbed.load_pair()
    adapter = kv_eval.fit_default(pair, args.out, windows=args.windows, variant=args.variant)
    if args.refine_epochs > 0:
        config = refine.RefineConfig(train_windows=args.refine_windows, epochs=args.refine_epochs,
                                     lr=args.refine_lr, seed=args.seed, skip_windows=args.windows)
        result = refine.refine(pair, adapter, args.out, args.out, config)
        adapter = result.adapter
        print(f"refined: validation KL by epoch "
              f"{[round(h['val_kl'], 6) for h in result.history]}, kept epoch {result.best_epoch}")
    adapter.serving = kv_eval.measure_serving(pair, adapter, args.tails,
                                              testbed.SERVING_AGREEMENT_GOAL)
    adapter.save(args.out)
    print(f"serving defaults: recompute_tail {adapter.serving['recompute_tail']} "
          f"({adapter.serving['note']})")
    r2 = common.layer_r2(adapter)
    print(f"wrote {args.out}: {adapter.source.name} {adapter.source.version} -> "
          f"{adapter.target.name} {adapter.target.version}, {r2['train_tokens']} training "
          f"tokens, min held-out R² {r2['quality']:.4f}")


if __name__ == "__main__":
    main()
