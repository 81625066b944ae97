"""Evaluation of the testbed-a -> testbed-b adapter: kept, agreement, held-out R², TTFT ratio.

Run as ``kvbridge eval`` or ``python -m kvbridge.experiments.eval`` (``--help`` lists the
options).

Data. Texts are the testbed's fortunes splits: the adapters are fitted on ``texts("train")``
and every metric is measured on ``texts("heldout")``. Texts are tokenized one by one as
``BOS text EOS`` (the models' training format) and packed into windows of ``window_tokens`` (at
most ``testbed.MAX_CONTEXT``, the length the models were trained on): a window starts at a
text's BOS and takes the following texts until it is full, the last one cut; the next window
starts at the next text.

Fitting. Both models prefill each training window (one forward, positions 0..W-1) and the
paired KV of every window is streamed into one ``kvbridge.AdapterFitter`` per variant:

- ``rope_auto``: RoPE-aware, ``source_layers="auto"`` (the default adapter setting);
- ``rope_all``:  RoPE-aware, ``source_layers="all"``;
- ``naive``:     ``rope_aware=False`` (post-RoPE keys mapped as they are), ``"auto"``: an
  ablation that differs from ``rope_auto`` only in the key handling.

Prefix / continuation split. A held-out window of W tokens ``w[0..W)`` is a prompt of
``P = W - C`` tokens followed by a continuation of ``C = continuation_tokens`` tokens. The
target predicts the C continuation tokens ``w[P..W)`` from the logits of positions
``P-1..W-2``. As on the Bridge path, the target computes at least the last prompt token itself:
a prefix cache covers ``w[0..P-1)`` and the target runs ``w[P-1..W-1)`` on top of it.

- ``L_own``:  the target's cache from its own prefill of ``w[0..P-1)``;
- ``L_conv``: the source's cache of ``w[0..P-1)`` (its own prefill) converted by the adapter;
- ``L_none``: no prefix at all: the target runs ``[BOS] + w[P..W-1)`` from position 0, so BOS
  stands in for the prompt and predicts ``w[P]``.

Each L is the mean cross-entropy (nats/token) over all continuation tokens of all held-out
windows (pooled, not a mean of per-window ratios). Then
``kept = (L_none - L_conv) / (L_none - L_own)`` and ``agreement`` = the share of those
continuation positions where the target's argmax next token with the converted cache equals
the one with its own cache (teacher forced: both see the true continuation tokens).
Feeding the target's own cache in place of the converted one gives kept = agreement = 1
exactly, since the computation is then the same.

TTFT ratio. For each prompt length n (up to ``testbed.MAX_CONTEXT``; a held-out window of n
tokens): the source prefills the prompt and ``Bridge.save``s it (untimed). Then, alternating,
in one process: *own*: the target's forward over the n prompt tokens (``use_cache=True``, logits
of the last position only) and its argmax; *bridge* (one Bridge per variant, each
timed; the reported ratio is the best variant's, by kept): ``Bridge.load`` of the prompt for the
target (store lookup of the source's chunks, conversion of ``n - 1`` tokens through the
adapter, copy out; ``write_back=False`` so that every repeat converts again), the target's
forward of the last prompt token on that cache, and its argmax. The ratio is
median(own) / median(bridge) over the repeats, after one untimed warm-up of each path. Both
paths run with the same threads (``--threads``, default 1; see set_threads).

Levers (``--tail-tokens R ...``, ``--exact-layers K ...``; without them, (0, 0) and the
testbed's default ``testbed.BRIDGE_OPTIONS``): every combination (r, k) is scored
on the same held-out windows with the best variant's adapter, and timed like the variants. With
tail recompute r (``Bridge(recompute_tail=r)``) the converted cache covers ``w[0..P-1-r)`` and the
target runs ``w[P-1-r..W-1)`` on it; with exact layers k (``Bridge(exact_layers=k)``, the target
model given to ``load``) the first k layers of that cache are the target's own KV of
``w[0..P-1-r)`` (kvbridge.exact). kept and agreement are defined as above (``L_own`` and
``L_none`` are the same for every lever); the TTFT path is Bridge.load (with the model) and the
target's forward of the prompt tokens past the load.

FLOP projection (printed with the measurement): for a Llama-3-8B-sized source and target
(32 layers, hidden 4096, 32 query heads, 8 KV heads x 128, MLP 14336, vocab 128256), with
N = 32 * (2*4096*4096 + 2*4096*1024 + 3*4096*14336) matmul parameters per token:
``prefill(T) = 2*N*T + 2*L*4096*T^2 (causal QK^T and AV) + 2*4096*128256 (last-token head)``,
``convert(T) = T * sum_j 2 * (|S_j| * 2 * 1024) * (2 * 1024)`` (keys and values of |S_j| source
layers into one target layer's keys and values, per token), and
``decode(T) = 2*N + 4*L*4096*T + 2*4096*128256`` (one token attending over T), ratio =
prefill(T) / (convert(T - 1) + decode(T)). |S_j| is taken from the fitted adapter's layer map
(its mean |S_j|) and shown next to 1, 8 (the most "auto" allows) and 32. It assumes equal
FLOP efficiency for the three parts; RoPE, bias, the store lookup and the copy of the KV are not
counted (memory traffic, not FLOPs), and decode of one token is in practice memory bound, so
the projected ratio is an upper bound.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

import kvbridge
from kvbridge._core import InvalidArgumentError
from kvbridge.adapter import choose_serving
from kvbridge.exact import exact_layers
from kvbridge.experiments import eval_cross
from kvbridge.experiments.common import (Sums, add_pair_arguments, add_run_arguments,
                                         alternate_timings, best_by_kept, finish, finite_or_null,
                                         int_at_least, layer_r2, model_record, next_token,
                                         progress_items, quiet_model_loading, save_adapter,
                                         score_cells, set_threads, testbed_module, ttft_record,
                                         versions)
from kvbridge.hf import forward, prefix_kv

VARIANTS: Dict[str, Dict[str, Any]] = {
    "rope_auto": {"rope_aware": True, "source_layers": "auto"},
    "rope_all": {"rope_aware": True, "source_layers": "all"},
    "naive": {"rope_aware": False, "source_layers": "auto"},
}

DEFAULT_ADAPTER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testbed", "adapters",
                               "testbed-a_to_testbed-b.safetensors")


@dataclass
class EvalConfig:
    """What an evaluation run does. Window sizes are in tokens; 0 picks the default shown."""

    window_tokens: int = 0          # 0: testbed.MAX_CONTEXT
    continuation_tokens: int = 0    # 0: window_tokens // 4
    train_windows: int = 400        # most training windows fed to the fitters
    heldout_windows: int = 64       # most held-out windows scored
    ttft_lengths: List[int] = field(default_factory=list)  # []: 4 lengths up to MAX_CONTEXT
    ttft_repeats: int = 7
    chunk_tokens: int = 16          # store chunk size on the TTFT path
    variants: List[str] = field(default_factory=lambda: list(VARIANTS))
    seed: int = 0
    tail_tokens: List[int] = field(default_factory=list)   # levers: recompute_tail values
    exact_layers: List[int] = field(default_factory=list)  # levers: exact_layers values


# ----------------------------------------------------------------------------- data


def pack_windows(token_lists: Sequence[Sequence[int]], length: int,
                 count: Optional[int] = None) -> List[List[int]]:
    """Windows of exactly `length` tokens, each starting at a text's first token (see module)."""
    if length < 2:
        raise InvalidArgumentError(f"length: expected at least 2 tokens, got {length}")
    windows: List[List[int]] = []
    i = 0
    while i < len(token_lists) and (count is None or len(windows) < count):
        window: List[int] = []
        while i < len(token_lists) and len(window) < length:
            window.extend(token_lists[i])
            i += 1
        if len(window) < length:
            break
        windows.append(window[:length])
    return windows


def text_windows(pair: Any, split: str, length: int, count: Optional[int],
                 data: Any = None) -> List[List[int]]:
    texts = testbed_module(data).texts(split)
    eos = [pair.tokenizer.eos_id]
    return pack_windows([pair.tokenizer.encode(t) + eos for t in texts], length, count)


# ----------------------------------------------------------------------------- metrics


def score_windows(target_model, windows: Sequence[Sequence[int]], continuation: int, bos_id: int,
                  source_kv_of, converters: Dict[str, Any]) -> Dict[str, Dict[str, float]]:
    """Pooled metrics per converter over the held-out windows.

    source_kv_of(prefix_ids) -> the source's legacy KV of the prefix.
    converters: name -> callable(source_kv) -> target legacy KV of the same tokens (a
        LinearAdapter's convert, or anything else that returns the target's layout).
    """
    sums = {name: Sums() for name in converters}
    for w in windows:
        if len(w) <= continuation + 1:
            raise InvalidArgumentError(f"window of {len(w)} tokens is too short for {continuation} "
                                       "continuation tokens")
        p = len(w) - continuation
        targets = torch.as_tensor(w[p:], dtype=torch.long)
        own_kv = prefix_kv(target_model, w[: p - 1])
        logits_own, _ = forward(target_model, w[p - 1: -1], own_kv)
        logits_none, _ = forward(target_model, [bos_id] + list(w[p: -1]))
        src_kv = source_kv_of(w[: p - 1])
        for name, convert in converters.items():
            logits_conv, _ = forward(target_model, w[p - 1: -1], convert(src_kv))
            sums[name].add(logits_own, logits_conv, logits_none, targets)
    return {name: s.metrics() for name, s in sums.items()}


def lever_name(tail: int, exact: int) -> str:
    return f"tail {tail}, exact {exact}"


def lever_grid(config: EvalConfig, data: Any = None) -> List[Tuple[int, int]]:
    """(recompute_tail, exact_layers) combinations the config asks for; without any, none
    (0, 0) and the data's default Bridge options (testbed.BRIDGE_OPTIONS), if it has some."""
    if not config.tail_tokens and not config.exact_layers:
        opts = getattr(testbed_module(data), "BRIDGE_OPTIONS", None) or {}
        default = (int(opts.get("recompute_tail", 0)), int(opts.get("exact_layers", 0)))
        return [(0, 0), default] if default != (0, 0) else []
    return [(r, k) for r in (config.tail_tokens or [0]) for k in (config.exact_layers or [0])]


def score_levers(target_model, windows: Sequence[Sequence[int]], continuation: int, bos_id: int,
                 source_kv_of, adapter: kvbridge.LinearAdapter,
                 levers: Sequence[Tuple[int, int]]) -> Dict[str, Dict[str, float]]:
    """Pooled metrics per (recompute_tail r, exact_layers k) lever (see the module docstring):
    the source's cache of ``w[0..P-1)`` is converted once per window, each lever cuts it to
    ``P-1-r`` tokens, replaces its first k layers by the target's own and runs the target on the
    rest."""
    sums = {lever_name(r, k): Sums() for r, k in levers}
    for w in windows:
        p = len(w) - continuation
        if p - 1 - max(r for r, _ in levers) < 1:
            raise InvalidArgumentError(f"window of {len(w)} tokens is too short for {continuation} "
                             f"continuation tokens and a tail of {max(r for r, _ in levers)}")
        targets = torch.as_tensor(w[p:], dtype=torch.long)
        own_kv = prefix_kv(target_model, w[: p - 1])
        logits_own, _ = forward(target_model, w[p - 1: -1], own_kv)
        logits_none, _ = forward(target_model, [bos_id] + list(w[p: -1]))
        conv = adapter.convert(source_kv_of(w[: p - 1]))
        for r, k in levers:
            q = p - 1 - r
            kv = exact_layers(target_model, w[:q],
                              tuple((key[:, :, :q], value[:, :, :q]) for key, value in conv), k)
            logits, _ = forward(target_model, w[q: -1], kv, logits_to_keep=continuation)
            sums[lever_name(r, k)].add(logits_own, logits, logits_none, targets)
    return {name: s.metrics() for name, s in sums.items()}


# ----------------------------------------------------------------------------- fitting


def fit_variants(pair: Any, windows: Sequence[Sequence[int]], variants: Sequence[str],
                 progress: bool = False, seed: int = 0) -> Dict[str, kvbridge.LinearAdapter]:
    """One adapter per variant, all from the same paired KV of `windows` (one prefill each)."""
    fitters = {name: kvbridge.AdapterFitter(pair.source.spec, pair.target.spec, seed=seed,
                                            **VARIANTS[name]) for name in variants}
    for w in progress_items(windows, progress):
        src, tgt = prefix_kv(pair.source.model, w), prefix_kv(pair.target.model, w)
        for fitter in fitters.values():
            fitter.add(src, tgt)
    return {name: f.fit() for name, f in fitters.items()}


class StaleAdapterError(ValueError):
    """An adapter file fitted for other model weights (spec fingerprints differ)."""


def check_adapter(adapter: kvbridge.LinearAdapter, pair: Any) -> None:
    """Raises StaleAdapterError unless the adapter maps exactly pair.source -> pair.target.

    The specs carry the weights' version, so their fingerprints change with the weights."""
    for side, want in (("source", pair.source.spec), ("target", pair.target.spec)):
        have = getattr(adapter, side)
        if have.fingerprint != want.fingerprint:
            raise StaleAdapterError(
                f"adapter {side} is {have.name} version {have.version!r} (fingerprint "
                f"{have.fingerprint}), the loaded model is {want.name} version {want.version!r} "
                f"(fingerprint {want.fingerprint}): refit it (scripts/fit_testbed_adapter.py)")


def load_adapter(path: str, pair: Any) -> kvbridge.LinearAdapter:
    """LinearAdapter.load, then check_adapter against the loaded models."""
    adapter = kvbridge.LinearAdapter.load(path)
    check_adapter(adapter, pair)
    return adapter


# ----------------------------------------------------------------------------- TTFT


@torch.no_grad()
def measure_ttft(pair: Any, adapters: Dict[str, kvbridge.LinearAdapter],
                 prompts: Sequence[Sequence[int]], repeats: int = 7,
                 chunk_tokens: int = 16,
                 bridge_options: Optional[Dict[str, Dict[str, Any]]] = None
                 ) -> Dict[str, List[Dict[str, Any]]]:
    """Own-prefill vs Bridge TTFT of the target per prompt and adapter (see the module
    docstring); one Bridge per adapter, the own-prefill timings shared. Returns rows by name.
    bridge_options: per name, more Bridge keyword arguments (recompute_tail, exact_layers)."""
    src, tgt = pair.source, pair.target
    bridges = {}
    for name, adapter in adapters.items():
        store = kvbridge.KVStore(capacity_bytes=1 << 30, chunk_tokens=chunk_tokens)
        # recompute_tail 0 unless the row says otherwise (not the adapter's recorded tail).
        bridges[name] = kvbridge.Bridge(store, min_quality=float("-inf"), write_back=False,
                                        **{"recompute_tail": 0,
                                           **(bridge_options or {}).get(name, {})})
        bridges[name].add_adapter(adapter)
    rows: Dict[str, List[Dict[str, Any]]] = {name: [] for name in adapters}
    for prompt in prompts:
        prompt = list(prompt)
        src_kv = prefix_kv(src.model, prompt)
        for bridge in bridges.values():
            bridge.save(src.spec, prompt, src_kv)
        out: Dict[str, Any] = {}

        def own():
            out["own"] = next_token(tgt.model, prompt)

        def via_bridge(name):
            load = bridges[name].load(tgt.spec, prompt, model=tgt.model)
            out[name] = (next_token(tgt.model, prompt[load.tokens:], load.kv), load)

        t_own, t_bridges = alternate_timings(
            own, {name: (lambda name=name: via_bridge(name)) for name in bridges}, repeats)
        for name in bridges:
            token, load = out[name]
            t_bridge = t_bridges[name]
            rows[name].append({"prompt_tokens": len(prompt), "loaded_tokens": int(load.tokens),
                               "converted": bool(load.converted), "own_ms": 1e3 * t_own,
                               "bridge_ms": 1e3 * t_bridge, "ratio": t_own / t_bridge,
                               "same_first_token": out["own"] == token})
    return rows


LLAMA3_8B = {"layers": 32, "hidden": 4096, "q_heads": 32, "kv_heads": 8, "head_dim": 128,
             "mlp": 14336, "vocab": 128256}


def flop_projection(lengths: Sequence[int], source_layers_per_target: float,
                    shape: Dict[str, int] = LLAMA3_8B) -> List[Dict[str, float]]:
    """TTFT ratio projected from FLOPs for a same-shape pair (formula in the module docstring)."""
    L, d, kv = shape["layers"], shape["hidden"], shape["kv_heads"] * shape["head_dim"]
    q = shape["q_heads"] * shape["head_dim"]
    n = L * (2 * d * q + 2 * d * kv + 3 * d * shape["mlp"])
    head = 2 * d * shape["vocab"]
    rows = []
    for t in lengths:
        prefill = 2 * n * t + 2 * L * q * t * t + head
        convert = (t - 1) * L * 2 * (source_layers_per_target * 2 * kv) * (2 * kv)
        decode = 2 * n + 4 * L * q * t + head
        rows.append({"prompt_tokens": int(t), "prefill_flops": float(prefill),
                     "convert_flops": float(convert), "decode_flops": float(decode),
                     "ratio": prefill / (convert + decode)})
    return rows


def mean_source_layers(adapter: kvbridge.LinearAdapter) -> float:
    """Mean number of source layers one target layer draws on (|S_j|)."""
    layers = adapter.report["layers"]
    return sum(len(l["source_layers"]) for l in layers) / len(layers)


# ----------------------------------------------------------------------------- run


def default_ttft_lengths(max_context: int, chunk_tokens: int) -> List[int]:
    lengths = sorted({max(2 * chunk_tokens, (max_context >> s) // chunk_tokens * chunk_tokens)
                      for s in range(4)})
    return [n for n in lengths if n <= max_context]


def evaluate(pair: Any, config: EvalConfig, adapters: Optional[Dict[str, Any]] = None,
             progress: bool = False, data: Any = None) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Fits (unless `adapters` maps variant names to LinearAdapters) and scores every variant.

    data: where texts and MAX_CONTEXT come from (default: kvbridge.experiments.testbed).
    Returns the results.json content (see common.write_results) and the adapters by variant."""
    max_context = int(testbed_module(data).MAX_CONTEXT)
    window = config.window_tokens or max_context
    if window > max_context:
        raise InvalidArgumentError(f"window_tokens {window} exceeds testbed.MAX_CONTEXT {max_context}")
    cont = config.continuation_tokens or window // 4
    if not 1 <= cont <= window - 2:
        raise InvalidArgumentError(f"continuation_tokens: expected 1..{window - 2}, got {cont}")
    timings: Dict[str, float] = {}
    t0 = time.perf_counter()
    if adapters is None:
        train = text_windows(pair, "train", window, config.train_windows, data)
        adapters = fit_variants(pair, train, config.variants, progress=progress, seed=config.seed)
        timings["fit_seconds"] = time.perf_counter() - t0
        train_windows = len(train)
    else:
        for adapter in adapters.values():
            check_adapter(adapter, pair)
        train_windows = 0
    heldout = text_windows(pair, "heldout", window, config.heldout_windows, data)
    if not heldout:
        raise InvalidArgumentError("no held-out window fits: fewer held-out tokens than window_tokens")
    t1 = time.perf_counter()
    scores = score_windows(pair.target.model, heldout, cont, pair.tokenizer.bos_id,
                           lambda ids: prefix_kv(pair.source.model, ids),
                           {name: a.convert for name, a in adapters.items()})
    timings["score_seconds"] = time.perf_counter() - t1
    variants = {}
    for name, adapter in adapters.items():
        variants[name] = {**VARIANTS.get(name, {}), **scores[name], **layer_r2(adapter)}
    best = best_by_kept(variants)
    lengths = config.ttft_lengths or default_ttft_lengths(max_context, config.chunk_tokens)
    if max(lengths) > max_context:
        raise InvalidArgumentError(f"TTFT length {max(lengths)} exceeds testbed.MAX_CONTEXT {max_context}")
    ttft_texts = text_windows(pair, "heldout", max(lengths), 1, data)
    if not ttft_texts:
        raise InvalidArgumentError("held-out text too short for the longest TTFT prompt")
    t2 = time.perf_counter()
    ttft = measure_ttft(pair, adapters, [ttft_texts[0][:n] for n in lengths],
                        repeats=config.ttft_repeats, chunk_tokens=config.chunk_tokens)
    timings["ttft_seconds"] = time.perf_counter() - t2
    levers = lever_grid(config, data)
    lever_results: Dict[str, Any] = {}
    if levers:
        t3 = time.perf_counter()
        lever_scores = score_levers(pair.target.model, heldout, cont, pair.tokenizer.bos_id,
                                    lambda ids: prefix_kv(pair.source.model, ids),
                                    adapters[best], levers)
        names = {lever_name(r, k): {"recompute_tail": r, "exact_layers": k} for r, k in levers}
        lever_ttft = measure_ttft(pair, {name: adapters[best] for name in names},
                                  [ttft_texts[0][:n] for n in lengths],
                                  repeats=config.ttft_repeats, chunk_tokens=config.chunk_tokens,
                                  bridge_options=names)
        lever_results = {"variant": best, "rows": [
            {"lever": name, **opts, **lever_scores[name], "ttft": lever_ttft[name]}
            for name, opts in names.items()]}
        timings["lever_seconds"] = time.perf_counter() - t3
    fitted = mean_source_layers(adapters[best])
    proj_lengths = [1024, 4096, 8192, 32768]
    proj_sizes = sorted({1.0, round(fitted, 2), 8.0, float(LLAMA3_8B["layers"])})
    results = {
        "config": {**asdict(config), "window_tokens": window, "continuation_tokens": cont,
                   "ttft_lengths": lengths, "max_context": max_context},
        "models": {"source": model_record(pair.source), "target": model_record(pair.target)},
        "windows": {"train": train_windows, "heldout": len(heldout)},
        "variants": variants,
        "best_variant": best,
        "ttft": ttft_record(best, ttft),
        "levers": lever_results,
        "projection": {"shape": LLAMA3_8B, "fitted_source_layers_per_target": fitted,
                       "by_source_layers": {f"{k:g}": flop_projection(proj_lengths, k)
                                            for k in proj_sizes}},
        "timings": timings,
        **versions(),
    }
    return results, adapters


def format_table(results: Dict[str, Any]) -> str:
    lines = []
    m = results["models"]
    lines.append(f"{m['source']['name']} -> {m['target']['name']}: "
                 f"{results['windows']['train']} training windows, "
                 f"{results['windows']['heldout']} held-out windows of "
                 f"{results['config']['window_tokens']} tokens "
                 f"({results['config']['continuation_tokens']} continuation)")
    lines.append("")
    lines.append("| variant | kept | agreement | L_own | L_conv | L_none | min R² | mean R² K | "
                 "mean R² V | source layers / target layer |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, v in results["variants"].items():
        mean = lambda xs: sum(xs) / len(xs)
        per = mean([len(s) for s in v["source_layers"]])
        lines.append(f"| {name} | {score_cells(v)} | {per:.2f} |")
    lines.append("")
    t = results["ttft"]
    lines.append(f"TTFT of {m['target']['name']} ({t['variant']} adapter, threads: {t['threads']}, "
                 f"median of {results['config']['ttft_repeats']}):")
    lines.append("")
    lines.append("| prompt tokens | own prefill ms | kvbridge ms | ratio | loaded | same 1st token |")
    lines.append("|---:|---:|---:|---:|---:|:---:|")
    for r in t["rows"]:
        lines.append(f"| {r['prompt_tokens']} | {r['own_ms']:.2f} | {r['bridge_ms']:.2f} | "
                     f"{r['ratio']:.2f}x | {r['loaded_tokens']} | "
                     f"{'yes' if r['same_first_token'] else 'no'} |")
    lines.append("")
    by = t["by_variant"]
    lines.append("TTFT ratio by variant (the same own-prefill timings):")
    lines.append("")
    lines.append("| prompt tokens | " + " | ".join(by) + " |")
    lines.append("|---:|" + "---:|" * len(by))
    for i, r in enumerate(t["rows"]):
        lines.append(f"| {r['prompt_tokens']} | "
                     + " | ".join(f"{rows[i]['ratio']:.2f}x" for rows in by.values()) + " |")
    lines.append("")
    lv = results.get("levers") or {}
    if lv:
        lengths = [r["prompt_tokens"] for r in lv["rows"][0]["ttft"]]
        lines.append(f"Levers ({lv['variant']} adapter): tail recompute r (the target computes "
                     "the prompt's last r + 1 tokens) and exact first layers k:")
        lines.append("")
        lines.append("| recompute_tail | exact_layers | kept | agreement | L_conv | "
                     + " | ".join(f"TTFT ratio {n}" for n in lengths) + " |")
        lines.append("|---:|---:|---:|---:|---:|" + "---:|" * len(lengths))
        for r in lv["rows"]:
            lines.append(f"| {r['recompute_tail']} | {r['exact_layers']} | {r['kept']:.4f} | "
                         f"{r['agreement']:.4f} | {r['loss_conv']:.4f} | "
                         + " | ".join(f"{t['ratio']:.2f}x" for t in r["ttft"]) + " |")
        lines.append("")
    p = results["projection"]
    sizes = list(p["by_source_layers"])
    lines.append("FLOP-projected TTFT ratio, Llama-3-8B-sized pair, by source layers per target "
                 f"layer |S_j| (the fitted map: {p['fitted_source_layers_per_target']:.2f}; "
                 "'auto' allows at most 8, 'all' is 32):")
    lines.append("")
    lines.append("| prompt tokens | prefill FLOPs | decode FLOPs | "
                 + " | ".join(f"|S|={k}" for k in sizes) + " |")
    lines.append("|---:|---:|---:|" + "---:|" * len(sizes))
    for i, r in enumerate(p["by_source_layers"][sizes[0]]):
        ratios = " | ".join(f"{p['by_source_layers'][k][i]['ratio']:.1f}x" for k in sizes)
        lines.append(f"| {r['prompt_tokens']} | {r['prefill_flops']:.3g} | "
                     f"{r['decode_flops']:.3g} | {ratios} |")
    return "\n".join(lines)


def fit_default(pair: Any, path: str = DEFAULT_ADAPTER, windows: int = 400,
                variant: str = "rope_auto", progress: bool = True,
                data: Any = None) -> kvbridge.LinearAdapter:
    """Fits one variant on the training split and saves it to `path`."""
    train = text_windows(pair, "train", int(testbed_module(data).MAX_CONTEXT), windows, data)
    adapter = fit_variants(pair, train, [variant], progress=progress)[variant]
    save_adapter(adapter, path)
    return adapter


#: --agreement-goal's default for a testbed module without SERVING_AGREEMENT_GOAL.
DEFAULT_AGREEMENT_GOAL = 0.85


def serving_record(results: Dict[str, Any], agreement_goal: float) -> Optional[Dict[str, Any]]:
    """The serving defaults (LinearAdapter.serving) of the results' measured tail levers (rows
    with exact_layers 0; prompt tokens: window minus continuation), or None when none was
    measured."""
    rows = [r for r in (results.get("levers") or {}).get("rows", []) if r["exact_layers"] == 0]
    if not rows:
        return None
    cfg = results["config"]
    prompt = int(cfg["window_tokens"]) - int(cfg["continuation_tokens"])
    points = [{"recompute_tail": int(r["recompute_tail"]), "kept": finite_or_null(r["kept"]),
               "agreement": finite_or_null(r["agreement"]),
               "computed_share": (int(r["recompute_tail"]) + 1) / prompt,
               "prompt_tokens": prompt} for r in rows]
    return choose_serving(points, agreement_goal,
                          f"kvbridge eval, {results['windows']['heldout']} held-out windows")


def measure_serving(pair: Any, adapter: kvbridge.LinearAdapter, tails: Sequence[int],
                    agreement_goal: float, heldout_windows: int = EvalConfig.heldout_windows,
                    data: Any = None) -> Dict[str, Any]:
    """Serving defaults for `adapter` measured as `kvbridge eval` measures its tail levers (the
    default windows: MAX_CONTEXT tokens, a quarter of them continuation; exact_layers 0): the
    least of `tails` whose agreement reaches agreement_goal (choose_serving)."""
    window = int(testbed_module(data).MAX_CONTEXT)
    cont = window // 4
    heldout = text_windows(pair, "heldout", window, heldout_windows, data)
    levers = [(int(r), 0) for r in tails]
    scores = score_levers(pair.target.model, heldout, cont, pair.tokenizer.bos_id,
                          lambda ids: prefix_kv(pair.source.model, ids), adapter, levers)
    results = {"config": {"window_tokens": window, "continuation_tokens": cont},
               "windows": {"heldout": len(heldout)},
               "levers": {"rows": [{"recompute_tail": r, "exact_layers": 0,
                                    **scores[lever_name(r, 0)]} for r, _ in levers]}}
    record = serving_record(results, agreement_goal)
    assert record is not None
    return record


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvbridge eval", description=__doc__.split("\n")[0],
                                epilog="A --source and --target whose tokenizers differ (as "
                                "testbed-a and testbed-c) run kvbridge.experiments.eval_cross, "
                                "with its own options.")
    add_pair_arguments(p)
    p.add_argument("--adapter", help="evaluate this adapter file (as every variant it is "
                   "given for: only one, named 'loaded') instead of fitting")
    p.add_argument("--save-adapter", metavar="PATH",
                   help="save the best fitted variant (highest kept) to this file, with its "
                   "serving defaults (LinearAdapter.serving) from the measured tail levers")
    p.add_argument("--agreement-goal", type=float, default=None,
                   help="the agreement the saved adapter's recorded recompute_tail must reach: "
                   "the least measured tail (levers with exact_layers 0) that does (default: "
                   "testbed.SERVING_AGREEMENT_GOAL, else 0.85)")
    p.add_argument("--window-tokens", type=int_at_least(0), default=0)
    p.add_argument("--continuation-tokens", type=int_at_least(0), default=0)
    p.add_argument("--train-windows", type=int_at_least(1), default=EvalConfig.train_windows)
    p.add_argument("--heldout-windows", type=int_at_least(1), default=EvalConfig.heldout_windows)
    p.add_argument("--ttft-lengths", type=int_at_least(2), nargs="+", default=[])
    p.add_argument("--ttft-repeats", type=int_at_least(1), default=EvalConfig.ttft_repeats)
    p.add_argument("--chunk-tokens", type=int_at_least(1), default=EvalConfig.chunk_tokens)
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--tail-tokens", type=int_at_least(0), nargs="+", default=[],
                   help="levers: recompute_tail values to score and time (with every "
                   "--exact-layers value)")
    p.add_argument("--exact-layers", type=int_at_least(0), nargs="+", default=[],
                   help="levers: exact_layers values to score and time")
    add_run_arguments(p)
    return p


def _cross_tokenizer_pair(argv: Sequence[str]) -> bool:
    """Whether --source / --target in argv name testbed models of different tokenizers."""
    pick = argparse.ArgumentParser(add_help=False)
    pick.add_argument("--source")
    pick.add_argument("--target")
    known, _ = pick.parse_known_args(argv)
    if known.source is None and known.target is None:
        return False
    from kvbridge.experiments import testbed

    names = (known.source or testbed.SOURCE_NAME, known.target or testbed.TARGET_NAME)
    for name in names:
        if name not in testbed.MODEL_NAMES:
            raise SystemExit(f"kvbridge eval: unknown model {name!r} (expected one of "
                             f"{', '.join(testbed.MODEL_NAMES)})")
    return testbed.load_tokenizer(names[0]).id != testbed.load_tokenizer(names[1]).id


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    if _cross_tokenizer_pair(argv):
        return eval_cross.main(argv)
    args = build_parser().parse_args(argv)
    from kvbridge.experiments import testbed

    config = EvalConfig(window_tokens=args.window_tokens,
                        continuation_tokens=args.continuation_tokens,
                        train_windows=args.train_windows, heldout_windows=args.heldout_windows,
                        ttft_lengths=list(args.ttft_lengths), ttft_repeats=args.ttft_repeats,
                        chunk_tokens=args.chunk_tokens, variants=list(args.variants),
                        seed=args.seed, tail_tokens=list(args.tail_tokens),
                        exact_layers=list(args.exact_layers))
    set_threads(args.threads)
    quiet_model_loading()
    if args.source is None and args.target is None:
        pair = testbed.load_pair()
    else:
        pair = testbed.load_pair(args.source or testbed.SOURCE_NAME,
                                 args.target or testbed.TARGET_NAME)
    adapters = None
    if args.adapter:
        adapters = {"loaded": load_adapter(args.adapter, pair)}
        config.variants = ["loaded"]
    results, adapters = evaluate(pair, config, adapters=adapters, progress=not args.quiet)
    if args.save_adapter:
        if args.adapter:
            raise SystemExit("--save-adapter saves a fitted adapter; it cannot go with --adapter")
        best = results["best_variant"]
        goal = (getattr(testbed, "SERVING_AGREEMENT_GOAL", DEFAULT_AGREEMENT_GOAL)
                if args.agreement_goal is None else args.agreement_goal)
        serving = serving_record(results, goal)
        if serving is not None:
            adapters[best].serving = serving
        save_adapter(adapters[best], args.save_adapter)
        results["saved_adapter"] = {"path": args.save_adapter, "variant": best,
                                    "serving": serving}
        print(f"saved the {best} adapter to {args.save_adapter}"
              + (f" (serving: recompute_tail {serving['recompute_tail']})" if serving
                 else " (no tail lever measured: no serving defaults recorded)"))
    finish(results, args.out, format_table(results))
    return results


if __name__ == "__main__":
    main()
