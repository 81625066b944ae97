#!/usr/bin/env python3
"""Prefix match from Python: vLLM-style chained SHA-256 block hashing vs kvbridge.

The pure-Python peer does what vLLM's prefix cache does with its sha256 block hash, written out
here: token ids in blocks of 16; for each full block

    block_hash = hashlib.sha256(pickle.dumps((parent_block_hash, tuple(block_token_ids), None),
                                             protocol=pickle.HIGHEST_PROTOCOL)).digest()

where None is extra_keys (no LoRA / multimodal / cache salt) and the parent of the first block is
a fixed seed, sha256(b"").digest(). Each hash is looked up in a dict {block_hash: block_id}
holding the prompt's blocks, stopping at the first miss.

The kvbridge side stores the same prompt in a kvbridge.KVStore(chunk_tokens=16) for a tiny
model (1 layer, 1 kv head, head_dim 2, float32) and times store.match(spec, tokens) with the
tokens as a numpy int64 array: with return_kv=False (hashing + lookup only, the comparison),
with return_kv=True (also returns the tiny KV), from a list[int] and from a torch int64 tensor
(both return_kv=False, the forms vLLM requests and most scripts hold), and (for reference only,
not like for like) from a store with kvbridge's default chunk_tokens=256. Speedups are the
peer's time over each kvbridge variant's, in the same run; the target is >= 50x at 32k tokens
for the numpy, list and tensor inputs.

A second table gives the per-call cost of put and match (return_kv=False and True) of a
one-chunk prompt (16 tokens) from a list, the fixed overhead every call pays.

Every variant must match the whole prompt. Times are time.perf_counter (or, with --clock cpu,
this thread's CPU time, time.thread_time, which a loaded machine disturbs less), best of
--repeats repetitions of a calibrated loop, the repetitions of all variants interleaved, with the
garbage collector off while timing (as timeit does).
Prints a markdown table of ns per 16 tokens.

    .venv/bin/python benchmarks/python/bench_prefix_match.py [--require-kvbridge]
"""

import argparse
import gc
import hashlib
import pickle
import random
import sys
import time

BLOCK = 16
PROMPTS = [1024, 8192, 32768, 131072]
SEED_HASH = hashlib.sha256(b"").digest()  # parent of the first block
SPEEDUP_TARGET = 50.0  # at 32k tokens
clock = time.perf_counter  # --clock


# --- pure-Python peer (vLLM-style) -----------------------------------------------------------


def block_hash(parent, block_tokens, extra_keys=None):
    data = pickle.dumps((parent, block_tokens, extra_keys), protocol=pickle.HIGHEST_PROTOCOL)
    return hashlib.sha256(data).digest()


def build_index(tokens):
    index = {}
    parent = SEED_HASH
    for b, start in enumerate(range(0, len(tokens) - BLOCK + 1, BLOCK)):
        parent = block_hash(parent, tuple(tokens[start:start + BLOCK]))
        index[parent] = b
    return index


def python_match(tokens, index):
    """Matched prefix length in tokens; hashes lazily, so a miss stops the work."""
    parent = SEED_HASH
    hit = 0
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        h = block_hash(parent, tuple(tokens[start:start + BLOCK]))
        if index.get(h) is None:
            break
        hit += BLOCK
        parent = h
    return hit


# --- timing ----------------------------------------------------------------------------------


def calibrate(fn, min_rep_seconds):
    """Calls per repetition so that one repetition of `fn` lasts about min_rep_seconds."""
    number = 1
    while True:
        t0 = clock()
        for _ in range(number):
            fn()
        dt = clock() - t0
        if dt >= min_rep_seconds / 4 or number >= 1 << 20:
            break
        number *= 2
    return max(1, int(number * min_rep_seconds / max(dt, 1e-9)))


def best_seconds_interleaved(fns, repeats, min_rep_seconds, before_rep=None):
    """{name: best per-call seconds}. The repetitions of the functions alternate (a, b, c, a, b,
    c, ...), so a stretch of load from other processes hits all of them, not one.
    before_rep: {name: callable} run before each of that function's repetitions, untimed."""
    before_rep = before_rep or {}
    numbers = {name: calibrate(fn, min_rep_seconds) for name, fn in fns.items()}
    best = {name: float("inf") for name in fns}
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            for name, fn in fns.items():
                number = numbers[name]
                if name in before_rep:
                    before_rep[name]()
                t0 = clock()
                for _ in range(number):
                    fn()
                best[name] = min(best[name], (clock() - t0) / number)
    finally:
        if gc_was_enabled:
            gc.enable()
    return best


def ns_per_block(seconds, n_tokens):
    return seconds * 1e9 / (n_tokens // BLOCK)


# --- kvbridge --------------------------------------------------------------------------------


class KVBridgeSide:
    def __init__(self):
        import numpy as np
        import torch
        import kvbridge

        self.np, self.torch, self.kvbridge = np, torch, kvbridge
        self.spec = kvbridge.ModelSpec("bench", num_layers=1, num_kv_heads=1, head_dim=2)

    def prepare(self, tokens, chunk_tokens=BLOCK):
        """A store holding `tokens`; returns (store, tokens as numpy int64)."""
        store = self.kvbridge.KVStore(1 << 30, chunk_tokens=chunk_tokens)
        n = len(tokens)
        g = self.torch.Generator().manual_seed(n)
        # Non-zero random KV, [batch 1, kv_heads 1, tokens, head_dim 2] per K and V.
        k = self.torch.rand(1, 1, n, 2, generator=g) + 0.5
        v = self.torch.rand(1, 1, n, 2, generator=g) + 0.5
        tokens_np = self.np.asarray(tokens, dtype=self.np.int64)
        store.put(self.spec, tokens_np, ((k, v),))
        return store, tokens_np

    def variants(self, tokens):
        """{name: (callable, expected matched tokens)}."""
        spec = self.spec
        store, tokens_np = self.prepare(tokens)
        tokens_t = self.torch.from_numpy(tokens_np.copy())
        store256, _ = self.prepare(tokens, 256)
        n256 = len(tokens) // 256 * 256
        return {
            "return_kv=False": (lambda: store.match(spec, tokens_np, return_kv=False), len(tokens)),
            "return_kv=True": (lambda: store.match(spec, tokens_np, return_kv=True), len(tokens)),
            "list input": (lambda: store.match(spec, tokens, return_kv=False), len(tokens)),
            "tensor input": (lambda: store.match(spec, tokens_t, return_kv=False), len(tokens)),
            "chunk 256": (lambda: store256.match(spec, tokens_np, return_kv=False), n256),
        }


    def call_overhead(self, repeats, min_rep_seconds):
        """{name: per-call seconds} of put / match of a one-chunk (16-token) prompt from a list:
        the fixed cost of a call. put stores a fresh chunk each time (the store is cleared
        between repetitions, outside the timing); the matches hit."""
        spec = self.spec
        store = self.kvbridge.KVStore(1 << 30, chunk_tokens=BLOCK)
        g = self.torch.Generator().manual_seed(7)
        kv = ((self.torch.rand(1, 1, BLOCK, 2, generator=g) + 0.5,
               self.torch.rand(1, 1, BLOCK, 2, generator=g) + 0.5),)
        ids = list(range(1000, 1000 + BLOCK))
        fresh = iter(range(1 << 40))
        store.put(spec, ids, kv)

        def put():
            prompt = [next(fresh) % (1 << 32)] + ids[1:]
            return store.put(spec, prompt, kv)

        def reset():  # each repetition of put starts from a store holding only `ids`
            store.clear()
            store.put(spec, ids, kv)

        tokens_t = self.torch.tensor(ids, dtype=self.torch.int64)
        fns = {"put": put,
               "match, return_kv=False": lambda: store.match(spec, ids, return_kv=False),
               "match from a tensor, return_kv=False":
                   lambda: store.match(spec, tokens_t, return_kv=False),
               "match, return_kv=True": lambda: store.match(spec, ids, return_kv=True)}
        for name, fn in fns.items():
            if name != "put" and fn().tokens != BLOCK:
                raise RuntimeError(f"kvbridge {name} missed")
        return best_seconds_interleaved(fns, repeats, min_rep_seconds, {"put": reset})


# --- main ------------------------------------------------------------------------------------


def fmt(x, digits=1, suffix=""):
    return "n/a" if x is None else f"{x:.{digits}f}{suffix}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, nargs="*", default=PROMPTS)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--min-rep-seconds", type=float, default=0.2)
    ap.add_argument("--python-only", action="store_true", help="skip kvbridge")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="time.perf_counter (wall) or this thread's CPU time (cpu)")
    ap.add_argument("--require-kvbridge", action="store_true",
                    help="exit with status 2 when kvbridge cannot be imported or fails")
    args = ap.parse_args()
    global clock
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter

    kvb, kvb_error = None, None
    if not args.python_only:
        try:
            kvb = KVBridgeSide()
        except Exception as e:  # noqa: BLE001 - reported in the output
            kvb_error = f"import failed: {type(e).__name__}: {e}"

    rows = []
    for n in args.prompts:
        rng = random.Random(n)
        tokens = [rng.randrange(128000) for _ in range(n)]
        index = build_index(tokens)
        assert python_match(tokens, index) == n
        fns = {"python": lambda: python_match(tokens, index)}
        if kvb is not None:
            try:
                for name, (fn, expected) in kvb.variants(tokens).items():
                    m = fn()
                    if m.tokens != expected:
                        raise RuntimeError(
                            f"kvbridge {name} matched {m.tokens} of {expected} tokens")
                    del m
                    fns[name] = fn
            except Exception as e:  # noqa: BLE001 - reported in the output
                kvb_error = f"{type(e).__name__}: {e}"
        best = best_seconds_interleaved(fns, args.repeats, args.min_rep_seconds)
        row = {"n": n}
        row.update({name: ns_per_block(sec, n) for name, sec in best.items()})
        rows.append(row)
        print(f"  {n} tokens done", file=sys.stderr)

    where = ""
    if kvb is not None:
        where = (f" kvbridge {getattr(kvb.kvbridge, '__version__', '?')}, numpy "
                 f"{kvb.np.__version__}, torch {kvb.torch.__version__}.")
    clock_name = "time.thread_time" if args.clock == "cpu" else "time.perf_counter"
    print(f"Python {sys.version.split()[0]}, best of {args.repeats} interleaved repetitions "
          f"({clock_name}, ~{args.min_rep_seconds} s each).{where}")
    print()
    def speedup(r, name):
        v = r.get(name)
        if v is None:
            return "n/a"
        x = r["python"] / v
        mark = ""
        if r["n"] == 32768 and name != "chunk 256":
            mark = " (>= 50x)" if x >= SPEEDUP_TARGET else " (**< 50x**)"
        return f"{x:.1f}x{mark}"

    print("| prompt tokens | pure-Python vLLM-style sha256 | kvbridge match, numpy int64 "
          "| speedup | kvbridge match, list[int] | speedup | kvbridge match, torch tensor "
          "| speedup | kvbridge match, return_kv=True | kvbridge chunk_tokens=256 "
          "| speedup at chunk 256 |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['n']} | {fmt(r['python'])} | {fmt(r.get('return_kv=False'))} "
              f"| {speedup(r, 'return_kv=False')} | {fmt(r.get('list input'))} "
              f"| {speedup(r, 'list input')} | {fmt(r.get('tensor input'))} "
              f"| {speedup(r, 'tensor input')} | {fmt(r.get('return_kv=True'))} "
              f"| {fmt(r.get('chunk 256'))} | {speedup(r, 'chunk 256')} |")
    print()
    print("All values are ns per 16 tokens (lower is better); speedup = pure-Python / kvbridge "
          "(each variant). Every kvbridge column uses chunk_tokens=16 except the chunk-256 "
          "one, which is not like for like with vLLM's 16-token blocks (it reuses prefixes only "
          "in steps of 256 tokens).")
    if kvb is not None and kvb_error is None:
        try:
            over = kvb.call_overhead(args.repeats, args.min_rep_seconds / 4)
        except Exception as e:  # noqa: BLE001 - reported in the output
            kvb_error = f"{type(e).__name__}: {e}"
        else:
            print()
            print(f"Per-call cost of a one-chunk ({BLOCK}-token) prompt from a list, tiny model "
                  "(target <= 5 us):")
            print()
            print("| call | us per call |")
            print("|---|---:|")
            for name, sec in over.items():
                mark = "" if sec * 1e6 <= 5.0 else " (**> 5 us**)"
                print(f"| {name} | {sec * 1e6:.2f}{mark} |")
    if kvb_error or args.python_only:
        print()
        print(f"kvbridge not measured: {kvb_error or 'skipped (--python-only)'}")
        if args.require_kvbridge and kvb_error:
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
