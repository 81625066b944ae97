import pathlib
import threading

import pytest
import torch

import kvbridge

VECTORS = pathlib.Path(__file__).resolve().parents[1] / "vectors" / "prefix_hash.txt"


def random_kv(spec, tokens, seed, strided=False):
    """Seeded random legacy KV (never zeros); strided=True gives non-contiguous tensors."""
    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, spec.dtype)
    out = []
    for _ in range(spec.num_layers):
        pair = []
        for _ in range(2):
            if strided:  # [1, T, H, D] storage viewed as [1, H, T, D]
                t = torch.randn(1, tokens, spec.num_kv_heads, spec.head_dim + 3, generator=g)
                t = t.to(dtype)[..., : spec.head_dim].transpose(1, 2)
            else:
                t = torch.randn(1, spec.num_kv_heads, tokens, spec.head_dim, generator=g).to(dtype)
            pair.append(t)
        out.append(tuple(pair))
    return tuple(out)


def run_threads(work, n=4):
    """Runs work(i) on n threads, i = 0 .. n - 1, and waits for them all."""
    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@pytest.fixture
def spec():
    return kvbridge.ModelSpec("test-model", num_layers=3, num_kv_heads=2, head_dim=6)
