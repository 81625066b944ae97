"""Selective recompute, measured: the target recomputes chosen prompt tokens with the rest of the
converted cache as their context (the idea of CacheBlend), against recomputing only the last ones.

Run as ``python -m kvbridge.experiments.selective --source smollm2-135m --target gemma3-270m
--adapter FILE`` on the held-out windows ``kvbridge eval`` scores (same split, same metrics).

For a budget of r prompt tokens (beside the last prompt token, which the target always computes)
each rule picks which r positions the target recomputes; every other position keeps its converted
KV (the start token's is the target's own, as Bridge serves it). One forward computes the chosen
tokens and the continuation at their own positions, each attending to the cached and recomputed
keys at positions not after its own (within the layer's window), so the chosen tokens' new KV
replaces their converted KV for every later token.

Rules:
- ``tail``: the last r (what Bridge's recompute_tail does).
- ``deviation-l0``: the r largest deviations at the target's first layer, whose KV depends on the
  token alone (embedding, norm, K/V projections: no attention), so a server can compute it for
  every prompt token for a small share of a prefill.
- ``deviation-all``: the r largest deviations over all layers against the target's own prefill.
  Not something a server can know (it needs the prefill it saves); a bound on what choosing by
  deviation can reach.
- ``half-tail``: the last r/2 plus the r/2 largest first-layer deviations of the rest.

Deviation of a position at a layer: the squared error of its converted K and V against the
target's own, summed over heads and divided by the layer's mean squared norm of its own K and V.
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
from kvbridge.experiments import common, corpus, real_eval

RULES = ("tail", "deviation-l0", "deviation-all", "half-tail")


def deviation(conv: KVCache, own: KVCache, layers: Sequence[int]) -> torch.Tensor:
    """Per position [n]: the mean over `layers` of the normalized KV error (module docstring)."""
    total = None
    for layer in layers:
        (ck, cv), (ok, ov) = conv[layer], own[layer]
        err = ((ck - ok) ** 2).sum(dim=(0, 1, 3)) + ((cv - ov) ** 2).sum(dim=(0, 1, 3))
        scale = ((ok ** 2).sum(dim=(0, 1, 3)) + (ov ** 2).sum(dim=(0, 1, 3))).mean()
        d = err / scale
        total = d if total is None else total + d
    return total / len(layers)


def choose(rule: str, budget: int, keep_end: int, dev_l0: torch.Tensor,
           dev_all: torch.Tensor) -> List[int]:
    """The positions in [1, keep_end) the target recomputes under `rule` (sorted)."""
    budget = min(budget, keep_end - 1)
    if budget <= 0:
        return []
    if rule == "tail":
        return list(range(keep_end - budget, keep_end))

    def largest(dev: torch.Tensor, count: int, exclude: set) -> List[int]:
        order = torch.argsort(dev[1:keep_end], descending=True).tolist()
        return [i + 1 for i in order if i + 1 not in exclude][:count]

    if rule == "deviation-l0":
        return sorted(largest(dev_l0, budget, set()))
    if rule == "deviation-all":
        return sorted(largest(dev_all, budget, set()))
    if rule == "half-tail":
        tail = list(range(keep_end - budget // 2, keep_end))
        return sorted(tail + largest(dev_l0, budget - len(tail), set(tail)))
    raise kvbridge.InvalidArgumentError(f"unknown rule {rule!r}; expected one of {RULES}")


def _masks(model, query_pos: torch.Tensor, key_pos: torch.Tensor):
    """The attention mask(s) for queries at query_pos over keys at key_pos: a key is seen when it
    is not after the query and, on a sliding-window layer, within the window."""
    seen = key_pos[None, :] <= query_pos[:, None]
    config = getattr(model.config, "text_config", model.config)
    window = getattr(config, "sliding_window", None)
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    eager = getattr(config, "_attn_implementation", "sdpa") == "eager"

    def form(mask: torch.Tensor) -> torch.Tensor:
        mask = mask[None, None]
        if not eager:
            return mask
        return torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)

    if kinds == {"full_attention"}:
        return form(seen)
    masks = {"full_attention": form(seen)}
    if "sliding_attention" in kinds:
        masks["sliding_attention"] = form(seen & (query_pos[:, None] - key_pos[None, :] < window))
    return masks


@torch.no_grad()
def forward_at(model, ids: Sequence[int], positions: Sequence[int], past: KVCache,
               past_positions: Sequence[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] of tokens `ids` at `positions` after the cache `past` whose
    entries sit at `past_positions` (any order; neither needs to be contiguous)."""
    q = torch.as_tensor(list(positions), dtype=torch.long)
    k = torch.cat([torch.as_tensor(list(past_positions), dtype=torch.long), q])
    x = torch.as_tensor(list(ids), dtype=torch.long).view(1, -1)
    kw = {hf._cache_keyword(model): hf.as_cache(past)}
    out = model(x, position_ids=q.view(1, -1), attention_mask=_masks(model, q, k),
                use_cache=True, **kw)
    return out.logits[0].float()


def _take(kv: KVCache, positions: Sequence[int]) -> KVCache:
    index = torch.as_tensor(list(positions), dtype=torch.long)
    return tuple((k[:, :, index], v[:, :, index]) for k, v in kv)


def score(pair: real_eval.Pair, adapters: Dict[str, kvbridge.LinearAdapter], texts: Sequence[str],
          share: float, budgets: Sequence[int], rules: Sequence[str] = RULES,
          progress: bool = True) -> Dict[str, Dict[int, Dict[str, Any]]]:
    """Pooled kept / agreement per adapter and rule ("name/rule") and budget over held-out
    windows (module docstring); the adapters are scored on the same windows."""
    src_m, tgt_m = pair.source, pair.target
    start = real_eval.start_kv(tgt_m)
    rules = [f"{name}/{rule}" for name in adapters for rule in rules]
    sums = {(rule, r): common.Sums() for rule in rules for r in budgets}
    computed = {key: 0 for key in sums}
    windows = prompt_tokens = 0
    for w in real_eval.heldout_windows(pair, texts, share, progress):
        ids, p = w.ids, w.p
        own = hf.prefix_kv(tgt_m.model, ids[:p - 1])
        src_kv = hf.prefix_kv(src_m.model, w.src.ids)
        keep_end = p - 1  # positions [0, p-1) are cached; p-1 onward the target computes
        for name, adapter in adapters.items():
            conv = real_eval.converted(adapter, w, src_kv, start)
            dev_l0 = deviation(conv, own, [0])
            dev_all = deviation(conv, own, range(len(own)))
            for rule in rules:
                if not rule.startswith(name + "/"):
                    continue
                for r in budgets:
                    chosen = choose(rule.split("/", 1)[1], r, keep_end, dev_l0, dev_all)
                    kept_pos = [i for i in range(keep_end) if i not in set(chosen)]
                    run = chosen + list(range(keep_end, len(ids) - 1))
                    logits = forward_at(tgt_m.model, [ids[i] for i in run], run,
                                        _take(conv, kept_pos), kept_pos)
                    sums[(rule, r)].add_scored(w.reference, logits[-len(w.targets):])
                    computed[(rule, r)] += len(chosen) + 1
        windows += 1
        prompt_tokens += p
    if not windows:
        raise real_eval.no_windows()
    out: Dict[str, Dict[int, Dict[str, Any]]] = {}
    for (rule, r), s in sums.items():
        out.setdefault(rule, {})[r] = {**s.metrics(), "budget": r, "windows": windows,
                                       "recomputed_share": computed[(rule, r)] / prompt_tokens}
    return out


def format_table(results: Dict[str, Dict[int, Dict[str, Any]]]) -> str:
    lines = ["| rule | budget | share computed | kept | agreement |", "|---|---:|---:|---:|---:|"]
    for rule, rows in results.items():
        for r, m in sorted(rows.items()):
            lines.append(f"| {rule} | {r} | {100 * m['recomputed_share']:.1f}% | "
                         f"{m['kept']:.3f} | {m['agreement']:.3f} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m kvbridge.experiments.selective",
                                description=__doc__.split("\n\n")[0])
    common.add_real_pair_arguments(p)
    p.add_argument("--adapter", required=True, nargs="+", metavar="[NAME=]FILE",
                   help="adapter files (fitted on training files), scored on the same windows")
    p.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--rules", nargs="+", default=list(RULES), choices=RULES)
    p.add_argument("--heldout-windows", type=int, default=24)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", default="selective-out")
    args = p.parse_args(argv)
    config = real_eval.RealConfig(heldout_windows=args.heldout_windows)
    common.set_threads(args.threads)
    _, heldout_files = corpus.split_files(corpus.default_files(), config.heldout_share, config.seed)
    heldout = corpus.windows(heldout_files, config.window_bytes, config.heldout_windows)
    pair = real_eval.Pair(models.load(args.source), models.load(args.target))
    adapters = {}
    for i, item in enumerate(args.adapter):
        name, _, path = item.rpartition("=")
        adapters[name or f"a{i}"] = kvbridge.LinearAdapter.load(path)
    results = score(pair, adapters, heldout, config.continuation_share, args.budgets, args.rules)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "selective.json").write_text(json.dumps(
        {"source": args.source, "target": args.target, "adapters": args.adapter,
         "results": {rule: {str(r): m for r, m in rows.items()} for rule, rows in results.items()}},
        indent=1, default=common.finite_or_null))
    print(format_table(results))
    return results


if __name__ == "__main__":
    main()
