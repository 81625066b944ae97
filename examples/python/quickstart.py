"""Save a prompt's KV cache, match it back for a longer prompt, and check the reuse is exact.

A small random causal attention stack stands in for a model here (the testbed language models
come with the cross-model bridge). The second request reuses the cached prefix and computes only
its new tokens; its last hidden state must equal a full recompute.
"""
import time

import torch

import kvbridge

torch.manual_seed(0)
LAYERS, HEADS, HEAD_DIM, VOCAB = 4, 4, 32, 256
WIDTH = HEADS * HEAD_DIM


class ToyStack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(WIDTH, 3 * WIDTH) for _ in range(LAYERS))

    def forward(self, ids, past=None):
        """ids [1, n]; past: legacy KV for the tokens before ids. Returns (hidden, new KV)."""
        x = self.embed(ids)
        start = 0 if past is None else past[0][0].shape[2]
        kv = []
        for layer, proj in enumerate(self.qkv):
            q, k, v = (t.view(1, -1, HEADS, HEAD_DIM).transpose(1, 2)
                       for t in proj(x).chunk(3, dim=-1))
            if past is not None:
                k = torch.cat([past[layer][0], k], dim=2)
                v = torch.cat([past[layer][1], v], dim=2)
            kv.append((k, v))
            n, total = q.shape[2], k.shape[2]
            mask = torch.ones(n, total, dtype=torch.bool).tril(diagonal=start)
            att = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + att.transpose(1, 2).reshape(1, n, WIDTH)
        return x, tuple(kv)


model = ToyStack().eval()
spec = kvbridge.ModelSpec("toy-stack", LAYERS, HEADS, HEAD_DIM, dtype="float32")
store = kvbridge.KVStore(capacity_bytes=256 << 20, chunk_tokens=64)

system_prompt = torch.randint(0, VOCAB, (1, 1500))
question = torch.randint(0, VOCAB, (1, 40))
full = torch.cat([system_prompt, question], dim=1)

with torch.no_grad():
    model(full)  # warm-up, so neither timing pays for first-call setup
    _, kv = model(system_prompt)
    stored = store.put(spec, system_prompt[0], kv)

    t0 = time.perf_counter()
    reference, _ = model(full)
    t_full = time.perf_counter() - t0

    t0 = time.perf_counter()
    hit = store.match(spec, full[0])
    reused, _ = model(full[:, hit.tokens:], past=hit.kv)
    t_reuse = time.perf_counter() - t0

err = (reused[0, -1] - reference[0, -1]).abs().max().item()
print(f"stored {stored} of {system_prompt.shape[1]} prompt tokens "
      f"({store.stats()['entries']} chunks of {store.chunk_tokens})")
print(f"second request: {full.shape[1]} tokens, {hit.tokens} from the cache, "
      f"{full.shape[1] - hit.tokens} computed")
print(f"last hidden state vs full recompute: max abs diff {err:.2e}")
print(f"prefill {t_full * 1e3:.1f} ms, match + suffix {t_reuse * 1e3:.1f} ms "
      f"({t_full / t_reuse:.1f}x)")
print("stats:", {k: v for k, v in store.stats().items() if v})
if err > 1e-4:
    raise SystemExit("reused cache does not reproduce the full computation")
