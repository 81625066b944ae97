"""Evaluation of an adapter between two real pretrained models: kept, agreement, held-out R²,
TTFT ratio, on text none of us wrote.

Run as ``kvbridge eval --source smollm2-135m --target gemma3-270m`` (any two models
kvbridge.models loads: short names, Hugging Face folders, GGUF files; ``--text FILE...`` for
other text; ``--help`` lists the options).

Data (kvbridge.experiments.corpus). Files are split into training and held-out files by a hash
of their name; windows of ``window_bytes`` bytes are cut from them. Adapters are fitted on
windows of training files only; every metric is measured on windows of held-out files.

Fitting. Both models prefill each training window from position 0 with their own tokenizers
(each sequence opens with the model's start token) into caches that keep every token
(kvbridge.hf.full_cache), and the pairs are streamed into one kvbridge.AdapterFitter:
RoPE-aware, ``source_layers`` as given (default "auto", the fitter's default), target token j
paired with source token a(j) of the alignment policy (default kvbridge's), the start tokens
paired by role; for a target with a key norm (QK-norm, as Gemma 3 has) its gains
(kvbridge.hf.key_norm), so the adapter keeps converted keys on the target's norm; and the target's
token codes (kvbridge.hf.token_codes, compressed by the fitter to ``token_codes`` dims; 0 for
none), so each map also takes which target tokens a position and the one before it hold (the
alignment loses that).

Metrics (DESIGN.md). A held-out window is cut at byte ``(1 - share) * n``: the target's tokens
from there on are the continuation, the ones before it the prompt. As on the Bridge path the
target computes at least the last prompt token itself; with tail recompute r it computes the
last r + 1. ``L_own``: the target's own prefill of the cached prompt tokens; ``L_conv``: the
source's prefill of the same text, converted; ``L_none``: the start token alone before the
continuation. ``kept = (L_none - L_conv) / (L_none - L_own)``, pooled over all continuation
tokens; ``agreement``: share of continuation positions whose greedy token with the converted
cache equals the one with the target's own (teacher forced). The converted cache's first token
(the start token) is the target's own KV of it, as kvbridge.Bridge serves it (Bridge.add_start);
``--converted-start`` scores the conversion of it too, as an ablation.

Longer prompts. The same tails are scored again on ``long_heldout_windows`` windows of each
of ``long_window_bytes``' sizes (bytes) of the same held-out files, with a continuation of as
many bytes as the main windows' (by default 6,144 and 16,384 bytes, about 1,550 and 4,300
target tokens; ``--long-window-bytes 0``: none). The same continuation agrees less with the
converted cache after a longer prompt, so the serving record saved with ``--save-adapter`` must
reach the agreement goal at every length scored.

Serving record. At each prompt length scored, the least measured tail whose agreement reaches
``agreement_goal`` (serving_record, kvbridge.adapter.choose_serving: the tails by length, and
past the longest the largest share any length needed); evaluate() records it on the adapter
(LinearAdapter.serving), so that ``--save-adapter`` saves it and kvbridge.Bridge serves with it.

TTFT ratio. For prompts of about ``ttft_tokens`` target tokens cut from held-out text: the
target's own prefill and first token, against aligning both tokenizations, converting the
source's cache (as a store would hold it) and the target's forward of the rest; once with no
tail recompute and once with the tail kvbridge.Bridge serves under the record
(Bridge.recompute_tail_for: that prompt's length decides it), whose conversion covers only the
tokens before the tail. Medians over alternating repeats after a warm-up, in one process.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

import kvbridge
from kvbridge import models
from kvbridge._tensors import KVCache
from kvbridge.adapter import choose_serving
from kvbridge.experiments import corpus, eval_cross
from kvbridge.experiments.common import (Reference, Sums, alternate_timings, finite_or_null,
                                         int_at_least, layer_r2, next_token, progress_items,
                                         save_adapter, set_threads)
from kvbridge import hf
from kvbridge.hf import forward, prefix_kv


@dataclass(frozen=True)
class Pair:
    source: models.LoadedModel
    target: models.LoadedModel


#: --agreement-goal's default.
DEFAULT_AGREEMENT_GOAL = 0.85


@dataclass
class RealConfig:
    """What a run does; the defaults are the ones the README's figures use."""

    window_bytes: int = 1536
    continuation_share: float = 0.25
    train_windows: int = 128
    heldout_windows: int = 24
    heldout_share: float = 0.25
    policy: str = "covering"
    source_layers: str = "auto"        # "auto" (the fitter's default), "all" or k: k nearest in depth
    # 384 besides 256 and 512: the longer prompts need a tail between them (record 260).
    tails: List[int] = field(default_factory=lambda: [0, 16, 32, 64, 128, 256, 384, 512])
    ttft_tokens: List[int] = field(default_factory=lambda: [512, 2048])
    ttft_repeats: int = 3
    converted_start: bool = False      # ablation: the start token's KV converted too
    token_codes: int = 128             # width of the target's token codes; 0: none
    # The curve is scored again on longer held-out prompts: windows of each of these sizes with the
    # same continuation (continuation_share * window_bytes bytes) after a prompt of about 1,550
    # target tokens at 6,144 and about 4,300 at 16,384; the serving record must reach the
    # agreement goal on every length, since the same tail agrees less after a longer converted
    # prompt (record 255), and it records the tail each length needs, which serves prompts up to
    # the longest with less than one share would (record 270). Each size exceeds window_bytes;
    # []: the main windows alone.
    long_window_bytes: List[int] = field(default_factory=lambda: [6144, 16384])
    long_heldout_windows: int = 12
    # The serving record (serving_record) is the least measured tail reaching this agreement.
    agreement_goal: float = DEFAULT_AGREEMENT_GOAL
    seed: int = 0


def serving_record(results: Dict[str, Any], agreement_goal: float) -> Dict[str, Any]:
    """The serving defaults (LinearAdapter.serving) of the results' measured tails, those of
    each of results["long"] (the longer prompts) too: per tail and prompt length its kept,
    agreement, share of the prompt computed and mean prompt tokens; per length the least tail
    reaching agreement_goal (kvbridge.adapter.choose_serving)."""
    points, windows = [], []
    for curve in [results["tails"]] + [c["tails"] for c in results.get("long", [])]:
        for r, v in curve.items():
            points.append({"recompute_tail": int(r), "kept": finite_or_null(v["kept"]),
                           "agreement": finite_or_null(v["agreement"]),
                           "computed_share": v["recomputed_share"],
                           "prompt_tokens": int(round(v["prompt_tokens"] / v["windows"]))})
        if curve:
            windows.append(str(next(iter(curve.values()))["windows"]))
    return choose_serving(points, agreement_goal,
                          f"real eval, {' + '.join(windows)} held-out windows "
                          "(prompt_tokens: their mean)")


def long_continuation_share(config: RealConfig, window_bytes: int) -> float:
    """The continuation share of longer prompts' windows of `window_bytes`: the same
    continuation bytes as the main windows', so the curves differ in the prompt's length only."""
    return config.continuation_share * config.window_bytes / window_bytes


def nearest_layers(source_layers: int, target_layers: int, k: int) -> List[List[int]]:
    """Per target layer, the k source layers nearest to it in relative depth."""
    k = max(1, min(k, source_layers))
    out = []
    for j in range(target_layers):
        centre = (j + 0.5) / target_layers * source_layers - 0.5
        order = sorted(range(source_layers), key=lambda i: (abs(i - centre), i))
        out.append(sorted(order[:k]))
    return out


def fitter_options(pair: Pair, config: RealConfig) -> Dict[str, Any]:
    layers: Any = config.source_layers
    if layers not in ("auto", "all"):
        layers = nearest_layers(pair.source.spec.num_layers, pair.target.spec.num_layers,
                                int(layers))
    codes = hf.token_codes(pair.target.model) if config.token_codes else None
    return {"rope_aware": True, "source_layers": layers, "alignment_policy": config.policy,
            "seed": config.seed, "target_key_norm": hf.key_norm(pair.target.model),
            "target_token_codes": codes, "token_code_dims": config.token_codes}


def encode(model: models.LoadedModel, text: str) -> eval_cross.Encoded:
    return eval_cross.Encoded(*kvbridge.token_offsets(model.tokenizer, text, add_bos=True))


def fit(pair: Pair, texts: Sequence[str], config: RealConfig,
        progress: bool = True) -> kvbridge.LinearAdapter:
    """An adapter fitted on the paired KV of `texts` (module docstring)."""
    fitter = kvbridge.AdapterFitter(pair.source.spec, pair.target.spec,
                                    **fitter_options(pair, config))
    for pass_index in range(fitter.passes):  # two when a probe pass ranks layers first
        if pass_index > 0:
            fitter.next_pass()
        for text in progress_items(texts, progress, desc="paired KV"):
            src, tgt = encode(pair.source, text), encode(pair.target, text)
            index, _ = eval_cross.alignment(config.policy, src, tgt)
            fitter.add(prefix_kv(pair.source.model, src.ids),
                       prefix_kv(pair.target.model, tgt.ids), alignment=index,
                       target_ids=tgt.ids)
    return fitter.fit(progress=progress)


def start_kv(model: models.LoadedModel) -> KVCache:
    """The model's own KV of its start token at position 0: the same in every prompt."""
    return prefix_kv(model.model, [model.bos_id])


def with_own_start(kv: KVCache, start: KVCache) -> KVCache:
    """`kv` with its first token's KV replaced by the target's own start-token KV."""
    out = []
    for (k, v), (sk, sv) in zip(kv, start):
        k, v = k.clone(), v.clone()
        k[:, :, :1], v[:, :, :1] = sk, sv
        out.append((k, v))
    return tuple(out)


@dataclass
class HeldOutWindow:
    """One held-out window as every scorer takes it: the target's ids, the prompt length p (the
    cache holds ids[0..p-1)), eval_cross.references' outputs, and the source's tokenization of
    the cached prefix's text."""

    ids: List[int]
    p: int
    targets: torch.Tensor
    logits_own: torch.Tensor
    logits_none: torch.Tensor
    cached: eval_cross.Encoded
    src: eval_cross.Encoded
    reference: Reference  # of logits_own, logits_none and targets, for Sums.add_scored


def heldout_windows(pair: Pair, texts: Sequence[str], share: float,
                    progress: bool = True) -> Iterator[HeldOutWindow]:
    """The windows of `texts` split at `share` (those too short to split are left out)."""
    tgt_m = pair.target
    for text in progress_items(texts, progress, desc="held-out windows"):
        split = eval_cross.split_window(tgt_m.tokenizer, text, share)
        if split is None:
            continue
        targets, logits_own, logits_none, cached = eval_cross.references(tgt_m.model, split,
                                                                         tgt_m.bos_id)
        yield HeldOutWindow(split.target.ids, split.p, targets, logits_own, logits_none, cached,
                            encode(pair.source, split.prefix_text),
                            Reference.of(logits_own, logits_none, targets))


def converted(adapter: kvbridge.LinearAdapter, window: HeldOutWindow, src_kv: KVCache,
              start: Optional[KVCache]) -> KVCache:
    """The window's cached prefix converted from the source's KV `src_kv` through the adapter's
    alignment policy; with `start`, its first token's KV replaced by it (with_own_start)."""
    index, _ = eval_cross.alignment(adapter.alignment_policy or "covering", window.src,
                                    window.cached)
    conv = adapter.convert(src_kv, alignment=index, target_ids=window.cached.ids)
    return conv if start is None else with_own_start(conv, start)


def no_windows() -> kvbridge.InvalidArgumentError:
    return kvbridge.InvalidArgumentError("no held-out window could be split (too short for the share)")


def score(pair: Pair, adapter: kvbridge.LinearAdapter, texts: Sequence[str], share: float,
          tails: Sequence[int], progress: bool = True,
          own_start: bool = True) -> Dict[int, Dict[str, Any]]:
    """Pooled kept / agreement / losses per tail recompute length (module docstring).
    own_start: the start token's KV is the target's own (start_kv), as kvbridge.Bridge serves
    it (Bridge.add_start); False scores the conversion of the start token too (an ablation)."""
    src_m, tgt_m = pair.source, pair.target
    start = start_kv(tgt_m) if own_start else None
    sums = {r: Sums() for r in tails}
    computed = {r: 0 for r in tails}  # prompt tokens the target computes itself, per tail
    windows = prefix_tokens = 0
    for w in heldout_windows(pair, texts, share, progress):
        ids, p = w.ids, w.p
        conv = converted(adapter, w, prefix_kv(src_m.model, w.src.ids), start)
        for r in tails:
            keep = max(1, p - 1 - r)  # the start token always comes from the cache
            computed[r] += p - keep
            part = tuple((k[:, :, :keep], v[:, :, :keep]) for k, v in conv)
            # Logits of the continuation only: the tail's would be computed and dropped.
            logits_conv, _ = forward(tgt_m.model, ids[keep:-1], part,
                                     logits_to_keep=len(w.targets))
            sums[r].add_scored(w.reference, logits_conv)
        windows += 1
        prefix_tokens += p - 1
    if not windows:
        raise no_windows()
    return {r: {**s.metrics(), "tail": r, "windows": windows, "prefix_tokens": prefix_tokens,
                "prompt_tokens": prefix_tokens + windows,
                "recomputed_share": computed[r] / (prefix_tokens + windows)}
            for r, s in sums.items()}


def score_long(pair: Pair, adapter: kvbridge.LinearAdapter, heldout_files: Sequence[pathlib.Path],
               config: RealConfig, count: int, progress: bool = True) -> Dict[str, Any]:
    """The longer prompts' curves at config.tails (module docstring), shortest first, as
    results.json holds them: {"long": [{"window_bytes", "heldout_windows", "tails"}, ...]}, which
    serving_record takes; {} when config.long_window_bytes is empty. `count` windows of held-out
    files per size. InvalidArgumentError for a size not above config.window_bytes (checked
    before any scoring), or one no held-out file holds."""
    sizes = sorted(set(config.long_window_bytes))
    short = [b for b in sizes if b <= config.window_bytes]
    if short:
        raise kvbridge.InvalidArgumentError(
            f"long_window_bytes: each size must exceed window_bytes ({config.window_bytes}), got "
            f"{short[0]} (--long-window-bytes; 0 alone leaves the longer prompts out)")
    curves = []
    for size in sizes:
        windows = corpus.windows(heldout_files, size, count)
        if not windows:
            raise kvbridge.InvalidArgumentError(
                f"no held-out file holds {size} bytes for the longer prompts' check "
                "(--long-window-bytes; 0 alone leaves it out)")
        scores = score(pair, adapter, windows, long_continuation_share(config, size),
                       config.tails, progress, own_start=not config.converted_start)
        curves.append({"window_bytes": size, "heldout_windows": len(windows),
                       "tails": {str(r): v for r, v in scores.items()}})
    return {"long": curves} if curves else {}


def prompt_of_tokens(model: models.LoadedModel, text: str, tokens: int) -> str:
    """The longest prefix of `text` (cut at a line end where one is near) that the model
    tokenizes into at most `tokens` tokens."""
    ids, offsets, _ = kvbridge.token_offsets(model.tokenizer, text, add_bos=True)
    if len(ids) <= tokens:
        return text
    end = offsets[tokens - 1][1]
    return text.encode("utf-8")[:end].decode("utf-8", errors="ignore")


@torch.no_grad()
def measure_ttft(pair: Pair, adapter: kvbridge.LinearAdapter, prompts: Sequence[str],
                 repeats: int) -> List[Dict[str, Any]]:
    """Own prefill vs converted cache, per prompt (module docstring): with no tail, and, when
    the adapter has a serving record, with the tail the Bridge serves for that prompt's length
    ("served_*" keys; the same as no tail where that tail is 0)."""
    src_m, tgt_m = pair.source, pair.target
    start = start_kv(tgt_m)  # registered once, as with Bridge.add_start
    # The Bridge's own rule for the tail of a prompt's length (no store use; any store will do).
    bridge = kvbridge.Bridge(kvbridge.KVStore(1 << 20))
    rows = []
    for prompt in prompts:
        n = len(encode(tgt_m, prompt).ids)
        src_kv = prefix_kv(src_m.model, encode(src_m, prompt).ids)  # as a store holds it
        out: Dict[str, int] = {}

        def own():
            out["own"] = next_token(tgt_m.model, encode(tgt_m, prompt).ids)

        def with_tail(tail: int, name: str) -> Callable[[], None]:
            def run() -> None:
                src, tgt = encode(src_m, prompt), encode(tgt_m, prompt)
                keep = max(1, len(tgt.ids) - 1 - tail)  # the start token comes from the cache
                cached = eval_cross.Encoded(tgt.ids[:keep], tgt.offsets[:keep],
                                            tgt.roles[:keep])
                index, _ = eval_cross.alignment(adapter.alignment_policy or "covering", src,
                                                cached)
                kv = with_own_start(adapter.convert(src_kv, alignment=index,
                                                    target_ids=cached.ids), start)
                out[name] = next_token(tgt_m.model, tgt.ids[keep:], kv)
            return run

        paths = {"converted": with_tail(0, "converted")}
        served_tail = bridge.recompute_tail_for(adapter, n) if adapter.serving else 0
        if served_tail:
            paths["served"] = with_tail(served_tail, "served")
        a, times = alternate_timings(own, paths, repeats)
        b = times["converted"]
        row = {"target_tokens": n, "own_ms": 1e3 * a, "converted_ms": 1e3 * b, "ratio": a / b,
               "same_first_token": out["own"] == out["converted"]}
        if adapter.serving:
            c = times.get("served", b)
            row.update({"served_tail": served_tail, "served_ms": 1e3 * c, "served_ratio": a / c,
                        "served_same_first_token": out["own"] == out.get("served",
                                                                         out["converted"])})
        rows.append(row)
    return rows


def model_record(m: models.LoadedModel) -> Dict[str, Any]:
    s = m.spec
    return {"name": s.name, "path": str(m.path), "version": s.version, "tokenizer": s.tokenizer,
            "fingerprint": s.fingerprint, "num_layers": s.num_layers,
            "num_kv_heads": s.num_kv_heads, "head_dim": s.head_dim,
            "model_type": m.model.config.model_type,
            "parameters": sum(p.numel() for p in m.model.parameters())}


def evaluate(pair: Pair, config: RealConfig, files: Sequence[pathlib.Path],
             adapter: Optional[kvbridge.LinearAdapter] = None,
             progress: bool = True) -> Tuple[Dict[str, Any], kvbridge.LinearAdapter]:
    """Fits (unless given an adapter) and scores; returns results.json's content and the
    adapter, its serving record (LinearAdapter.serving) set from this run's curves."""
    train_files, heldout_files = corpus.split_files(files, config.heldout_share, config.seed)
    if not train_files or not heldout_files:
        raise kvbridge.InvalidArgumentError(f"text: {len(files)} files split into {len(train_files)} training "
                                            f"and {len(heldout_files)} held-out files; both need some")
    timings: Dict[str, float] = {}
    fitted_here = adapter is None
    train = (corpus.windows(train_files, config.window_bytes, config.train_windows)
             if fitted_here else [])
    heldout = corpus.windows(heldout_files, config.window_bytes, config.heldout_windows)
    if fitted_here:
        t0 = time.perf_counter()
        adapter = fit(pair, train, config, progress)
        timings["fit_seconds"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    scores = score(pair, adapter, heldout, config.continuation_share, config.tails, progress,
                   own_start=not config.converted_start)
    timings["score_seconds"] = time.perf_counter() - t1
    t1 = time.perf_counter()
    long = score_long(pair, adapter, heldout_files, config, config.long_heldout_windows,
                      progress)
    if long:
        timings["long_score_seconds"] = time.perf_counter() - t1
    tails = {str(r): v for r, v in scores.items()}
    serving = serving_record({"tails": tails, **long}, config.agreement_goal)
    adapter.serving = serving
    long_text = "\n".join(corpus.read_text(p) for p in heldout_files[:8])
    prompts = [prompt_of_tokens(pair.target, long_text, n) for n in config.ttft_tokens]
    t2 = time.perf_counter()
    ttft = measure_ttft(pair, adapter, prompts, config.ttft_repeats)
    timings["ttft_seconds"] = time.perf_counter() - t2
    results = {
        "config": asdict(config),
        "models": {"source": model_record(pair.source), "target": model_record(pair.target)},
        "text": {"train": corpus.describe(train_files), "heldout": corpus.describe(heldout_files),
                 "fitted_here": fitted_here, "train_windows": len(train),
                 "heldout_windows": len(heldout),
                 "heldout_files": [p.name for p in heldout_files]},
        "adapter": {**layer_r2(adapter), "report": adapter.report},
        "tails": tails,
        **long,
        "serving": serving,
        "ttft": {"rows": ttft, "threads": torch.get_num_threads()},
        "timings": timings,
        "kvbridge_version": kvbridge.__version__,
        "torch_version": torch.__version__,
    }
    return results, adapter


def curve_table(tails: Dict[str, Dict[str, Any]]) -> List[str]:
    lines = ["| tail recomputed | share of prompt computed | kept | agreement | L_own | L_conv | "
             "L_none | continuation tokens |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r, v in tails.items():
        lines.append(f"| {r} | {v['recomputed_share']:.3f} | {v['kept']:.3f} | {v['agreement']:.3f} | "
                     f"{v['loss_own']:.3f} | {v['loss_conv']:.3f} | {v['loss_none']:.3f} | "
                     f"{v['tokens']} |")
    return lines


def format_table(results: Dict[str, Any]) -> str:
    m, t, cfg = results["models"], results["text"], results["config"]
    fitted = (f"fitted on {t['train_windows']} windows of {cfg['window_bytes']} bytes from "
              f"{t['train']['files']} files" if t["fitted_here"]
              else "a given adapter (not fitted in this run)")
    lines = [f"{m['source']['name']} -> {m['target']['name']}: {fitted}, scored on "
             f"{t['heldout_windows']} windows of {cfg['window_bytes']} bytes from "
             f"{t['heldout']['files']} held-out files "
             f"(continuation: the last {cfg['continuation_share']:g} of each); alignment "
             f"{cfg['policy']}, source layers {cfg['source_layers']}", ""]
    lines += curve_table(results["tails"])
    for long in results.get("long", []):
        first = next(iter(long["tails"].values()))
        lines += ["", f"Longer prompts: {long['heldout_windows']} windows of "
                  f"{long['window_bytes']} bytes from the same held-out files (mean prompt "
                  f"{first['prompt_tokens'] / first['windows']:.0f} tokens)", ""]
        lines += curve_table(long["tails"])
    a = results["adapter"]
    mean = lambda xs: sum(xs) / len(xs)
    lines += ["", f"held-out R² of the fit: mean K {mean(a['r2_key']):.3f}, mean V "
              f"{mean(a['r2_value']):.3f}, min {a['quality']:.3f}", ""]
    s = results["serving"]
    lines.append(f"Serving record (agreement goal {cfg['agreement_goal']:g}): recompute_tail "
                 f"{s['recompute_tail']}, recompute_share {s['recompute_share']:.4g}; {s['note']}")
    lines.append("")
    lines.append(f"TTFT of {m['target']['name']} (threads {results['ttft']['threads']}): own prefill vs "
                 "align + convert + forward of the rest, with no tail and with the served one")
    lines.append("")
    lines.append("| target tokens | own ms | no tail: ms | ratio | same first token | served tail "
                 "| ms | ratio | same first token |")
    lines.append("|---:|---:|---:|---:|---|---:|---:|---:|---|")
    yes = lambda b: "yes" if b else "no"
    for r in results["ttft"]["rows"]:
        lines.append(f"| {r['target_tokens']} | {r['own_ms']:.0f} | {r['converted_ms']:.0f} | "
                     f"{r['ratio']:.2f}x | {yes(r['same_first_token'])} | {r['served_tail']} | "
                     f"{r['served_ms']:.0f} | {r['served_ratio']:.2f}x | "
                     f"{yes(r['served_same_first_token'])} |")
    return "\n".join(lines)


def plot(results: Dict[str, Any], path: str) -> None:
    """eval.png: held-out R² per target layer, and kept and agreement against the share of the
    prompt the target computes itself."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a, tails = results["adapter"], results["tails"]
    fig, (ax_r2, ax_curve) = plt.subplots(1, 2, figsize=(11, 4))
    layers = range(len(a["r2_key"]))
    ax_r2.plot(layers, a["r2_key"], marker="o", label="K")
    ax_r2.plot(layers, a["r2_value"], marker="s", linestyle="--", label="V")
    ax_r2.set_xlabel("target layer")
    ax_r2.set_ylabel("held-out R²")
    ax_r2.set_title("adapter fit per target layer")
    ax_r2.legend(fontsize=8)
    share = [v["recomputed_share"] for v in tails.values()]
    ax_curve.plot(share, [v["kept"] for v in tails.values()], marker="o", label="kept")
    ax_curve.plot(share, [v["agreement"] for v in tails.values()], marker="s", label="agreement")
    for curve in results.get("long", []):
        long = curve["tails"].values()
        share_long = [v["recomputed_share"] for v in long]
        ax_curve.plot(share_long, [v["kept"] for v in long], marker="o", linestyle=":",
                      label=f"kept, {curve['window_bytes']}-byte windows")
        ax_curve.plot(share_long, [v["agreement"] for v in long], marker="s", linestyle=":",
                      label=f"agreement, {curve['window_bytes']}-byte windows")
    for r, v in tails.items():
        ax_curve.annotate(f"tail {r}", (v["recomputed_share"], v["kept"]), fontsize=7)
    ax_curve.axhline(1.0, color="gray", linewidth=0.8)
    ax_curve.set_xlabel("share of the prompt the target computes")
    ax_curve.set_title(f"{results['models']['source']['name']} -> "
                       f"{results['models']['target']['name']}, held-out")
    ax_curve.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    at_least = int_at_least
    d = RealConfig()
    p = argparse.ArgumentParser(prog="kvbridge eval", description=__doc__.split("\n")[0])
    p.add_argument("--source", required=True, help="short name, model folder or GGUF file")
    p.add_argument("--target", required=True, help="short name, model folder or GGUF file")
    p.add_argument("--text", nargs="+", default=None, metavar="FILE",
                   help="text files (default: the Python standard library's source and "
                   "Debian's license texts; see kvbridge.experiments.corpus)")
    p.add_argument("--out", default="eval-out", help="directory for results.json and eval.png")
    p.add_argument("--save-adapter", metavar="PATH",
                   help="save the adapter here, with its serving defaults (LinearAdapter.serving) "
                   "from the measured tails")
    p.add_argument("--agreement-goal", type=float, default=DEFAULT_AGREEMENT_GOAL,
                   help="the serving record (the saved adapter's, and the tail the TTFT rows "
                   "serve) holds, per prompt length scored, the least measured tail whose "
                   "agreement reaches this (else the largest measured, with a note)")
    p.add_argument("--adapter", metavar="PATH", help="score this adapter instead of fitting one")
    p.add_argument("--window-bytes", type=at_least(64), default=d.window_bytes)
    p.add_argument("--continuation-share", type=float, default=d.continuation_share)
    p.add_argument("--long-window-bytes", type=at_least(0), nargs="+",
                   default=d.long_window_bytes,
                   help="also score the curve on held-out windows of each of these sizes (longer "
                   "prompts; each above --window-bytes), and record the serving tail that reaches "
                   "the agreement goal on every length; 0: the main windows alone")
    p.add_argument("--long-heldout-windows", type=at_least(1), default=d.long_heldout_windows)
    p.add_argument("--train-windows", type=at_least(1), default=d.train_windows)
    p.add_argument("--heldout-windows", type=at_least(1), default=d.heldout_windows)
    p.add_argument("--policy", default=d.policy, choices=list(kvbridge.ALIGN_POLICIES))
    p.add_argument("--source-layers", default=d.source_layers,
                   help="auto, all, or k: each target layer draws on the k source layers nearest "
                   "in relative depth")
    p.add_argument("--tails", type=at_least(0), nargs="+", default=d.tails)
    p.add_argument("--ttft-tokens", type=at_least(2), nargs="+", default=d.ttft_tokens)
    p.add_argument("--ttft-repeats", type=at_least(1), default=d.ttft_repeats)
    p.add_argument("--converted-start", action="store_true",
                   help="ablation: score the conversion of the start token too (the Bridge "
                   "serves the target's own)")
    p.add_argument("--token-codes", type=at_least(0), default=d.token_codes, metavar="DIMS",
                   help="width the target's token codes (kvbridge.hf.token_codes), which the fit "
                   "takes besides the source's KV, are compressed to; 0: none, the source's KV "
                   "alone")
    p.add_argument("--seed", type=at_least(0), default=0)
    p.add_argument("--threads", type=at_least(0), default=0,
                   help="torch (and kvbridge OpenMP) threads; 0 keeps torch's default")
    p.add_argument("--install", action="store_true",
                   help="pip-install a short name's packages when missing")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.source_layers not in ("auto", "all") and not args.source_layers.isdigit():
        raise SystemExit(f"--source-layers: expected auto, all or a count, got {args.source_layers!r}")
    config = RealConfig(window_bytes=args.window_bytes, continuation_share=args.continuation_share,
                        train_windows=args.train_windows, heldout_windows=args.heldout_windows,
                        policy=args.policy, source_layers=args.source_layers,
                        tails=list(args.tails), ttft_tokens=list(args.ttft_tokens),
                        ttft_repeats=args.ttft_repeats, converted_start=args.converted_start,
                        token_codes=args.token_codes,
                        long_window_bytes=[b for b in args.long_window_bytes if b],
                        long_heldout_windows=args.long_heldout_windows,
                        agreement_goal=args.agreement_goal, seed=args.seed)
    set_threads(args.threads)
    files = [pathlib.Path(f) for f in args.text] if args.text else corpus.default_files()
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise kvbridge.NotFoundError(f"--text: no such file: {', '.join(missing)}")
    pair = Pair(models.load(args.source, install_missing=args.install),
                models.load(args.target, install_missing=args.install))
    adapter = kvbridge.LinearAdapter.load(args.adapter) if args.adapter else None
    results, adapter = evaluate(pair, config, files, adapter, progress=not args.quiet)
    if args.save_adapter:
        serving = results["serving"]  # evaluate() recorded it on the adapter
        save_adapter(adapter, args.save_adapter)
        results["saved_adapter"] = args.save_adapter
        print(f"saved the adapter to {args.save_adapter} (serving: recompute_tail "
              f"{serving['recompute_tail']}, recompute_share {serving['recompute_share']:.4g}; "
              f"{serving['note']})")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "results.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1, default=finite_or_null)
    picture = os.path.join(args.out, "eval.png")
    plot(results, picture)
    print(format_table(results))
    print(f"\nwrote {path} and {picture}")
    return results


__all__ = ["DEFAULT_AGREEMENT_GOAL", "HeldOutWindow", "Pair", "RealConfig", "converted", "evaluate", "fit",
           "format_table", "heldout_windows", "main", "measure_ttft", "nearest_layers",
           "long_continuation_share", "no_windows", "prompt_of_tokens", "score", "score_long",
           "serving_record"]
