"""Two small causal LMs trained on the Debian ``fortunes`` text, for testing and measuring kvbridge.

The models are transformers' own classes, shipped inside the package (no download):

- ``testbed-a``: ``LlamaForCausalLM``, 4 layers, hidden 128, 4 query / 4 KV heads of 32, RoPE
  base 1e4 (the source model of the cross-model experiments);
- ``testbed-b``: ``Qwen2ForCausalLM``, 6 layers, hidden 192, 6 query / 2 KV heads of 32 (grouped
  KV), RoPE base 5e4 (the target model).

Both share one byte-level tokenizer (256 byte ids, then BOS, EOS, PAD) and were trained on
windows of ``MAX_CONTEXT`` tokens by ``scripts/train_testbed.py``; ``models/TRAINING.json``
records the command, steps, time and losses. Weights are stored as float16 and load as float32.

API::

    from kvbridge import testbed
    pair = testbed.load_pair()          # TestbedPair(tokenizer, source, target), eval(), float32
    ids = pair.tokenizer.encode("text") # [BOS, bytes...]; .decode(ids) -> str
    tm = pair.source                    # TestbedModel: .name, .model (HF), .spec, .path
    logits, kv = testbed.prefill(tm, torch.tensor([ids]))  # kv: legacy tuple per layer
    testbed.load_model("testbed-b")     # one TestbedModel
    testbed.model_spec(hf_model, name)  # kvbridge.ModelSpec from an HF model's config
    testbed.texts("train") / testbed.texts("heldout")   # the fixed split of the fortunes
    testbed.MAX_CONTEXT, testbed.MODELS_DIR

Caches: transformers 5.24 models take and return ``transformers.DynamicCache`` objects
(``model(ids, cache=..., use_cache=True)``; ``past_key_values=`` is a deprecated alias);
``kvbridge.hf.to_legacy`` / ``to_dynamic_cache`` convert between that and the legacy tuple.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch

from kvbridge import _core, specs
from kvbridge._tensors import cache_layers
from kvbridge._core import InvalidArgumentError

MODELS_DIR = pathlib.Path(__file__).resolve().parent / "models"
TOKENIZER_DIR = MODELS_DIR / "tokenizer"
MODEL_NAMES = ("testbed-a", "testbed-b")
SOURCE_NAME, TARGET_NAME = MODEL_NAMES

#: The longest sequence (prompt plus generated tokens) the models were trained on.
MAX_CONTEXT = 256

#: Where the corpus comes from (Debian package ``fortunes``).
FORTUNES_DIR = pathlib.Path("/usr/share/games/fortunes")
#: Fortune files left out of the corpus (pictures, not text).
EXCLUDED_FILES = ("ascii-art",)
#: Every HELDOUT_EVERY-th fortune (index % HELDOUT_EVERY == HELDOUT_EVERY - 1) is held out.
HELDOUT_EVERY = 20
#: TRAINING.json also records the loss on the first CHECK_FORTUNES held-out fortunes, which
#: the tests recompute from the shipped weights.
CHECK_FORTUNES = 40

LegacyKV = Tuple[Tuple[torch.Tensor, torch.Tensor], ...]


class ByteTokenizer:
    """Byte-level tokenizer: ids 0-255 are the UTF-8 bytes, then BOS, EOS and PAD.

    Its definition lives in models/tokenizer/tokenizer.json; ``id`` is a hash of that file (the
    ModelSpec tokenizer id shared by both models; kvbridge.specs.tokenizer_id of its folder).
    """

    def __init__(self, path: Union[str, "os.PathLike[str]"] = TOKENIZER_DIR / "tokenizer.json"):
        path = pathlib.Path(path)
        raw = path.read_bytes()
        cfg = json.loads(raw)
        if cfg.get("type") != "bytes" or cfg.get("num_bytes") != 256:
            raise InvalidArgumentError(f"{path}: not a byte-level tokenizer definition")
        self.bos_id = int(cfg["bos_id"])
        self.eos_id = int(cfg["eos_id"])
        self.pad_id = int(cfg["pad_id"])
        self.vocab_size = int(cfg["vocab_size"])
        self.id = specs.byte_tokenizer_id(raw)
        self.path = path

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> List[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids: Sequence[int]) -> str:
        """Text of the byte ids; special ids are dropped, invalid UTF-8 becomes U+FFFD."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size}, id={self.id!r})"


@functools.lru_cache(maxsize=None)
def load_tokenizer() -> ByteTokenizer:
    return ByteTokenizer()


@dataclass(frozen=True)
class TestbedModel:
    """One testbed model: name, the HF model (eval mode, float32), its ModelSpec, its folder."""

    __test__ = False  # not a pytest test class

    name: str
    model: Any
    spec: _core.ModelSpec
    path: pathlib.Path


@dataclass(frozen=True)
class TestbedPair:
    tokenizer: ByteTokenizer
    source: TestbedModel
    target: TestbedModel


def model_spec(hf_model: Any, name: str, version: Optional[str] = None,
               tokenizer: Optional[str] = None) -> _core.ModelSpec:
    """The kvbridge.ModelSpec of an HF causal LM (Llama/Qwen2-style config), by the rules of
    kvbridge.specs that kvbridge.vllm applies too (so a testbed model gets the same spec in
    both).

    version: defaults to kvbridge.specs.weights_version of ``hf_model.name_or_path`` when it
        holds weight files, else to a hash of the weights in memory.
    tokenizer: defaults to the testbed tokenizer's id.
    The KV dtype is the dtype of the model's parameters.
    """
    if version is None:
        version = specs.weights_version(str(getattr(hf_model, "name_or_path", "") or ""))
    if version is None:
        h = hashlib.sha256()
        for key, t in sorted(hf_model.state_dict().items()):
            h.update(key.encode())
            data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            h.update(data.numpy().tobytes())
        version = h.hexdigest()[:32]
    if tokenizer is None:
        tokenizer = load_tokenizer().id
    dtype = str(next(hf_model.parameters()).dtype).replace("torch.", "")
    return specs.spec_from_config(hf_model.config, name, dtype=dtype, version=version,
                                  tokenizer=tokenizer)


def load_model(name: str, models_dir: Union[str, "os.PathLike[str]", None] = None) -> TestbedModel:
    """Loads one shipped model offline (local files only), in eval mode, as float32."""
    if name not in MODEL_NAMES:
        raise InvalidArgumentError(f"load_model: expected one of {MODEL_NAMES}, got {name!r}")
    from transformers import AutoModelForCausalLM

    path = pathlib.Path(models_dir or MODELS_DIR) / name
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"load_model: no weights at {path} (run scripts/train_testbed.py)")
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    model.eval()
    return TestbedModel(name, model, model_spec(model, name), path)


def load_pair(models_dir: Union[str, "os.PathLike[str]", None] = None) -> TestbedPair:
    """The tokenizer, the source model (testbed-a) and the target model (testbed-b)."""
    return TestbedPair(load_tokenizer(), load_model(SOURCE_NAME, models_dir),
                       load_model(TARGET_NAME, models_dir))


@torch.no_grad()
def prefill(model: Union[TestbedModel, Any],
            input_ids: torch.Tensor) -> Tuple[torch.Tensor, LegacyKV]:
    """One forward with use_cache=True: (logits [B, T, vocab], legacy KV tuple, one
    ([B, kv_heads, T, head_dim] key, value) pair per layer)."""
    hf_model = model.model if isinstance(model, TestbedModel) else model
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise InvalidArgumentError("prefill: input_ids must be a [batch, tokens] LongTensor")
    out = hf_model(input_ids, use_cache=True)
    return out.logits, tuple(cache_layers(out.cache))


@torch.no_grad()
def sequence_loss(model: Union[TestbedModel, Any], texts_: Sequence[str],
                  tokenizer: Optional[ByteTokenizer] = None, batch_size: int = 32) -> float:
    """Mean next-token loss in nats/token (token-weighted) over `texts_`, each encoded as
    BOS text EOS and truncated to MAX_CONTEXT tokens; the measure TRAINING.json records.

    Texts are batched by length and right-padded; causal attention keeps padding from reaching
    any real position, and padded positions are left out of the loss.
    """
    hf_model = model.model if isinstance(model, TestbedModel) else model
    tok = tokenizer or load_tokenizer()
    seqs = [ids for ids in (tok.encode(t, add_eos=True)[:MAX_CONTEXT] for t in texts_)
            if len(ids) >= 2]
    if not seqs:
        raise InvalidArgumentError("sequence_loss: no text with at least two tokens")
    seqs.sort(key=len)
    total, count = 0.0, 0
    for start in range(0, len(seqs), batch_size):
        group = seqs[start:start + batch_size]
        width = len(group[-1])
        x = torch.full((len(group), width), tok.pad_id, dtype=torch.long)
        for row, ids in enumerate(group):
            x[row, :len(ids)] = torch.tensor(ids)
        logits = hf_model(x, use_cache=False).logits[:, :-1].double()
        targets = x[:, 1:].clone()
        targets[targets == tok.pad_id] = -100
        total += float(torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100,
            reduction="sum"))
        count += int((targets != -100).sum())
    return total / count


def _fortune_files() -> List[pathlib.Path]:
    files = []
    for p in sorted(FORTUNES_DIR.iterdir()):
        if p.suffix or p.is_symlink() or not p.is_file() or p.name in EXCLUDED_FILES:
            continue
        files.append(p)
    if not files:
        raise FileNotFoundError(f"no fortune files in {FORTUNES_DIR} (apt-get install fortunes)")
    return files


@functools.lru_cache(maxsize=None)
def _all_fortunes() -> Tuple[str, ...]:
    out = []
    for path in _fortune_files():
        text = path.read_bytes().decode("utf-8", errors="replace")
        for block in text.split("\n%\n"):
            block = block.strip("%\n")
            block = "\n".join(line.rstrip() for line in block.split("\n")).strip("\n")
            if block:
                out.append(block)
    return tuple(out)


def texts(split: str) -> List[str]:
    """The fortunes of a split, in a fixed order (files sorted by name, fortunes in file order).

    "heldout": every HELDOUT_EVERY-th fortune; "train": all the others.
    """
    every = HELDOUT_EVERY
    all_texts = _all_fortunes()
    if split == "train":
        return [t for i, t in enumerate(all_texts) if i % every != every - 1]
    if split == "heldout":
        return [t for i, t in enumerate(all_texts) if i % every == every - 1]
    raise InvalidArgumentError(f"texts: expected 'train' or 'heldout', got {split!r}")


__all__ = [
    "ByteTokenizer",
    "CHECK_FORTUNES",
    "EXCLUDED_FILES",
    "FORTUNES_DIR",
    "HELDOUT_EVERY",
    "MAX_CONTEXT",
    "MODELS_DIR",
    "MODEL_NAMES",
    "SOURCE_NAME",
    "TARGET_NAME",
    "TestbedModel",
    "TestbedPair",
    "load_model",
    "load_pair",
    "load_tokenizer",
    "model_spec",
    "prefill",
    "sequence_loss",
    "texts",
]
