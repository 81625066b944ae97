"""How far a conversion is from the targets, measured: the converted cache moved part of the way
toward the target's own, one half of it (keys or values) replaced by the target's own, and the
prompt simply cut to its tail with no converted cache at all.

Run as ``python -m kvbridge.experiments.headroom --source smollm2-135m --target gemma3-270m
--adapter FILE`` on the held-out windows ``kvbridge eval`` scores (same split, same metrics, the
target's own start-token KV at position 0, tail recompute as Bridge does it).

Variants of the cached prompt KV (``own``: the target's own prefill; ``conv``: the adapter's):
- ``scale=a``: own + a * (conv - own) at every layer, keys and values: the conversion's own
  error, scaled by a. a = 1 is the adapter as it is, a = 0 the target's own prefill (kept 1,
  agreement 1: the harness is sound). The held-out R² of the scaled conversion is
  1 - a² (1 - R²), so the a that reaches a target says how much the error must shrink.
- ``keys-own`` / ``values-own``: the target's own keys (values) with converted values (keys):
  which half of the conversion loses more.
- ``own-layers=A:B``: the target's own KV at layers A..B-1, converted elsewhere: where in depth
  the conversion loses most.
- ``own-bf16``: the target's own KV rounded to bfloat16, as an engine serving in bfloat16 holds
  it: how far the metrics move for a perturbation no one would call a conversion error.
- ``truncate``: no converted cache; the target prefills its start token and the last r + 1
  prompt tokens (contiguous positions, as a server that drops the head of a long prompt would).
  What the tail recompute buys without any conversion: the floor a conversion must beat.

Per variant and tail: kept, agreement (as in DESIGN.md) and ``deviation``, the mean over layers
and positions of the normalized KV error of the cached positions (kvbridge.experiments.selective's
``deviation``); ``agreement_none`` in the output is the agreement of the target with no prompt at
all, the floor of the agreement scale.
"""
from __future__ import annotations

import argparse
import json
import pathlib
from typing import Any, Dict, List, Optional, Sequence

import torch

import kvbridge
from kvbridge import hf, models
from kvbridge._tensors import KVCache
from kvbridge.experiments import common, corpus, real_eval, selective

DEFAULT_VARIANTS = ("scale=1", "scale=0.75", "scale=0.5", "scale=0.25", "scale=0", "keys-own",
                    "values-own", "own-bf16", "truncate")


def blend(conv: KVCache, own: KVCache, variant: str) -> Optional[KVCache]:
    """The cached prompt KV of `variant` (module docstring); None for ``truncate``."""
    if variant == "truncate":
        return None
    if variant == "own-bf16":
        return tuple((ok.bfloat16().to(ok.dtype), ov.bfloat16().to(ov.dtype)) for ok, ov in own)
    if variant == "keys-own":
        return tuple((ok, cv) for (_, cv), (ok, _) in zip(conv, own))
    if variant == "values-own":
        return tuple((ck, ov) for (ck, _), (_, ov) in zip(conv, own))
    name, _, value = variant.partition("=")
    if name == "own-layers":
        lo, _, hi = value.partition(":")
        if not (lo.isdigit() and hi.isdigit() and int(lo) < int(hi)):
            raise kvbridge.InvalidArgumentError(f"{variant!r}: expected own-layers=A:B with A < B")
        own_at = range(int(lo), int(hi))
        return tuple(o if i in own_at else c for i, (c, o) in enumerate(zip(conv, own)))
    if name != "scale" or not value:
        raise kvbridge.InvalidArgumentError(
            f"unknown variant {variant!r}; expected scale=A, keys-own, values-own, "
            "own-layers=A:B, own-bf16 or truncate")
    try:
        a = float(value)
    except ValueError:
        raise kvbridge.InvalidArgumentError(f"{variant!r}: expected scale=A with A a number")
    return tuple((ok + a * (ck - ok), ov + a * (cv - ov)) for (ck, cv), (ok, ov) in zip(conv, own))


def score(pair: real_eval.Pair, adapter: kvbridge.LinearAdapter, texts: Sequence[str],
          share: float, tails: Sequence[int], variants: Sequence[str] = DEFAULT_VARIANTS,
          progress: bool = True) -> Dict[str, Any]:
    """Pooled kept / agreement / deviation per variant and tail over held-out windows."""
    src_m, tgt_m = pair.source, pair.target
    start = real_eval.start_kv(tgt_m)
    sums = {(v, r): common.Sums() for v in variants for r in tails}
    deviation = {v: 0.0 for v in variants}
    computed = {r: 0 for r in tails}
    windows = prompt_tokens = agree_none = continuation = 0
    for w in real_eval.heldout_windows(pair, texts, share, progress):
        ids, p = w.ids, w.p
        own = hf.prefix_kv(tgt_m.model, ids[:p - 1])
        conv = real_eval.converted(adapter, w, hf.prefix_kv(src_m.model, w.src.ids), start)
        keeps = {r: max(1, p - 1 - r) for r in tails}  # the start token is always cached
        for v in variants:
            cached = blend(conv, own, v)
            if cached is not None:
                deviation[v] += float(selective.deviation(cached, own, range(len(own)))[1:].mean())
            for r, keep in keeps.items():
                part = start if cached is None else tuple(
                    (k[:, :, :keep], vv[:, :, :keep]) for k, vv in cached)
                logits, _ = hf.forward(tgt_m.model, ids[keep:-1], part,
                                       logits_to_keep=len(w.targets))
                sums[(v, r)].add_scored(w.reference, logits)
        for r, keep in keeps.items():
            computed[r] += p - keep
        agree_none += int((w.reference.own_top == w.logits_none.argmax(-1)).sum())
        continuation += int(w.targets.numel())
        windows += 1
        prompt_tokens += p
    if not windows:
        raise real_eval.no_windows()
    rows: Dict[str, Dict[str, Any]] = {}
    for (v, r), s in sums.items():
        rows.setdefault(v, {})[str(r)] = {
            **s.metrics(), "tail": r, "recomputed_share": computed[r] / prompt_tokens,
            "deviation": None if v == "truncate" else deviation[v] / windows}
    return {"windows": windows, "prompt_tokens": prompt_tokens,
            "agreement_none": agree_none / continuation, "variants": rows}


def format_table(results: Dict[str, Any]) -> str:
    lines = ["| variant | tail | share computed | deviation | kept | agreement |",
             "|---|---:|---:|---:|---:|---:|"]
    for v, rows in results["variants"].items():
        for r, m in sorted(rows.items(), key=lambda kv: int(kv[0])):
            dev = "-" if m["deviation"] is None else f"{m['deviation']:.3f}"
            lines.append(f"| {v} | {r} | {100 * m['recomputed_share']:.1f}% | {dev} | "
                         f"{m['kept']:.3f} | {m['agreement']:.3f} |")
    lines.append(f"\nagreement with no prompt at all: {results['agreement_none']:.3f} "
                 f"({results['windows']} windows, {results['prompt_tokens']} prompt tokens)")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m kvbridge.experiments.headroom",
                                description=__doc__.split("\n\n")[0])
    common.add_real_pair_arguments(p)
    p.add_argument("--adapter", required=True, help="adapter file (fitted on training files)")
    p.add_argument("--tails", type=common.int_at_least(0), nargs="+", default=[0, 32, 64])
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS))
    p.add_argument("--heldout-windows", type=common.int_at_least(1), default=12)
    p.add_argument("--threads", type=common.int_at_least(0), default=1)
    p.add_argument("--out", default="headroom-out")
    args = p.parse_args(argv)
    for v in args.variants:
        blend((), (), v)  # an unknown variant fails before the models load
    config = real_eval.RealConfig(heldout_windows=args.heldout_windows)
    common.set_threads(args.threads)
    _, heldout_files = corpus.split_files(corpus.default_files(), config.heldout_share, config.seed)
    heldout = corpus.windows(heldout_files, config.window_bytes, config.heldout_windows)
    pair = real_eval.Pair(models.load(args.source), models.load(args.target))
    results = score(pair, kvbridge.LinearAdapter.load(args.adapter), heldout,
                    config.continuation_share, args.tails, args.variants)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "headroom.json").write_text(json.dumps(
        {"source": args.source, "target": args.target, "adapter": args.adapter, **results},
        indent=1, default=common.finite_or_null))
    print(format_table(results))
    return results


if __name__ == "__main__":
    main()
