"""End-to-end refinement of a real pair's adapter, across tokenizers.

Starts from a fitted adapter (``kvbridge eval --save-adapter``) and adjusts every map's weights
and biases by Adam on KL(p_own || p_conv) over the continuation tokens of training windows: the
target's next-token distributions after its own prefill of the window's prompt against after the
source's prefill converted through the alignment (the split, the alignment policy and the
target's own start-token KV as ``kvbridge eval`` scores them). The windows come from the training
files only, those after the ones the closed-form fit used; validation windows are the next ones.
The validation KL is measured every ``check_every`` steps, and the best weights (the closed form
included) are kept, so refinement never returns an adapter worse on the validation windows.

Run as ``python -m kvbridge.experiments.real_refine --source smollm2-135m --target gemma3-270m
--adapter FIT --out REFINED``, then score REFINED with ``kvbridge eval --adapter REFINED``.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import torch

import kvbridge
from kvbridge import hf, models
from kvbridge._tensors import KVCache
from kvbridge.experiments import common, corpus, eval_cross, real_eval
from kvbridge.experiments.refine import TorchAdapter


def aligned_forward(adapter: TorchAdapter, src: KVCache, index: Sequence[int],
                    start: KVCache) -> KVCache:
    """The differentiable ``LinearAdapter.convert(src, alignment=index)`` with the first token's
    KV replaced by the target's own `start` (real_eval.with_own_start)."""
    feats = adapter.features(src)  # un-rotated at the source's positions
    rows = torch.as_tensor(list(index), dtype=torch.long)
    feats = [f[rows] for f in feats]
    h, d = adapter.target.num_kv_heads, adapter.target.head_dim
    out = []
    for j, layers in enumerate(adapter.layer_map):
        x = torch.cat([feats[l] for l in layers], dim=1)
        key, value = (x @ adapter.weights[2 * j + i] + adapter.biases[2 * j + i] for i in range(2))
        t = key.shape[0]
        key = adapter.target_keys(j, key)
        value = value.view(t, h, d).transpose(0, 1)
        sk, sv = start[j]
        key = torch.cat([sk[0].to(key.dtype), key[:, 1:]], dim=1)
        value = torch.cat([sv[0].to(value.dtype), value[:, 1:]], dim=1)
        out.append((key.unsqueeze(0).float(), value.unsqueeze(0).float()))
    return tuple(out)


class Window:
    """One training window's split, alignment and source cache (what a step needs)."""

    def __init__(self, pair: real_eval.Pair, text: str, share: float, policy: str):
        split = eval_cross.split_window(pair.target.tokenizer, text, share)
        if split is None:
            raise ValueError("window too short")
        self.ids, self.p = split.target.ids, split.p
        cached = eval_cross.Encoded(self.ids[:self.p - 1], split.target.offsets[:self.p - 1],
                                    split.target.roles[:self.p - 1])
        src = real_eval.encode(pair.source, split.prefix_text)
        self.index, _ = eval_cross.alignment(policy, src, cached)
        self.src_ids = src.ids

    def own_logits(self, target) -> torch.Tensor:
        own_kv = hf.prefix_kv(target, self.ids[:self.p - 1])
        return hf.forward(target, self.ids[self.p - 1:-1], own_kv)[0]


def kl(own: torch.Tensor, conv: torch.Tensor) -> torch.Tensor:
    lp_own = torch.log_softmax(own.double(), -1)
    return (lp_own.exp() * (lp_own - torch.log_softmax(conv.double(), -1))).sum(-1).mean()


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m kvbridge.experiments.real_refine",
                                description=__doc__.split("\n\n")[0])
    common.add_real_pair_arguments(p)
    p.add_argument("--adapter", required=True, help="the closed-form fit")
    p.add_argument("--out", required=True, help="path of the refined adapter file")
    p.add_argument("--skip-windows", type=int, default=128, help="training windows the fit used")
    p.add_argument("--train-windows", type=int, default=96)
    p.add_argument("--val-windows", type=int, default=12)
    p.add_argument("--steps", type=int, default=192)
    p.add_argument("--check-every", type=int, default=48)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    common.set_threads(args.threads)
    torch.manual_seed(args.seed)
    config = real_eval.RealConfig()
    train_files, _ = corpus.split_files(corpus.default_files(), config.heldout_share, config.seed)
    texts = corpus.windows(train_files, config.window_bytes,
                           args.skip_windows + args.train_windows + args.val_windows)
    texts = texts[args.skip_windows:]
    pair = real_eval.Pair(models.load(args.source), models.load(args.target))
    closed = kvbridge.LinearAdapter.load(args.adapter)
    model = TorchAdapter(closed, args.adapter)
    policy = closed.alignment_policy or "covering"
    windows = []
    for text in texts:
        try:
            windows.append(Window(pair, text, config.continuation_share, policy))
        except ValueError:
            pass
    train, val = windows[:args.train_windows], windows[args.train_windows:]
    target = pair.target.model
    for q in target.parameters():
        q.requires_grad_(False)
    start = real_eval.start_kv(pair.target)
    val_own = [w.own_logits(target) for w in val]

    def loss_of(w: Window, own: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            src = hf.prefix_kv(pair.source.model, w.src_ids)
        conv = aligned_forward(model, src, w.index, start)
        ids = torch.as_tensor(w.ids[w.p - 1:-1], dtype=torch.long).view(1, -1)
        out = target(ids, use_cache=True, **{hf._cache_keyword(target): hf.as_cache(conv)})
        return kl(own, out.logits[0])

    def val_loss() -> float:
        with torch.no_grad():
            return sum(float(loss_of(w, o)) for w, o in zip(val, val_own)) / len(val)

    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=args.lr)
    best = val_loss()
    best_state = [q.detach().clone() for q in params]
    history: List[Dict[str, Any]] = [{"step": 0, "val_kl": best}]
    print(f"closed form: validation KL {best:.5f}", file=sys.stderr, flush=True)
    rng = random.Random(args.seed)
    t0, train_sum = time.perf_counter(), 0.0
    for step in range(1, args.steps + 1):
        w = train[rng.randrange(len(train))]
        with torch.no_grad():
            own = w.own_logits(target)
        loss = loss_of(w, own)
        grads = torch.autograd.grad(loss, params)
        for q, g in zip(params, grads):
            q.grad = g
        opt.step()
        train_sum += float(loss.detach())
        if step % args.check_every == 0 or step == args.steps:
            current = val_loss()
            history.append({"step": step, "val_kl": current, "train_kl": train_sum / args.check_every,
                            "seconds": time.perf_counter() - t0})
            print(f"step {step}: train KL {train_sum / args.check_every:.5f}, validation KL "
                  f"{current:.5f} (best {best:.5f}), {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr, flush=True)
            train_sum = 0.0
            if current < best:
                best = current
                best_state = [q.detach().clone() for q in params]
    with torch.no_grad():
        for q, b in zip(params, best_state):
            q.copy_(b)
    # The closed form's report (its alignment policy, layer selection, R²), plus the refinement.
    model.save(args.out, {**closed.report, "refinement": history})
    print(f"wrote {args.out}; history {history}", file=sys.stderr)
    return {"history": history}


if __name__ == "__main__":
    main()
