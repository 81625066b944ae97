#!/usr/bin/env python3
"""TTFT at real layer shapes: a target's own prefill vs a Bridge load of a converted cache.

Random-weight transformers models with the published configurations of Llama-3.2-1B (the
source: hidden 2048, 32 heads, 8 KV heads x 64, MLP 8192, RoPE base 5e5 with llama3 scaling
factor 32, vocabulary 128256) and Qwen2.5-1.5B (the target: hidden 1536, 12 heads, 2 KV heads x
128, MLP 8960, RoPE base 1e6, vocabulary 151936), both bfloat16, at full depth by default
(16 and 28 layers: both fit in a few GiB); --source-layers / --target-layers truncate them (the
same layer shapes, fewer layers) for a quicker run. A
random LinearAdapter (weights written straight into an adapter file: it measures time, not
quality) maps the source cache to the target's, each target layer drawing on 2 and then 4
consecutive source layers.

For each prompt length (512, 1024, 2048 tokens, one random prompt, the shorter ones its
prefixes), in one process on the same threads, best of --repeats:
  own prefill:  target(prompt, use_cache=True, logits_to_keep=1) and the argmax of its logits;
  bridge:       Bridge.load(target, prompt) (lookup of the source cache in a KVStore, convert of
                len - 1 tokens, copy into a DynamicCache) + the first decode step
                target(last token, past_key_values=cache, logits_to_keep=1) and its argmax.
The source cache is saved once per prompt beforehand (not timed); the bridge runs without
write-back, so every repetition converts.

Ratio = own prefill / bridge. The FLOP ceiling is the ratio of the two paths' FLOPs for these
(truncated) models: prefill = 2 x target layer params x tokens + causal attention + one LM-head
row; bridge = convert GEMMs (2 x tokens x features x outputs per map) + one decode step (2 x
layer params + attention over the cache + one LM-head row). "of ceiling" = ratio / ceiling.

    OMP_NUM_THREADS=2 nice -n 10 .venv/bin/python benchmarks/python/bench_ttft_real_shapes.py
"""
import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

import kvbridge  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_convert_memory import consecutive_layers, random_adapter  # noqa: E402

LLAMA_3_2_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                    num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=64, rope_theta=500000.0, max_position_embeddings=131072,
                    rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                      high_freq_factor=4.0,
                                      original_max_position_embeddings=8192),
                    rms_norm_eps=1e-5, tie_word_embeddings=True, hidden_act="silu")
QWEN_2_5_1_5B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                     num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                     rope_theta=1000000.0, max_position_embeddings=32768, rms_norm_eps=1e-6,
                     tie_word_embeddings=True, use_sliding_window=False, hidden_act="silu")


def build(config_cls, model_cls, values, layers, seed):
    torch.manual_seed(seed)
    config = config_cls(**{**values, "num_hidden_layers": layers})
    config._attn_implementation = "sdpa"
    model = model_cls(config).to(torch.bfloat16).eval()
    return model, config


def head_dim(config):
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_params(config):
    """Weights of one decoder layer: q, o (hidden x heads*dim), k, v (hidden x kv_heads*dim),
    and the gated MLP (3 x hidden x intermediate)."""
    h, hd = config.hidden_size, head_dim(config)
    return (2 * h * config.num_attention_heads * hd + 2 * h * config.num_key_value_heads * hd +
            3 * h * config.intermediate_size)


def flops_prefill(config, tokens):
    width = config.num_attention_heads * head_dim(config)
    per_layer = 2 * tokens * layer_params(config) + 2 * tokens * tokens * width  # causal
    return config.num_hidden_layers * per_layer + 2 * config.hidden_size * config.vocab_size


def flops_decode(config, cached):
    width = config.num_attention_heads * head_dim(config)
    per_layer = 2 * layer_params(config) + 4 * cached * width
    return config.num_hidden_layers * per_layer + 2 * config.hidden_size * config.vocab_size


def flops_convert(src, tgt, layer_map, tokens):
    sw, tw = src.num_kv_heads * src.head_dim, tgt.num_kv_heads * tgt.head_dim
    return sum(2 * tokens * (len(ls) * 2 * sw) * tw * 2 for ls in layer_map)


def best_of(fn, repeats):
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source-layers", type=int, default=16, help="of 16 (Llama-3.2-1B)")
    ap.add_argument("--target-layers", type=int, default=28, help="of 28 (Qwen2.5-1.5B)")
    ap.add_argument("--prompts", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--per-target", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    threads = int(os.environ["OMP_NUM_THREADS"])
    torch.set_num_threads(threads)

    src_model, src_cfg = build(LlamaConfig, LlamaForCausalLM, LLAMA_3_2_1B, args.source_layers, 1)
    ids = torch.randint(0, min(src_cfg.vocab_size, QWEN_2_5_1_5B["vocab_size"]),
                        (1, max(args.prompts)), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        src_cache = src_model(ids, use_cache=True).past_key_values
    src_kv = tuple((layer.keys.clone(), layer.values.clone()) for layer in src_cache.layers)
    del src_model, src_cache
    tgt_model, tgt_cfg = build(Qwen2Config, Qwen2ForCausalLM, QWEN_2_5_1_5B, args.target_layers, 3)

    scaling = kvbridge.RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)
    src = kvbridge.ModelSpec("llama-3.2-1b-shaped", args.source_layers, 8, 64, dtype="bfloat16",
                             tokenizer="shared", rope_base=500000.0, rope_scaling=scaling)
    tgt = kvbridge.ModelSpec("qwen2.5-1.5b-shaped", args.target_layers, 2, 128,
                             dtype="bfloat16", tokenizer="shared", rope_base=1000000.0)

    print(f"Llama-3.2-1B-shaped source, {args.source_layers} of 16 layers; "
          f"Qwen2.5-1.5B-shaped target, {args.target_layers} of 28 (full-size "
          f"embeddings and LM head), bfloat16, random weights; {threads} threads (torch and "
          f"kvbridge), best of {args.repeats} after a warm-up; torch {torch.__version__}; "
          f"kvbridge's bfloat16 GEMMs: {kvbridge.cpu_convert_kernel('bfloat16')}.\n")
    print("| source layers per target layer | prompt tokens | own prefill ms | bridge load ms "
          "| first decode ms | bridge total ms | ratio | FLOP ceiling | of ceiling |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        own = {}
        for n in args.prompts:
            prompt = ids[:, :n]
            own[n] = best_of(lambda: tgt_model(prompt, use_cache=True,
                                               logits_to_keep=1).logits[:, -1].argmax(-1),
                             args.repeats)
        for k in args.per_target:
            layer_map = consecutive_layers(args.source_layers, args.target_layers, k)
            adapter = random_adapter(src, tgt, layer_map, os.path.join(tmp, f"a{k}.safetensors"))
            for n in args.prompts:
                prompt = ids[:, :n]
                store = kvbridge.KVStore(4 << 30, chunk_tokens=256)
                bridge = kvbridge.Bridge(store, min_quality=float("-inf"), write_back=False)
                bridge.add_adapter(adapter)
                saved = bridge.save(src, prompt[0], tuple((a[:, :, :n], b[:, :, :n])
                                                          for a, b in src_kv))
                assert saved == n, (saved, n)
                parts = {}

                def bridge_path():
                    t0 = time.perf_counter()
                    hit = bridge.load(tgt, prompt[0], as_cache=True)
                    t1 = time.perf_counter()
                    assert hit.converted and hit.tokens == n - 1, (hit.converted, hit.tokens)
                    tgt_model(prompt[:, hit.tokens:], past_key_values=hit.kv, use_cache=True,
                              logits_to_keep=1).logits[:, -1].argmax(-1)
                    parts["load"], parts["decode"] = t1 - t0, time.perf_counter() - t1

                total = float("inf")
                best_parts = {}
                bridge_path()  # warm-up
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    bridge_path()
                    dt = time.perf_counter() - t0
                    if dt < total:
                        total, best_parts = dt, dict(parts)
                ceiling = flops_prefill(tgt_cfg, n) / (flops_convert(src, tgt, layer_map, n - 1) +
                                                       flops_decode(tgt_cfg, n - 1))
                ratio = own[n] / total
                mark = ""
                if n == 2048 and k == 2:
                    mark = " (>= 10x)" if ratio >= 10 else " (**< 10x**)"
                print(f"| {k} | {n} | {own[n] * 1e3:.0f} | {best_parts['load'] * 1e3:.1f} "
                      f"| {best_parts['decode'] * 1e3:.1f} | {total * 1e3:.1f} | {ratio:.1f}x{mark} "
                      f"| {ceiling:.1f}x | {ratio / ceiling:.0%} |", flush=True)
    print("\nratio = own prefill / bridge total (load + first decode step); the target is >= 10x "
          "at 2048 tokens with 2 source layers per target layer.")


if __name__ == "__main__":
    main()
