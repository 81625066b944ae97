"""The end-to-end demo: testbed-b reuses testbed-a's prompt caches through kvbridge.Bridge.

Run as ``kvbridge demo`` or ``python -m kvbridge.experiments.demo`` (``scripts/demo.sh`` installs the
package and runs it). For a batch of held-out windows (a prompt followed by its true
continuation):

1. testbed-a prefills each prompt and ``Bridge.save``s its KV;
2. testbed-b answers each prompt twice, greedily: with its own prefill, and from
   ``Bridge.load`` (testbed-a's cache converted by the shipped adapter, written back as
   testbed-b's own entry) plus its own forward of the last prompt token. The time to the first
   token of each is measured, alternating, in this process;
3. kept and agreement (kvbridge.experiments.eval's definitions) are computed on the windows' true
   continuations, with the loaded (converted) cache in place of testbed-b's own;
4. across tokenizers (``--cross-prompts``, default 4; 0 leaves it out): testbed-c, whose BPE
   tokenizes text differently, answers held-out prompt texts from testbed-a's caches of them:
   the Bridge knows both tokenizers (``Bridge.add_tokenizer``), aligns the two tokenizations
   and converts through the shipped testbed-a -> testbed-c adapter
   (python/kvbridge/experiments/testbed/adapters/testbed-a_to_testbed-c.safetensors, fitted with the
   "seen" policy if missing or stale); TTFT both ways and the greedy answers side by side.

The shipped adapter is
python/kvbridge/experiments/testbed/adapters/testbed-a_to_testbed-b.safetensors;
when it is missing or was fitted for other weights (its specs' fingerprints differ from the
loaded models'), the demo says so and fits one on the training split first.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

import kvbridge
from kvbridge.experiments import eval as kv_eval
from kvbridge.experiments import eval_cross
from kvbridge.experiments.common import (Sums, int_at_least, quiet_model_loading, set_threads,
                                         testbed_module)
from kvbridge.hf import forward, prefix_kv


def _shipped_or_fitted(pair: Any, path: str, fit_windows: int, log,
                       fit: Callable[[], kvbridge.LinearAdapter]) -> Dict[str, Any]:
    """The adapter at `path` if it matches the loaded models, else fit()'s, saying why."""
    if os.path.exists(path):
        try:
            return {"adapter": kv_eval.load_adapter(path, pair), "origin": "shipped",
                    "path": path}
        except kv_eval.StaleAdapterError as e:
            reason = f"stale adapter: {e}"
    else:
        reason = f"no adapter at {path}"
    log(f"{reason}; fitting one on {fit_windows} training windows")
    t0 = time.perf_counter()
    adapter = fit()
    return {"adapter": adapter, "origin": "fitted", "path": None,
            "fit_seconds": time.perf_counter() - t0, "reason": reason}


def get_adapter(pair: Any, path: str, fit_windows: int, log=print,
                data: Any = None) -> Dict[str, Any]:
    """The adapter at `path` if it matches the loaded models, else a freshly fitted one."""
    def fit() -> kvbridge.LinearAdapter:
        max_context = int(testbed_module(data).MAX_CONTEXT)
        train = kv_eval.text_windows(pair, "train", max_context, fit_windows, data)
        return kv_eval.fit_variants(pair, train, ["rope_auto"])["rope_auto"]

    return _shipped_or_fitted(pair, path, fit_windows, log, fit)


@torch.no_grad()
def greedy(model, prompt_rest: Sequence[int], past, steps: int) -> Dict[str, Any]:
    """Greedy decoding: runs `prompt_rest` on the cache `past`, then `steps - 1` more tokens.

    Returns the generated ids and the seconds to the first one."""
    t0 = time.perf_counter()
    logits, kv = forward(model, prompt_rest, past, logits_to_keep=1)
    token = int(logits[-1].argmax())
    ttft = time.perf_counter() - t0
    out = [token]
    for _ in range(steps - 1):
        logits, kv = forward(model, [token], kv, logits_to_keep=1)
        token = int(logits[-1].argmax())
        out.append(token)
    return {"tokens": out, "ttft": ttft}


def answer_both(bridge: kvbridge.Bridge, target: Any, prompt: Sequence[int],
                generate: int) -> Tuple[Any, Dict[str, Any], Dict[str, Any]]:
    """The target's greedy answers to `prompt`: from ``bridge.load`` (its TTFT includes the
    load) and from its own prefill. Returns (the Load, the bridged answer, the own answer)."""
    t0 = time.perf_counter()
    load = bridge.load(target.spec, prompt)
    load_s = time.perf_counter() - t0
    conv = greedy(target.model, prompt[load.tokens:], load.kv, generate)
    conv["ttft"] += load_s
    own = greedy(target.model, prompt, None, generate)
    return load, conv, own


def run(pair: Any, adapter: kvbridge.LinearAdapter, windows: Sequence[Sequence[int]],
        continuation: int, generate: int, chunk_tokens: int = 16,
        min_quality: float = 0.5,
        bridge_options: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The demo's measurements (see the module docstring); returns the report dict.
    bridge_options: more Bridge keyword arguments (main passes testbed.BRIDGE_OPTIONS)."""
    src, tgt = pair.source, pair.target
    bridge = kvbridge.Bridge(kvbridge.KVStore(1 << 30, chunk_tokens=chunk_tokens),
                             min_quality=min_quality, **(bridge_options or {}))
    bridge.add_adapter(adapter)
    sums = Sums()
    rows: List[Dict[str, Any]] = []
    greedy(tgt.model, list(windows[0])[:-continuation], None, 2)  # warm-up, untimed
    for w in windows:
        w = list(w)
        p = len(w) - continuation
        prompt = w[:p]
        bridge.save(src.spec, prompt, prefix_kv(src.model, prompt))

        load, conv, own = answer_both(bridge, tgt, prompt, generate)

        # Teacher-forced continuation scores on the loaded cache (needs all but the last
        # prompt token, or the recompute_tail before it, which is what a full-chunk load returns).
        cut = load.recompute_tail if load.converted else 0
        if load.tokens and load.tokens == p - 1 - cut:
            own_kv = prefix_kv(tgt.model, prompt[:-1])
            targets = torch.as_tensor(w[p:], dtype=torch.long)
            logits_own, _ = forward(tgt.model, w[p - 1: -1], own_kv)
            logits_conv, _ = forward(tgt.model, w[load.tokens: -1], load.kv,
                                             logits_to_keep=continuation)
            logits_none, _ = forward(tgt.model, [pair.tokenizer.bos_id] + w[p: -1])
            sums.add(logits_own, logits_conv, logits_none, targets)
        rows.append({"prompt_tokens": p, "loaded_tokens": int(load.tokens),
                     "converted": bool(load.converted), "source": load.source,
                     "ttft_own_ms": 1e3 * own["ttft"], "ttft_bridge_ms": 1e3 * conv["ttft"],
                     "own_tokens": own["tokens"], "bridge_tokens": conv["tokens"],
                     "prompt_tail": pair.tokenizer.decode(prompt[-60:]),
                     "own_text": pair.tokenizer.decode(own["tokens"]),
                     "bridge_text": pair.tokenizer.decode(conv["tokens"])})
    again = bridge.load(tgt.spec, list(windows[0])[: len(windows[0]) - continuation],
                        return_kv=False)
    t_own = statistics.median(r["ttft_own_ms"] for r in rows)
    t_bridge = statistics.median(r["ttft_bridge_ms"] for r in rows)
    return {
        "prompts": len(rows), "continuation_tokens": continuation, "generate_tokens": generate,
        "rows": rows,
        "ttft_own_ms": t_own, "ttft_bridge_ms": t_bridge, "ttft_ratio": t_own / t_bridge,
        "scored": sums.metrics() if sums.tokens else None,
        "same_generation": sum(r["own_tokens"] == r["bridge_tokens"] for r in rows),
        "same_first_token": sum(r["own_tokens"][0] == r["bridge_tokens"][0] for r in rows),
        "reload_is_native": (not again.converted) and again.tokens > 0,
        "reload_native_tokens": int(again.native_tokens), "reload_tokens": int(again.tokens),
        "adapter_quality": kvbridge.Bridge.quality(adapter),
        "bridge_stats": bridge.stats(),
    }


def get_cross_adapter(pair: Any, path: str, fit_windows: int, log=print) -> Dict[str, Any]:
    """The cross-tokenizer adapter at `path` if it matches the loaded models, else one fitted
    with the "seen" policy on `fit_windows` training windows (kvbridge.experiments.eval_cross)."""
    def fit() -> kvbridge.LinearAdapter:
        train = eval_cross.text_windows("train", int(testbed_module().MAX_CONTEXT) - 1,
                                        fit_windows)
        return eval_cross.fit_policies(pair, train, ["seen"])[0]["seen"]

    return _shipped_or_fitted(pair, path, fit_windows, log, fit)


def run_cross(pair: Any, adapter: kvbridge.LinearAdapter, texts: Sequence[str], share: float,
              generate: int, chunk_tokens: int = 16, min_quality: float = 0.0) -> Dict[str, Any]:
    """The cross-tokenizer row: for each prompt text (a held-out window without its last
    `share` of bytes) the source tokenizes, prefills and saves it; the target, whose tokenizer
    differs, tokenizes the same text, loads it through the Bridge (the source's cache aligned
    and converted) and answers greedily, and again after its own prefill."""
    src, tgt = pair.source, pair.target
    bridge = kvbridge.Bridge(kvbridge.KVStore(1 << 30, chunk_tokens=chunk_tokens),
                             min_quality=min_quality)
    bridge.add_tokenizer(src.spec, src.tokenizer)
    bridge.add_tokenizer(tgt.spec, tgt.tokenizer)
    bridge.add_adapter(adapter)
    rows: List[Dict[str, Any]] = []
    for text in texts:
        prompt = eval_cross.utf8_prefix(text, int((1.0 - share) * len(text.encode("utf-8"))))
        src_ids = src.tokenizer.encode(prompt)
        bridge.save(src.spec, src_ids, prefix_kv(src.model, src_ids))
        tgt_ids = tgt.tokenizer.encode(prompt)
        if not rows:
            greedy(tgt.model, tgt_ids, None, 2)  # warm-up, untimed
        load, conv, own = answer_both(bridge, tgt, tgt_ids, generate)
        rows.append({"prompt_bytes": len(prompt.encode("utf-8")), "source_tokens": len(src_ids),
                     "prompt_tokens": len(tgt_ids), "loaded_tokens": int(load.tokens),
                     "converted": bool(load.converted), "ttft_own_ms": 1e3 * own["ttft"],
                     "ttft_bridge_ms": 1e3 * conv["ttft"], "own_tokens": own["tokens"],
                     "bridge_tokens": conv["tokens"], "prompt_tail": prompt[-60:],
                     "own_text": tgt.tokenizer.decode(own["tokens"]),
                     "bridge_text": tgt.tokenizer.decode(conv["tokens"])})
    t_own = statistics.median(r["ttft_own_ms"] for r in rows)
    t_bridge = statistics.median(r["ttft_bridge_ms"] for r in rows)
    return {"prompts": len(rows), "rows": rows, "ttft_own_ms": t_own,
            "ttft_bridge_ms": t_bridge, "ttft_ratio": t_own / t_bridge,
            "same_first_token": sum(r["own_tokens"][:1] == r["bridge_tokens"][:1] for r in rows),
            "same_generation": sum(r["own_tokens"] == r["bridge_tokens"] for r in rows),
            "adapter_quality": kvbridge.Bridge.quality(adapter),
            "alignment_policy": adapter.report.get("alignment_policy", ""),
            "bridge_stats": bridge.stats()}


def format_cross(report: Dict[str, Any], pair: Any, shown: int = 2) -> str:
    r0 = report["rows"]
    lines = [f"Across tokenizers: {pair.target.name} answers from {pair.source.name}'s cache "
             f"({report['prompts']} held-out prompts, {report['alignment_policy']} alignment, "
             f"adapter quality {report['adapter_quality']:.3f})", ""]
    lines.append(f"| prompt | bytes | {pair.source.name} tokens | {pair.target.name} tokens | "
                 "loaded | converted | TTFT own ms | TTFT kvbridge ms | ratio |")
    lines.append("|---:|---:|---:|---:|---:|:---:|---:|---:|---:|")
    for i, r in enumerate(r0):
        lines.append(f"| {i} | {r['prompt_bytes']} | {r['source_tokens']} | {r['prompt_tokens']} "
                     f"| {r['loaded_tokens']} | {'yes' if r['converted'] else 'no'} | "
                     f"{r['ttft_own_ms']:.2f} | {r['ttft_bridge_ms']:.2f} | "
                     f"{r['ttft_own_ms'] / r['ttft_bridge_ms']:.2f}x |")
    lines.append(f"| median | | | | | | {report['ttft_own_ms']:.2f} | "
                 f"{report['ttft_bridge_ms']:.2f} | {report['ttft_ratio']:.2f}x |")
    lines.append("")
    lines.append(f"same first token: {report['same_first_token']} of {report['prompts']}; "
                 f"identical greedy continuations: {report['same_generation']} of "
                 f"{report['prompts']}")
    lines.append("")
    lines.append(f"| prompt ends with | {pair.target.name}, own prefill | "
                 f"{pair.target.name}, from {pair.source.name}'s cache |")
    lines.append("|---|---|---|")
    for r in r0[:shown]:
        lines.append(f"| {_cell(r['prompt_tail'], 40, keep_end=True)} | {_cell(r['own_text'], 40)} | "
                     f"{_cell(r['bridge_text'], 40)} |")
    return "\n".join(lines)


def _cell(text: str, width: int, keep_end: bool = False) -> str:
    text = " ".join(text.split()).replace("|", "/")
    if len(text) <= width:
        return text
    return "…" + text[-(width - 1):] if keep_end else text[: width - 1] + "…"


def format_report(report: Dict[str, Any], pair: Any, shown: int = 3) -> str:
    st = report["bridge_stats"]
    lines = [f"{pair.source.name} -> {pair.target.name}: {report['prompts']} held-out prompts "
             f"of {report['rows'][0]['prompt_tokens']} tokens, adapter quality (min R²) "
             f"{report['adapter_quality']:.3f}", ""]
    lines.append("| prompt | loaded tokens | converted | TTFT own ms | TTFT kvbridge ms | ratio |")
    lines.append("|---:|---:|:---:|---:|---:|---:|")
    for i, r in enumerate(report["rows"]):
        lines.append(f"| {i} | {r['loaded_tokens']} | {'yes' if r['converted'] else 'no'} | "
                     f"{r['ttft_own_ms']:.2f} | {r['ttft_bridge_ms']:.2f} | "
                     f"{r['ttft_own_ms'] / r['ttft_bridge_ms']:.2f}x |")
    lines.append(f"| median | | | {report['ttft_own_ms']:.2f} | {report['ttft_bridge_ms']:.2f} | "
                 f"{report['ttft_ratio']:.2f}x |")
    lines.append("")
    s = report["scored"]
    if s:
        lines.append(f"kept {s['kept']:.3f}, agreement {s['agreement']:.3f} over {s['tokens']} "
                     f"continuation tokens (L_own {s['loss_own']:.3f}, L_conv "
                     f"{s['loss_conv']:.3f}, L_none {s['loss_none']:.3f} nats/token)")
    else:
        lines.append("kept / agreement: no prompt was loaded in full (see the table)")
    lines.append(f"same first token: {report['same_first_token']} of {report['prompts']}; "
                 f"identical greedy continuations: {report['same_generation']} of "
                 f"{report['prompts']}; second load of a prompt: "
                 f"{report['reload_native_tokens']} of {report['reload_tokens']} tokens from the "
                 f"target's own (written-back) entries")
    lines.append(f"bridge: {st['loads']} loads, {st['converted_hits']} converted, "
                 f"{st['native_hits']} native, {st['misses']} misses, {st['converted_tokens']} "
                 f"tokens converted in {1e3 * st['convert_seconds']:.1f} ms, lookups "
                 f"{1e3 * st['lookup_seconds']:.1f} ms")
    lines.append("")
    lines.append(f"| prompt ends with | {pair.target.name}, own prefill | "
                 f"{pair.target.name}, from {pair.source.name}'s cache |")
    lines.append("|---|---|---|")
    for r in report["rows"][:shown]:
        lines.append(f"| {_cell(r['prompt_tail'], 40, keep_end=True)} | {_cell(r['own_text'], 40)} | "
                     f"{_cell(r['bridge_text'], 40)} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvbridge demo", description=__doc__.split("\n")[0])
    at_least = int_at_least
    p.add_argument("--prompts", type=at_least(1), default=8, help="held-out prompts in the batch")
    p.add_argument("--window-tokens", type=at_least(0), default=0,
                   help="prompt + continuation tokens (0: testbed.MAX_CONTEXT)")
    p.add_argument("--continuation-tokens", type=at_least(1), default=32,
                   help="true continuation tokens scored after each prompt")
    p.add_argument("--generate", type=at_least(0), default=24, help="greedy tokens per answer")
    p.add_argument("--adapter", default=kv_eval.DEFAULT_ADAPTER)
    p.add_argument("--fit-windows", type=at_least(1), default=96,
                   help="training windows when the adapter has to be fitted")
    p.add_argument("--min-quality", type=float, default=0.5, help="Bridge quality gate")
    p.add_argument("--chunk-tokens", type=at_least(1), default=16)
    p.add_argument("--show", type=at_least(0), default=3, help="continuations printed side by side")
    p.add_argument("--cross-prompts", type=at_least(0), default=4,
                   help="prompts of the cross-tokenizer row (testbed-c from testbed-a's cache); "
                   "0 leaves the row out")
    p.add_argument("--cross-adapter", default=None,
                   help="the testbed-a -> testbed-c adapter (default: the shipped one)")
    p.add_argument("--threads", type=at_least(0), default=1,
                   help="torch (and kvbridge OpenMP) threads; 0 keeps torch's default "
                   "(see kvbridge.experiments.common.set_threads)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    args = build_parser().parse_args(argv)
    t_start = time.perf_counter()
    from kvbridge.experiments import testbed

    set_threads(args.threads)
    quiet_model_loading()
    pair = testbed.load_pair()
    window = args.window_tokens or int(testbed.MAX_CONTEXT)
    if window > testbed.MAX_CONTEXT:
        raise SystemExit(f"--window-tokens {window} exceeds testbed.MAX_CONTEXT "
                         f"{testbed.MAX_CONTEXT}")
    if not 1 <= args.continuation_tokens <= window - 2:
        raise SystemExit(f"--continuation-tokens: expected 1..{window - 2}")
    got = get_adapter(pair, args.adapter, args.fit_windows,
                      log=lambda m: print(m, file=sys.stderr))
    windows = kv_eval.text_windows(pair, "heldout", window, args.prompts)
    if not windows:
        raise SystemExit("no held-out window of that length")
    with torch.no_grad():
        report = run(pair, got["adapter"], windows, args.continuation_tokens, args.generate,
                     chunk_tokens=args.chunk_tokens, min_quality=args.min_quality,
                     bridge_options=getattr(testbed, "BRIDGE_OPTIONS", None))
    report["adapter"] = {k: v for k, v in got.items() if k != "adapter"}
    report["threads"] = torch.get_num_threads()
    print(format_report(report, pair, args.show))
    if args.cross_prompts:
        cross_pair = testbed.load_pair(testbed.SOURCE_NAME, testbed.BPE_MODEL_NAME)
        cross_got = get_cross_adapter(cross_pair, args.cross_adapter
                                      or eval_cross.DEFAULT_CROSS_ADAPTER, args.fit_windows,
                                      log=lambda m: print(m, file=sys.stderr))
        texts = eval_cross.text_windows("heldout", int(testbed.MAX_CONTEXT) - 1,
                                        args.cross_prompts)
        with torch.no_grad():
            report["cross"] = run_cross(cross_pair, cross_got["adapter"], texts, 0.25,
                                        args.generate, chunk_tokens=args.chunk_tokens,
                                        min_quality=args.min_quality)
        report["cross"]["adapter"] = {k: v for k, v in cross_got.items() if k != "adapter"}
        print()
        print(format_cross(report["cross"], cross_pair, args.show))
    report["seconds"] = time.perf_counter() - t_start
    print(f"\n(adapter: {report['adapter']['origin']}; {report['seconds']:.1f} s)")
    return report


if __name__ == "__main__":
    main()
