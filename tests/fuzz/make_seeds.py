"""Writes the seed corpora of tests/fuzz/corpus/ (valid inputs of each parser) with the
installed kvbridge package. Run from the repository root: python tests/fuzz/make_seeds.py"""
import glob
import os
import shutil
import sys
import tempfile

import numpy as np
import torch
from safetensors.numpy import save_file

import kvbridge

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")


def kv(spec, tokens, seed):
    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, spec.dtype)
    return tuple((torch.randn(1, spec.num_kv_heads, tokens, spec.head_dim, generator=g).to(dtype),
                  torch.randn(1, spec.num_kv_heads, tokens, spec.head_dim, generator=g).to(dtype))
                 for _ in range(spec.num_layers))


def entries():
    # The geometry fuzz_disk_entry.cpp looks up: bfloat16, 2 layers, 1 head, dim 4, chunk 4.
    spec = kvbridge.ModelSpec("fuzz-model", 2, 1, 4, dtype="bfloat16")
    for storage in ("native", "int8"):
        with tempfile.TemporaryDirectory() as d:
            store = kvbridge.KVStore(1 << 20, chunk_tokens=4, disk_dir=d, storage=storage,
                                     disk_fsync=False)
            store.put(spec, [11, 22, 33, 44, 55, 66, 77, 88], kv(spec, 8, 1))
            del store
            files = sorted(glob.glob(os.path.join(d, "**", "*.kvb"), recursive=True))
            for i, f in enumerate(files):
                shutil.copy(f, os.path.join(ROOT, "store_entry", f"{storage}-{i}.kvb"))
                if storage == "native":
                    shutil.copy(f, os.path.join(ROOT, "disk_entry", f"{storage}-{i}.kvb"))


def safetensors_files():
    rng = np.random.default_rng(2)
    save_file({"a": rng.standard_normal((2, 3)).astype(np.float32),
               "b": rng.integers(0, 9, size=(4,)).astype(np.int32)},
              os.path.join(ROOT, "safetensors", "two-tensors.safetensors"),
              metadata={"format": "pt", "k": "v"})
    save_file({"x": np.zeros((0, 5), dtype=np.float16) + 1},
              os.path.join(ROOT, "safetensors", "empty-tensor.safetensors"))


def two_to_one(src=None, dst=None):
    """An adapter fitted from a 2-layer source to a 1-layer target (plain specs by default)."""
    src = src or kvbridge.ModelSpec("fuzz-src", 2, 1, 4, dtype="float32")
    dst = dst or kvbridge.ModelSpec("fuzz-dst", 1, 1, 4, dtype="float32")
    fitter = kvbridge.AdapterFitter(src, dst, source_layers="all", ridge=0.1)
    for seed in range(4):
        fitter.add(kv(src, 24, 10 + seed), kv(dst, 24, 20 + seed))
    return fitter.fit()


def adapter_files():
    seed = os.path.join(ROOT, "adapter_file", "two-to-one.safetensors")
    two_to_one().save(seed)
    resign_huge_head_dim(seed)


def layered_adapter_file():
    """layered-unchecked: specs with per-layer attention (both RoPE groups, a window, a scaled
    layer), without a checksum so the fuzzer's mutations reach the layer_attention JSON."""
    la = kvbridge.LayerAttention
    src = kvbridge.ModelSpec("fuzz-src", 2, 1, 4, dtype="float32", layer_attention=[
        la(1e4, sliding_window=8), la(1e6, kvbridge.RopeScaling("linear", 2.0))])
    dst = kvbridge.ModelSpec("fuzz-dst", 1, 1, 4, dtype="float32", layer_attention=[la(5e5)])
    save_unchecked(two_to_one(src, dst), "layered-unchecked.safetensors")


def served_adapter_file():
    """served-unchecked: an adapter with a serving record (tails by length, a share, measured
    points with a figure not measured), without a checksum so mutations reach the serving JSON."""
    adapter = two_to_one()
    adapter.serving = {
        "recompute_tail": 2, "recompute_share": 0.25, "agreement_goal": 0.85, "note": "seed",
        "by_length": [{"prompt_tokens": 24, "recompute_tail": 2},
                      {"prompt_tokens": 96, "recompute_tail": 24}],
        "measured": [{"recompute_tail": 2, "kept": 0.5, "agreement": 0.86,
                      "computed_share": 0.125, "prompt_tokens": 24},
                     {"recompute_tail": 24, "kept": None, "agreement": 0.9,
                      "computed_share": 0.26, "prompt_tokens": 96}]}
    save_unchecked(adapter, "served-unchecked.safetensors")


def save_unchecked(adapter, file_name):
    """Saves `adapter` as corpus/adapter_file/`file_name` without its checksum."""
    from safetensors import safe_open

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "a.safetensors")
        adapter.save(path)
        with safe_open(path, framework="np") as f:
            meta = dict(f.metadata())
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    del meta["checksum"]
    save_file(tensors, os.path.join(ROOT, "adapter_file", file_name), metadata=meta)


def resign_huge_head_dim(seed):
    """crash-huge-head-dim: the seed with the hand-written source spec of the crash file (head
    dim 2^40, its fingerprint matching) and a valid checksum, so that load gets past the
    checksum to the spec's bounds, where the crash was."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    sys.path.insert(0, os.path.join(os.path.dirname(ROOT), "..", "python"))
    from test_adapter import adapter_checksum

    crash = os.path.join(ROOT, "adapter_file", "crash-huge-head-dim.safetensors")
    with safe_open(crash, framework="np") as f:
        spec = f.metadata()["source_spec"]
    with safe_open(seed, framework="np") as f:
        meta = dict(f.metadata())
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    unchecked = dict(meta)
    del unchecked["checksum"]  # the fuzzer loads with allow_unchecked: mutations reach past it
    save_file(tensors, os.path.join(ROOT, "adapter_file", "two-to-one-unchecked.safetensors"),
              metadata=unchecked)
    meta["source_spec"] = spec
    meta["checksum"] = adapter_checksum(meta, {k: torch.from_numpy(v) for k, v in tensors.items()})
    save_file(tensors, crash, metadata=meta)


if __name__ == "__main__":
    entries()
    safetensors_files()
    adapter_files()
    layered_adapter_file()
    served_adapter_file()
