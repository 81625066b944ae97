"""Evaluation of adapters between models with different tokenizers (testbed-a -> testbed-c,
testbed-c -> testbed-b): kept, agreement and held-out R² per alignment policy, TTFT per policy.

Run as ``kvbridge eval --source testbed-a --target testbed-c`` (``kvbridge.experiments.eval``
hands a pair whose tokenizers differ to this module; ``--help`` with those flags lists the options).

Data. Windows are cut on text, not tokens: a window is one fortune of at least
``window_bytes`` UTF-8 bytes, cut to its first ``window_bytes`` bytes (back to a character
boundary); default ``testbed.MAX_CONTEXT - 1``, so that a byte-level model's window (BOS and one
token per byte) fills its context. Each model tokenizes the window itself (``BOS text``, offsets
from ``kvbridge.token_offsets``). Adapters are fitted on windows of ``texts("train")``; every
metric is measured on windows of ``texts("heldout")``.

Alignment. For each policy in ``kvbridge.ALIGN_POLICIES`` ("seen", "covering") target token j
takes the source features at ``kvbridge.align(...)[j]``; BOS aligns to BOS by role. Where the
alignment is -1 (under "seen": target tokens that end before the source's first text token
does, e.g. the first bytes of a byte-level target under a BPE source) the source's BOS serves
instead: it has seen no text, which is what "seen" asks of a(j); those tokens are counted
(``unaligned``). kvbridge.Bridge does not fill them: it serves only the target prefix before
the first such token, so for those windows this measures the adapter, not what the Bridge
serves. The ablation ``naive`` pairs positions index by index (a(j) = j, the last source token
once the source runs out), as if the tokenizers were the same.

Fitting. Both models prefill each training window (positions from 0), and the pairs of every
window are streamed into one ``kvbridge.AdapterFitter`` per policy (RoPE-aware,
``source_layers="auto"``, ``alignment_policy`` the policy's name, none for the naive
ablation): target token j with source token a(j), keys un-rotated at the source position a(j)
and re-rotated at j.

Prefix / continuation split. A held-out window's text is cut at byte ``P = (1 - share) * n``
(``share`` = ``continuation_share``, default 1/4): the target's continuation is its tokens
starting at or after byte P, ``t[p..T)``. As in kvbridge.experiments.eval, the target computes at least the
last prompt token itself: the prefix cache covers ``t[0..p-1)``, whose text ends at byte B (moved
back a token while B would cut a character). The source tokenizes ``text[:B]`` and prefills it
(the cache the source would hold for that prompt); the converted cache of the target's tokens
``t[0..p-1)`` comes from that cache through the alignment of the two tokenizations of
``text[:B]``. ``L_own``, ``L_conv``, ``L_none``, ``kept`` and ``agreement`` are then those of
kvbridge.experiments.eval, over the target's continuation tokens (``L_none``: ``[BOS] + t[p..T-1)`` from
position 0).

TTFT. For prompts of several byte lengths (a held-out window's first n bytes): the source's
cache of its tokenization of the prompt exists (untimed, as after ``Bridge.save``). *own*: the
target's forward over its prompt tokens and the argmax of the last logits; *converted*: both
tokenizations with offsets and the alignment (the source's tokenization is redone, though a
store could keep it), the conversion of the target's first ``m - 1`` tokens from the source's
cache, the target's forward of its last prompt token on it, and the argmax. Alternating, after
one untimed warm-up each, median(own) / median(converted) over the repeats.
"""
from __future__ import annotations

import argparse
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

import kvbridge
from kvbridge.adapter import choose_serving
from kvbridge.experiments.common import (Sums, add_pair_arguments, add_run_arguments,
                                         alternate_timings, best_by_kept, finish, finite_or_null,
                                         int_at_least, layer_r2, model_record, next_token,
                                         progress_items, quiet_model_loading, save_adapter,
                                         score_cells, set_threads, testbed_module, ttft_record,
                                         versions)
from kvbridge.hf import forward, prefix_kv

#: The ablation: positions paired index by index, as for two models of one tokenizer.
NAIVE = "naive"

#: The shipped testbed-a -> testbed-c adapter (the best policy of the recorded run; refit with
#: ``kvbridge eval --source testbed-a --target testbed-c --save-adapter`` this path).
DEFAULT_CROSS_ADAPTER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testbed",
                                     "adapters", "testbed-a_to_testbed-c.safetensors")


def policies() -> List[str]:
    """The alignment policies evaluated by default (kvbridge's) and the naive ablation."""
    return [*kvbridge.ALIGN_POLICIES, NAIVE]


@dataclass
class CrossConfig:
    """What a cross-tokenizer run does; 0 picks the default shown."""

    window_bytes: int = 0               # 0: testbed.MAX_CONTEXT - 1
    continuation_share: float = 0.25    # share of a window's bytes the target continues
    train_windows: int = 400            # most training windows fed to the fitters
    heldout_windows: int = 128          # most held-out windows scored (the split has 108)
    ttft_bytes: List[int] = field(default_factory=list)  # []: 4 lengths up to window_bytes
    ttft_repeats: int = 7
    policies: List[str] = field(default_factory=policies)
    seed: int = 0


# ----------------------------------------------------------------------------- data


def utf8_prefix(text: str, n_bytes: int) -> str:
    """The longest prefix of `text` of at most n_bytes UTF-8 bytes that ends on a character."""
    return text.encode("utf-8")[:n_bytes].decode("utf-8", errors="ignore")


def text_windows(split: str, window_bytes: int, count: Optional[int],
                 data: Any = None) -> List[str]:
    """The windows of a split: fortunes of at least window_bytes bytes, cut to that many (see
    the module docstring), in the split's order."""
    out = []
    for t in testbed_module(data).texts(split):
        if count is not None and len(out) >= count:
            break
        if len(t.encode("utf-8")) >= window_bytes:
            out.append(utf8_prefix(t, window_bytes))
    return out


@dataclass(frozen=True)
class Encoded:
    """One tokenization of one text: ids, UTF-8 byte offsets, roles (kvbridge.token_offsets)."""

    ids: List[int]
    offsets: List[Tuple[int, int]]
    roles: List[Optional[str]]


def encode(tokenizer: Any, text: str) -> Encoded:
    return Encoded(*kvbridge.token_offsets(tokenizer, text, add_bos=True))


def alignment(policy: str, source: Encoded, target: Encoded) -> Tuple[np.ndarray, int]:
    """The index of each target token's source token under `policy` (see the module
    docstring) and how many target tokens had no source token (served by the source's BOS)."""
    n_src, n_tgt = len(source.ids), len(target.ids)
    if n_src == 0:
        raise kvbridge.InvalidArgumentError("alignment: the source tokenization is empty")
    if policy == NAIVE:
        return np.minimum(np.arange(n_tgt, dtype=np.int64), n_src - 1), 0
    index = np.asarray(kvbridge.align(source.offsets, target.offsets, policy, source.roles,
                                      target.roles), dtype=np.int64)
    missing = index < 0
    if missing.any():
        if "bos" not in source.roles:
            raise kvbridge.InvalidArgumentError(f"alignment ({policy}): {int(missing.sum())} target tokens have no "
                             "source token and the source has no BOS to serve them")
        index[missing] = source.roles.index("bos")
    return index, int(missing.sum())


# ----------------------------------------------------------------------------- fitting


def fitter_options(policy: str) -> Dict[str, Any]:
    """The AdapterFitter options of a policy. The naive ablation records no policy (the
    fitter knows only real ones), so kvbridge.Bridge would not take its adapter across
    tokenizers; it exists to be measured."""
    return {"rope_aware": True, "source_layers": "auto",
            "alignment_policy": "" if policy == NAIVE else policy}


def fit_policies(pair: Any, texts: Sequence[str], names: Sequence[str], progress: bool = False,
                 seed: int = 0) -> Tuple[Dict[str, kvbridge.LinearAdapter], Dict[str, int]]:
    """One adapter per policy from the paired KV of `texts` (one prefill per model and text).
    Also returns, per policy, the target tokens served by the source's BOS."""
    fitters = {name: kvbridge.AdapterFitter(pair.source.spec, pair.target.spec, seed=seed,
                                            **fitter_options(name)) for name in names}
    unaligned = {name: 0 for name in names}
    for text in progress_items(texts, progress):
        src, tgt = encode(pair.source.tokenizer, text), encode(pair.target.tokenizer, text)
        src_kv = prefix_kv(pair.source.model, src.ids)
        tgt_kv = prefix_kv(pair.target.model, tgt.ids)
        for name, fitter in fitters.items():
            index, missing = alignment(name, src, tgt)
            unaligned[name] += missing
            fitter.add(src_kv, tgt_kv, alignment=index)
    return {name: f.fit() for name, f in fitters.items()}, unaligned


# ----------------------------------------------------------------------------- scoring


@dataclass(frozen=True)
class Split:
    """A held-out window split for the target (see the module docstring)."""

    target: Encoded       # the target's tokenization of the whole window
    p: int                # first continuation token; the prefix cache covers t[0..p-1)
    prefix_text: str      # the text of t[0..p-1), which the source tokenizes


def split_window(target_tokenizer: Any, text: str, share: float) -> Optional[Split]:
    """The window's split, or None when it leaves no prefix or no continuation token."""
    tgt = encode(target_tokenizer, text)
    raw = text.encode("utf-8")
    cut = int(round((1.0 - share) * len(raw)))
    starts = [j for j, ((s, _), role) in enumerate(zip(tgt.offsets, tgt.roles))
              if role is None and s >= cut]
    if not starts:
        return None
    p = starts[0]
    while p >= 2:
        end = tgt.offsets[p - 2][1]
        try:
            prefix = raw[:end].decode("utf-8")
        except UnicodeDecodeError:  # the last cached token ends inside a character
            p -= 1
            continue
        if prefix:
            return Split(tgt, p, prefix)
        return None
    return None


def references(model: Any, split: Split, bos_id: int
               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Encoded]:
    """What every converted cache of a split window is scored against: the continuation's token
    ids, the target's logits over it after its own prefill of the cached prefix and after
    `bos_id` alone, and the cached prefix's tokenization (t[0..p-1))."""
    ids, p = split.target.ids, split.p
    targets = torch.as_tensor(ids[p:], dtype=torch.long)
    own_kv = prefix_kv(model, ids[:p - 1])
    logits_own, _ = forward(model, ids[p - 1:-1], own_kv)
    logits_none, _ = forward(model, [bos_id] + ids[p:-1])
    cached = Encoded(ids[:p - 1], split.target.offsets[:p - 1], split.target.roles[:p - 1])
    return targets, logits_own, logits_none, cached


def score_cross(pair: Any, texts: Sequence[str], share: float,
                adapters: Dict[str, kvbridge.LinearAdapter]) -> Dict[str, Dict[str, Any]]:
    """Pooled kept / agreement / losses per policy over held-out window texts."""
    src_m, tgt_m = pair.source, pair.target
    sums = {name: Sums() for name in adapters}
    unaligned = {name: 0 for name in adapters}
    windows = prefix_tokens = 0
    for text in texts:
        split = split_window(tgt_m.tokenizer, text, share)
        if split is None:
            continue
        ids, p = split.target.ids, split.p
        targets, logits_own, logits_none, cached = references(tgt_m.model, split,
                                                              tgt_m.tokenizer.bos_id)
        src = encode(src_m.tokenizer, split.prefix_text)
        src_kv = prefix_kv(src_m.model, src.ids)
        for name, adapter in adapters.items():
            index, missing = alignment(name, src, cached)
            unaligned[name] += missing
            conv = adapter.convert(src_kv, alignment=index)
            logits_conv, _ = forward(tgt_m.model, ids[p - 1:-1], conv)
            sums[name].add(logits_own, logits_conv, logits_none, targets)
        windows += 1
        prefix_tokens += p - 1
    if not windows:
        raise kvbridge.InvalidArgumentError("no held-out window could be split (too short for the share)")
    return {name: {**s.metrics(), "unaligned_prefix_tokens": unaligned[name],
                   "prefix_tokens": prefix_tokens, "windows": windows}
            for name, s in sums.items()}


# ----------------------------------------------------------------------------- TTFT


@torch.no_grad()
def measure_ttft_cross(pair: Any, adapters: Dict[str, kvbridge.LinearAdapter],
                       prompts: Sequence[str], repeats: int = 7) -> Dict[str, List[Dict[str, Any]]]:
    """Own-prefill vs converted-cache TTFT of the target per prompt text and policy (module
    docstring); the own timings are shared by the policies. Returns rows by policy."""
    src_m, tgt_m = pair.source, pair.target
    rows: Dict[str, List[Dict[str, Any]]] = {name: [] for name in adapters}
    for prompt in prompts:
        tgt_ids = encode(tgt_m.tokenizer, prompt).ids
        src_kv = prefix_kv(src_m.model, encode(src_m.tokenizer, prompt).ids)
        out: Dict[str, Any] = {}

        def own():
            out["own"] = next_token(tgt_m.model, tgt_ids)

        def converted(name):
            src, tgt = encode(src_m.tokenizer, prompt), encode(tgt_m.tokenizer, prompt)
            m = len(tgt.ids) - 1
            cached = Encoded(tgt.ids[:m], tgt.offsets[:m], tgt.roles[:m])
            index, _ = alignment(name, src, cached)
            kv = adapters[name].convert(src_kv, alignment=index)
            out[name] = next_token(tgt_m.model, tgt.ids[m:], kv)

        t_own, t_convs = alternate_timings(
            own, {name: (lambda name=name: converted(name)) for name in adapters}, repeats)
        for name in adapters:
            t_conv = t_convs[name]
            rows[name].append({"prompt_bytes": len(prompt.encode("utf-8")),
                               "target_tokens": len(tgt_ids), "own_ms": 1e3 * t_own,
                               "converted_ms": 1e3 * t_conv, "ratio": t_own / t_conv,
                               "same_first_token": out["own"] == out[name]})
    return rows


# ----------------------------------------------------------------------------- run


def serving_record(score: Dict[str, Any], agreement_goal: float) -> Dict[str, Any]:
    """Serving defaults (LinearAdapter.serving) from one policy's score_cross row: this eval
    measures no tail levers, so the curve is its one point, r = 0 (the target computes each
    window's last prompt token), and the tail 0 (with a note when it misses the goal)."""
    windows = int(score["windows"])
    prompt = int(score["prefix_tokens"]) + windows
    point = {"recompute_tail": 0, "kept": finite_or_null(score["kept"]),
             "agreement": finite_or_null(score["agreement"]),
             "computed_share": windows / prompt, "prompt_tokens": round(prompt / windows)}
    return choose_serving([point], agreement_goal,
                          f"kvbridge eval across tokenizers, {windows} held-out windows "
                          "(prompt_tokens: their mean), tail 0 only")


def default_ttft_bytes(window_bytes: int) -> List[int]:
    return sorted({max(16, window_bytes >> s) for s in range(4)})


def best_policy(results: Dict[str, Any], include_naive: bool = True) -> Optional[str]:
    """The variant of highest kept (NaN lowest); without the naive ablation if asked."""
    return best_by_kept(results["variants"],
                        [n for n in results["variants"] if include_naive or n != NAIVE])


def evaluate_cross(pair: Any, config: CrossConfig, progress: bool = False,
                   data: Any = None) -> Tuple[Dict[str, Any], Dict[str, kvbridge.LinearAdapter]]:
    """Fits one adapter per policy and scores each (module docstring). Returns the
    results.json content and the adapters by policy."""
    max_context = int(testbed_module(data).MAX_CONTEXT)
    window = config.window_bytes or max_context - 1
    if not 0.0 < config.continuation_share < 1.0:
        raise kvbridge.InvalidArgumentError(f"continuation_share: expected 0 < share < 1, got "
                         f"{config.continuation_share}")
    for name in config.policies:
        if name not in policies():
            raise kvbridge.InvalidArgumentError(f"policy {name!r}: expected one of {policies()}")
    timings: Dict[str, float] = {}
    t0 = time.perf_counter()
    train = text_windows("train", window, config.train_windows, data)
    if not train:
        raise kvbridge.InvalidArgumentError(f"no training fortune has {window} bytes")
    adapters, fit_unaligned = fit_policies(pair, train, config.policies, progress=progress,
                                           seed=config.seed)
    timings["fit_seconds"] = time.perf_counter() - t0
    heldout = text_windows("heldout", window, config.heldout_windows, data)
    if not heldout:
        raise kvbridge.InvalidArgumentError(f"no held-out fortune has {window} bytes")
    t1 = time.perf_counter()
    scores = score_cross(pair, heldout, config.continuation_share, adapters)
    timings["score_seconds"] = time.perf_counter() - t1
    variants = {name: {**fitter_options(name), "alignment": name, **scores[name],
                       **layer_r2(adapter),
                       "fit_unaligned_target_tokens": fit_unaligned[name]}
                for name, adapter in adapters.items()}
    best = best_policy({"variants": variants})
    lengths = config.ttft_bytes or default_ttft_bytes(window)
    if max(lengths) > window:
        raise kvbridge.InvalidArgumentError(f"TTFT prompt of {max(lengths)} bytes exceeds the window of {window}")
    t2 = time.perf_counter()
    ttft = measure_ttft_cross(pair, adapters, [utf8_prefix(heldout[0], n) for n in lengths],
                              repeats=config.ttft_repeats)
    timings["ttft_seconds"] = time.perf_counter() - t2
    results = {
        "config": {**asdict(config), "window_bytes": window, "ttft_bytes": lengths,
                   "max_context": max_context},
        "models": {"source": model_record(pair.source, tokenizer=True),
                   "target": model_record(pair.target, tokenizer=True)},
        "windows": {"train": len(train), "heldout": len(heldout)},
        "variants": variants,
        "best_variant": best,
        "ttft": ttft_record(best, ttft),
        "timings": timings,
        **versions(),
    }
    return results, adapters


def format_table(results: Dict[str, Any]) -> str:
    m, w = results["models"], results["windows"]
    cfg = results["config"]
    lines = [f"{m['source']['name']} -> {m['target']['name']} (tokenizers "
             f"{m['source']['tokenizer']} -> {m['target']['tokenizer']}): {w['train']} training "
             f"windows, {w['heldout']} held-out windows of {cfg['window_bytes']} bytes "
             f"(continuation: the last {cfg['continuation_share']:g} of each)", ""]
    lines.append("| alignment | kept | agreement | L_own | L_conv | L_none | min R² | mean R² K | "
                 "mean R² V | unaligned prefix tokens | continuation tokens |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, v in results["variants"].items():
        lines.append(f"| {name} | {score_cells(v)} | "
                     f"{v['unaligned_prefix_tokens']} of {v['prefix_tokens']} | {v['tokens']} |")
    lines.append("")
    lines.append("Held-out R² per target layer (K / V):")
    lines.append("")
    names = list(results["variants"])
    lines.append("| layer | " + " | ".join(names) + " |")
    lines.append("|---:|" + "---|" * len(names))
    n_layers = len(results["variants"][names[0]]["r2_key"])
    for i in range(n_layers):
        cells = [f"{v['r2_key'][i]:.3f} / {v['r2_value'][i]:.3f}"
                 for v in results["variants"].values()]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    lines.append("")
    t = results["ttft"]
    by = t["by_variant"]
    lines.append(f"TTFT of {m['target']['name']}, own prefill vs converted cache (threads: "
                 f"{t['threads']}, median of {cfg['ttft_repeats']}; ratio own / converted):")
    lines.append("")
    lines.append("| prompt bytes | target tokens | own ms | " + " | ".join(by) + " |")
    lines.append("|---:|---:|---:|" + "---:|" * len(by))
    for i, r in enumerate(t["rows"]):
        cells = [f"{rows[i]['converted_ms']:.2f} ms, {rows[i]['ratio']:.2f}x"
                 + ("" if rows[i]["same_first_token"] else " (other 1st token)")
                 for rows in by.values()]
        lines.append(f"| {r['prompt_bytes']} | {r['target_tokens']} | {r['own_ms']:.2f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    at_least = int_at_least
    p = argparse.ArgumentParser(prog="kvbridge eval", description=__doc__.split("\n")[0])
    add_pair_arguments(p)
    p.add_argument("--save-adapter", metavar="PATH",
                   help="save the adapter of the best alignment policy (highest kept; never "
                   "the naive ablation) to this file")
    p.add_argument("--window-bytes", type=at_least(0), default=0)
    p.add_argument("--continuation-share", type=float, default=CrossConfig.continuation_share)
    p.add_argument("--train-windows", type=at_least(1), default=CrossConfig.train_windows)
    p.add_argument("--heldout-windows", type=at_least(1), default=CrossConfig.heldout_windows)
    p.add_argument("--ttft-bytes", type=at_least(2), nargs="+", default=[])
    p.add_argument("--ttft-repeats", type=at_least(1), default=CrossConfig.ttft_repeats)
    p.add_argument("--policies", nargs="+", default=None,
                   help=f"alignment policies (default: {' '.join(policies())})")
    add_run_arguments(p)
    return p


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    args = build_parser().parse_args(argv)
    from kvbridge.experiments import testbed

    config = CrossConfig(window_bytes=args.window_bytes,
                         continuation_share=args.continuation_share,
                         train_windows=args.train_windows, heldout_windows=args.heldout_windows,
                         ttft_bytes=list(args.ttft_bytes), ttft_repeats=args.ttft_repeats,
                         policies=list(args.policies or policies()), seed=args.seed)
    set_threads(args.threads)
    quiet_model_loading()
    pair = testbed.load_pair(args.source or testbed.SOURCE_NAME,
                             args.target or testbed.TARGET_NAME)
    if pair.tokenizer is not None:
        raise SystemExit(f"{pair.source.name} and {pair.target.name} share a tokenizer: run "
                         "kvbridge eval without this module's options")
    results, adapters = evaluate_cross(pair, config, progress=not args.quiet)
    if args.save_adapter:
        best = best_policy(results, include_naive=False)
        if best is None:
            raise SystemExit("--save-adapter: no alignment policy was fitted (only naive)")
        serving = serving_record(results["variants"][best], testbed.SERVING_AGREEMENT_GOAL)
        adapters[best].serving = serving
        save_adapter(adapters[best], args.save_adapter)
        results["saved_adapter"] = {"path": args.save_adapter, "variant": best,
                                    "serving": serving}
        print(f"saved the {best} adapter to {args.save_adapter}")
    finish(results, args.out, format_table(results))
    return results


__all__ = ["CrossConfig", "DEFAULT_CROSS_ADAPTER", "Encoded", "NAIVE", "Split", "alignment", "best_policy", "encode",
           "evaluate_cross",
           "fit_policies", "format_table", "main", "measure_ttft_cross", "policies", "references",
           "score_cross", "split_window", "text_windows", "utf8_prefix"]
