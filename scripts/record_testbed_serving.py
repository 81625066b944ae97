#!/usr/bin/env python3
"""Records the shipped testbed adapters' serving defaults (LinearAdapter.serving) without
refitting them: each is loaded, measured on held-out text as the evals measure it, given the
record, and saved again (its weights, report and fingerprint unchanged).

    python scripts/record_testbed_serving.py [--tails R ...]

testbed-a -> testbed-b: the tail levers ``--tails`` scored as ``kvbridge eval`` scores them (64
held-out windows of 256 tokens, 192-token prompts); the least tail whose agreement reaches
testbed.SERVING_AGREEMENT_GOAL (0.99: 96, as testbed.BRIDGE_OPTIONS says).
testbed-a -> testbed-c (across tokenizers): ``kvbridge eval --source testbed-a --target
testbed-c`` scores no tail levers, so its one measured point is r = 0, scored as that eval does
(kvbridge.experiments.eval_cross.score_cross, its default held-out windows); the record is tail 0
with that point (kvbridge.experiments.eval_cross records the same with --save-adapter).

Reinstall the package afterwards so that the installed copies carry the records too.
"""
import argparse
import pathlib

from kvbridge.experiments import common
from kvbridge.experiments import eval as kv_eval
from kvbridge.experiments import eval_cross, testbed

ADAPTERS = (pathlib.Path(__file__).resolve().parents[1] / "python" / "kvbridge" / "experiments"
            / "testbed" / "adapters")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tails", type=int, nargs="+", default=[0, 1, 4, 16, 32, 64, 96])
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    common.set_threads(args.threads)
    common.quiet_model_loading()

    path = ADAPTERS / "testbed-a_to_testbed-b.safetensors"
    pair = testbed.load_pair()
    adapter = kv_eval.load_adapter(str(path), pair)
    fingerprint = adapter.fingerprint
    adapter.serving = kv_eval.measure_serving(pair, adapter, args.tails,
                                              testbed.SERVING_AGREEMENT_GOAL)
    adapter.save(path)
    assert kv_eval.load_adapter(str(path), pair).fingerprint == fingerprint
    print(f"{path.name}: recompute_tail {adapter.serving['recompute_tail']} "
          f"({adapter.serving['note']})")

    path = ADAPTERS / "testbed-a_to_testbed-c.safetensors"
    pair = testbed.load_pair(testbed.SOURCE_NAME, testbed.BPE_MODEL_NAME)
    adapter = kv_eval.load_adapter(str(path), pair)
    fingerprint = adapter.fingerprint
    config = eval_cross.CrossConfig()
    heldout = eval_cross.text_windows("heldout", int(testbed.MAX_CONTEXT) - 1,
                                      config.heldout_windows)
    adapter.serving = eval_cross.serving_record(
        eval_cross.score_cross(pair, heldout, config.continuation_share,
                               {adapter.alignment_policy: adapter})[adapter.alignment_policy],
        testbed.SERVING_AGREEMENT_GOAL)
    adapter.save(path)
    assert kv_eval.load_adapter(str(path), pair).fingerprint == fingerprint
    print(f"{path.name}: recompute_tail {adapter.serving['recompute_tail']} "
          f"({adapter.serving['note']})")


if __name__ == "__main__":
    main()
