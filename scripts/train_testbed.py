#!/usr/bin/env python3
"""Trains the testbed models (kvbridge.experiments.testbed) on the training split of the fortunes.

Deterministic: fixed seeds, torch.use_deterministic_algorithms(True) and a fixed thread count
(--threads, default 1; float reductions depend on it, so the same command with the same thread
count, torch and transformers versions gives the same weights). Writes each model with
save_pretrained (safetensors, float16) into python/kvbridge/experiments/testbed/models/<name>/ and
the record of the run into python/kvbridge/experiments/testbed/models/TRAINING.json.

testbed-c has a tokenizer of its own: a byte-level BPE of --bpe-merges merges, trained here
with the ``tokenizers`` package on the same training split (deterministic: the trainer breaks
ties by pair order) and written as testbed-c/tokenizer.json before the model is trained.

    python scripts/train_testbed.py                    # the shipped models
    python scripts/train_testbed.py --only testbed-c   # testbed-c only; a and b are kept
    python scripts/train_testbed.py --steps 40 --out /tmp/tb   # a quick smoke run

Each window starts at a fortune's BOS and runs on through the following fortunes
(BOS text EOS BOS text EOS ...), so position 0 is always BOS, as in a prompt.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import shlex
import sys
import time

import torch

from kvbridge.experiments import testbed

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "python" / "kvbridge" / "experiments" / "testbed" / "models"


def configs(tokenizers):
    """The HF config of each model; `tokenizers` maps each model's name to its tokenizer."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    def common(name):
        tok = tokenizers[name]
        return dict(vocab_size=tok.vocab_size, max_position_embeddings=2 * testbed.MAX_CONTEXT,
                    bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id,
                    tie_word_embeddings=False, attention_dropout=0.0, use_cache=True)

    a = LlamaConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=4, head_dim=32,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                    rms_norm_eps=1e-5, **common("testbed-a"))
    b = Qwen2Config(hidden_size=192, intermediate_size=512, num_hidden_layers=6,
                    num_attention_heads=6, num_key_value_heads=2,
                    rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
                    rms_norm_eps=1e-6, use_sliding_window=False, **common("testbed-b"))
    c = Qwen3Config(hidden_size=160, intermediate_size=448, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=40,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                    rms_norm_eps=1e-6, use_sliding_window=False, **common("testbed-c"))
    return {"testbed-a": a, "testbed-b": b, "testbed-c": c}


def train_bpe(texts, merges: int, folder: pathlib.Path) -> dict:
    """Trains testbed-c's byte-level BPE on `texts` and writes folder/tokenizer.json (and a
    tokenizer_config.json naming its special tokens, so transformers' AutoTokenizer loads the
    folder). Returns what TRAINING.json records of it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = list(testbed.BPE_SPECIAL_TOKENS)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=len(specials) + 256 + merges, min_frequency=2,
                                  special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    bos = specials[0]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tok.token_to_id(bos))])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"), pretty=True)
    bos_token, eos_token, pad_token = specials
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos_token,
        "eos_token": eos_token, "pad_token": pad_token,
        "model_max_length": testbed.MAX_CONTEXT}, indent=2) + "\n")
    loaded = testbed.BPETokenizer(folder / "tokenizer.json")
    return {"type": "byte-level BPE (tokenizers " + __import__("tokenizers").__version__ + ")",
            "merges_requested": merges,
            "merges": len(json.loads((folder / "tokenizer.json").read_text())["model"]["merges"]),
            "vocab_size": loaded.vocab_size, "id": loaded.id}


def build_stream(texts, tok):
    ids, starts = [], []
    for t in texts:
        starts.append(len(ids))
        ids.extend(tok.encode(t, add_bos=True, add_eos=True))
    return torch.tensor(ids, dtype=torch.long), torch.tensor(starts, dtype=torch.long)


def lr_at(step, steps, peak, warmup):
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_one(name, config, stream, starts, args, seed):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    window = testbed.MAX_CONTEXT
    usable = starts[starts + window + 1 <= len(stream)]
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(window + 1)
    warmup = max(1, int(0.05 * args.steps))
    losses = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, warmup)
        pick = usable[torch.randint(len(usable), (args.batch,), generator=gen)]
        chunk = stream[pick[:, None] + offsets[None, :]]
        x, y = chunk[:, :-1], chunk[:, 1:]
        logits = model(x, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"{name} step {step:5d} loss {loss.item():.4f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    elapsed = time.perf_counter() - t0
    tail = losses[-max(1, min(50, len(losses) // 10)):]
    return model, {"steps": args.steps, "batch": args.batch, "window_tokens": window,
                   "tokens_seen": args.steps * args.batch * window, "peak_lr": args.lr,
                   "warmup_steps": warmup, "weight_decay": args.weight_decay, "seed": seed,
                   "train_seconds": round(elapsed, 1),
                   "train_loss_last_steps": round(sum(tail) / len(tail), 4),
                   "train_loss_last_steps_count": len(tail),
                   "parameters": sum(p.numel() for p in model.parameters())}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps per model")
    parser.add_argument("--steps-b", type=int, default=None, help="steps for testbed-b "
                        "(default: --steps)")
    parser.add_argument("--steps-c", type=int, default=None, help="steps for testbed-c "
                        "(default: --steps)")
    parser.add_argument("--bpe-merges", type=int, default=1536,
                        help="merges of testbed-c's byte-level BPE")
    parser.add_argument("--batch", type=int, default=16, help="windows per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--only", choices=testbed.MODEL_NAMES, default=None,
                        help="train one model; the others' records in TRAINING.json are kept")
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    tok = testbed.load_tokenizer()  # the byte tokenizer of testbed-a and testbed-b
    train_texts, heldout_texts = testbed.texts("train"), testbed.texts("heldout")
    stream, starts = build_stream(train_texts, tok)
    print(f"{len(train_texts)} training fortunes ({len(stream)} bytes), "
          f"{len(heldout_texts)} held out", flush=True)

    record_path = args.out / "TRAINING.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    command = "python " + " ".join(shlex.quote(a) for a in
                                   ["scripts/train_testbed.py", *(argv or sys.argv[1:])])
    if not args.only:
        record["command"] = command
    record.update({
        "commands": "each model's entry names the command that trained it",
        "threads": args.threads, "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "python": platform.python_version(), "machine": platform.machine(),
        "tokenizer": tok.id, "max_context": testbed.MAX_CONTEXT,
        "corpus": {"train_fortunes": len(train_texts), "train_tokens": len(stream),
                   "heldout_fortunes": len(heldout_texts),
                   "split": f"every {testbed.HELDOUT_EVERY}th fortune held out"},
        "loss_definition": ("nats/token: token-weighted mean next-token cross-entropy over "
                            "fortunes encoded as BOS text EOS, truncated to max_context tokens "
                            "(testbed.sequence_loss), with the saved float16 weights loaded "
                            "as float32; *_per_byte: the same total over the UTF-8 bytes the "
                            "predicted tokens stand for, an EOS counting as one byte (equal to "
                            "the per-token loss for the byte tokenizer)"),
    })
    record.setdefault("models", {})
    args.out.mkdir(parents=True, exist_ok=True)
    train_eval = train_texts[::50]  # a fixed sample of the training split, for comparison
    names = [n for n in testbed.MODEL_NAMES if not args.only or n == args.only]
    tokenizers = {n: tok for n in testbed.MODEL_NAMES}
    bpe_info = None
    if testbed.BPE_MODEL_NAME in names:
        bpe_info = train_bpe(train_texts, args.bpe_merges, args.out / testbed.BPE_MODEL_NAME)
        tokenizers[testbed.BPE_MODEL_NAME] = testbed.BPETokenizer(
            args.out / testbed.BPE_MODEL_NAME / "tokenizer.json")
        print(f"{testbed.BPE_MODEL_NAME} tokenizer: {json.dumps(bpe_info)}", flush=True)
    all_configs = configs(tokenizers)
    for i, name in enumerate(testbed.MODEL_NAMES):
        if name not in names:
            continue
        run_args = argparse.Namespace(**vars(args))
        if name == testbed.TARGET_NAME and args.steps_b is not None:
            run_args.steps = args.steps_b
        if name == testbed.BPE_MODEL_NAME and args.steps_c is not None:
            run_args.steps = args.steps_c
        own_stream, own_starts = stream, starts
        if tokenizers[name] is not tok:
            own_stream, own_starts = build_stream(train_texts, tokenizers[name])
        model, info = train_one(name, all_configs[name], own_stream, own_starts, run_args,
                                args.seed + i)
        model.to(torch.float16).save_pretrained(args.out / name, safe_serialization=True)
        for f in (args.out / name).iterdir():
            f.chmod(0o644)  # save_pretrained may create private files; these ship in the wheel
        del model
        tm = testbed.load_model(name, args.out)
        info["heldout_loss"] = round(testbed.sequence_loss(tm, heldout_texts), 4)
        if bpe_info and name == testbed.BPE_MODEL_NAME:
            info["heldout_loss_per_byte"] = round(
                testbed.sequence_loss(tm, heldout_texts, per="byte"), 4)
            info["train_tokens"] = len(own_stream)
            info["tokenizer"] = bpe_info
        info["train_eval_loss"] = round(testbed.sequence_loss(tm, train_eval), 4)
        info["train_eval_fortunes"] = len(train_eval)
        first = heldout_texts[:testbed.CHECK_FORTUNES]
        info["heldout_loss_check"] = round(testbed.sequence_loss(tm, first), 6)
        info["heldout_loss_check_fortunes"] = len(first)
        info["weights_bytes"] = (args.out / name / "model.safetensors").stat().st_size
        info["version"] = tm.spec.version
        info["class"] = type(tm.model).__name__
        info["command"] = command
        print(f"{name}: {json.dumps(info)}", flush=True)
        record["models"][name] = info
        record_path.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
