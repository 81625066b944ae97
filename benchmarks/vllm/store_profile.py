"""Where kvbridge's store time per prompt goes, outside vLLM: one SmolLM2-135M-shaped prompt
(30 layers x 3 KV heads x 64, float32, random values) put into a fresh KVStore with 32-token
chunks, as the connector's background thread does, for each store setup vs_lmcache.py could use.

    .venv-lmcache/bin/python benchmarks/vllm/store_profile.py [--tokens 4000] [--repeats 5]

Prints wall and CPU milliseconds per put (median [min-max] over fresh stores) for: the memory
tier alone; memory + disk with fsync (the connector's default, vs_lmcache.py's setup); memory +
disk without fsync.
"""
import argparse
import statistics
import tempfile
import time

import torch

from kvbridge import KVStore, ModelSpec

LAYERS, HEADS, DIM = 30, 3, 64


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    spec = ModelSpec("smollm2-like", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                     dtype="float32")
    gen = torch.Generator().manual_seed(0)
    kv = tuple((torch.randn(1, HEADS, args.tokens, DIM, generator=gen),
                torch.randn(1, HEADS, args.tokens, DIM, generator=gen)) for _ in range(LAYERS))
    setups = {"memory only": {}, "memory + disk, fsync": {"disk": True, "disk_fsync": True},
              "memory + disk, no fsync": {"disk": True, "disk_fsync": False}}
    print(f"| store ({args.tokens} tokens, {args.tokens // 32} chunks of 32) | wall ms per put "
          f"| CPU ms per put |")
    print("|---|---:|---:|")
    for name, setup in setups.items():
        walls, cpus = [], []
        for r in range(args.repeats):
            with tempfile.TemporaryDirectory() as d:
                opts = {"disk_dir": d, "disk_fsync": setup["disk_fsync"]} if setup else {}
                store = KVStore(1 << 30, chunk_tokens=32, **opts)
                tokens = [(r * 7919 + i) % 49152 for i in range(args.tokens)]
                c, t = time.process_time(), time.perf_counter()
                store.put(spec, tokens, kv)
                walls.append(1e3 * (time.perf_counter() - t))
                cpus.append(1e3 * (time.process_time() - c))
        print(f"| {name} | {statistics.median(walls):.1f} [{min(walls):.1f}-{max(walls):.1f}] | "
              f"{statistics.median(cpus):.1f} [{min(cpus):.1f}-{max(cpus):.1f}] |")


if __name__ == "__main__":
    main()
