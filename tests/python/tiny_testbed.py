"""A stand-in with kvbridge.experiments.testbed's API for fast tests: two tiny random Hugging Face
models (Llama and Qwen2 shaped, different widths, head layouts and RoPE bases), a character
tokenizer and seeded synthetic texts. Install it with `install(monkeypatch)`."""
import random
import sys
import types
from dataclasses import dataclass

import torch

import kvbridge
import kvbridge.experiments

MAX_CONTEXT = 48
_ALPHABET = "abcdefghijklmnopqrstuvwxyz .,\n"


class CharTokenizer:
    bos_id = len(_ALPHABET)
    eos_id = len(_ALPHABET) + 1
    vocab_size = len(_ALPHABET) + 2

    def encode(self, text):
        return [self.bos_id] + [_ALPHABET.index(c) for c in text]

    def decode(self, ids):
        return "".join(_ALPHABET[i] for i in ids if i < len(_ALPHABET))


@dataclass
class TinyModel:
    name: str
    model: object
    spec: object
    path: str


@dataclass
class TinyPair:
    tokenizer: object
    source: TinyModel
    target: TinyModel


def load_pair(version="1"):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    vocab = CharTokenizer.vocab_size
    torch.manual_seed(0)
    a = LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
        rope_theta=10000.0)).eval()
    b = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=vocab, hidden_size=48, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=128,
        rope_theta=50000.0)).eval()
    spec_a = kvbridge.ModelSpec("tiny-a", 2, 2, 16, version=f"a{version}", tokenizer="chars",
                                rope_base=10000.0)
    spec_b = kvbridge.ModelSpec("tiny-b", 3, 1, 16, version=f"b{version}", tokenizer="chars",
                                rope_base=50000.0)
    return TinyPair(CharTokenizer(), TinyModel("tiny-a", a, spec_a, ""),
                    TinyModel("tiny-b", b, spec_b, ""))


def texts(split):
    rng = random.Random(0 if split == "train" else 1)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far", "away"]
    out = []
    for _ in range(60):
        out.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) + ".")
    return out


def prefill(model, input_ids):
    from kvbridge.hf import forward

    logits, kv = forward(model, input_ids)
    return logits.unsqueeze(0), kv


def install(monkeypatch):
    """Makes `from kvbridge.experiments import testbed` return this module for the test."""
    module = sys.modules[__name__]
    monkeypatch.setitem(sys.modules, "kvbridge.experiments.testbed", module)
    monkeypatch.setattr(kvbridge.experiments, "testbed", module, raising=False)
    return module
