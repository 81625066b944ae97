"""Three small causal LMs trained on the Debian ``fortunes`` text, for testing and measuring
kvbridge.

The models are transformers' own classes, shipped inside the package (no download):

- ``testbed-a``: ``LlamaForCausalLM``, 4 layers, hidden 128, 4 query / 4 KV heads of 32, RoPE
  base 1e4 (the source model of the cross-model experiments);
- ``testbed-b``: ``Qwen2ForCausalLM``, 6 layers, hidden 192, 6 query / 2 KV heads of 32 (grouped
  KV), RoPE base 5e4 (the target model);
- ``testbed-c``: ``Qwen3ForCausalLM`` (RMS-normed queries and keys), 4 layers, hidden 160,
  4 query / 2 KV heads of 40, RoPE base 1e6, with a tokenizer of its own (the cross-tokenizer
  target or source).

testbed-a and testbed-b share one byte-level tokenizer (``ByteTokenizer``: 256 byte ids, then
BOS, EOS, PAD); testbed-c has a byte-level BPE trained on the same training split
(``BPETokenizer``; ``models/testbed-c/tokenizer.json`` is a plain ``tokenizers`` file). All
were trained on windows of ``MAX_CONTEXT`` tokens of their own tokenizer by
``scripts/train_testbed.py``; ``models/TRAINING.json`` records the commands, steps, time and
losses. Weights are stored as float16 and load as float32.

API::

    from kvbridge.experiments import testbed
    pair = testbed.load_pair()          # TestbedPair(tokenizer, source, target), eval(), float32
    ids = pair.tokenizer.encode("text") # [BOS, bytes...]; .decode(ids) -> str
    tm = pair.source                    # TestbedModel: .name, .model (HF), .spec, .path, .tokenizer
    logits, kv = testbed.prefill(tm, torch.tensor([ids]))  # kv: legacy tuple per layer
    testbed.load_model("testbed-b")     # one TestbedModel
    testbed.load_pair("testbed-a", "testbed-c")  # tokenizer None: each model's own applies
    tok = testbed.load_tokenizer("testbed-c")    # BPETokenizer (ByteTokenizer for a and b)
    ids, offsets, roles = tok.encode_with_offsets("text")  # UTF-8 byte ranges; "bos"/"eos"/None
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
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from kvbridge import _core, specs
from kvbridge._tensors import cache_layers, output_cache
from kvbridge._core import InvalidArgumentError

MODELS_DIR = pathlib.Path(__file__).resolve().parent / "models"
#: The byte-level tokenizer's folder (testbed-a and testbed-b).
TOKENIZER_DIR = MODELS_DIR / "tokenizer"
MODEL_NAMES = ("testbed-a", "testbed-b", "testbed-c")
#: The default pair of load_pair: same tokenizer, different model classes and shapes.
SOURCE_NAME, TARGET_NAME = "testbed-a", "testbed-b"
#: The model whose tokenizer is a BPE (its tokenizer.json lies in its own folder).
BPE_MODEL_NAME = "testbed-c"

#: The longest sequence (prompt plus generated tokens) the models were trained on.
MAX_CONTEXT = 256

#: The Bridge options used with the shipped adapter (the demo, `kvbridge eval`'s default lever
#: row): the smallest measured tail recompute that keeps >= 0.995 of the prefix benefit with
#: >= 0.99 greedy agreement on held-out text (benchmarks/recorded/120-quality-levers.md). The
#: target computes the prompt's last recompute_tail + 1 tokens itself; exact first layers and
#: end-to-end refinement did not pay on this pair. The shipped adapter records the same tail as
#: its serving defaults (LinearAdapter.serving), so a plain Bridge() serves it so too; these
#: options stay for code that passes them explicitly.
BRIDGE_OPTIONS = {"recompute_tail": 96}
#: The agreement `kvbridge eval --save-adapter` records the least measured tail for (the
#: criterion BRIDGE_OPTIONS was chosen by).
SERVING_AGREEMENT_GOAL = 0.99

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
#: Per token, the half-open (start, end) range of UTF-8 bytes of the text it stands for.
Offsets = List[Tuple[int, int]]
#: Per token, "bos" / "eos" for those special tokens, None for ordinary tokens.
Roles = List[Optional[str]]


def _add_specials(ids: List[int], offsets: Offsets, text_bytes: int, bos_id: int, eos_id: int,
                  add_bos: bool, add_eos: bool) -> Tuple[List[int], Offsets, Roles]:
    """(ids, offsets, roles) with BOS before and EOS after the text's tokens: special tokens
    get an empty byte range at their position (0 for BOS, the text's length for EOS)."""
    roles: Roles = [None] * len(ids)
    if add_bos:
        ids, offsets, roles = [bos_id] + ids, [(0, 0)] + offsets, ["bos"] + roles
    if add_eos:
        ids = ids + [eos_id]
        offsets = offsets + [(text_bytes, text_bytes)]
        roles = roles + ["eos"]
    return ids, offsets, roles


class ByteTokenizer:
    """Byte-level tokenizer: ids 0-255 are the UTF-8 bytes, then BOS, EOS and PAD.

    Its definition lives in models/tokenizer/tokenizer.json; ``id`` (also ``tokenizer_id``) is
    a hash of that file (the ModelSpec tokenizer id shared by testbed-a and testbed-b;
    kvbridge.specs.tokenizer_id of its folder).
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

    @property
    def tokenizer_id(self) -> str:
        """The ModelSpec tokenizer id (the same as ``id``)."""
        return self.id

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> List[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def encode_with_offsets(self, text: str, add_bos: bool = True,
                            add_eos: bool = False) -> Tuple[List[int], Offsets, Roles]:
        """(ids, offsets, roles) of ``encode(text, add_bos, add_eos)``: byte i of the text has
        the range (i, i + 1); BOS is (0, 0) with role "bos", EOS (n, n) with role "eos"."""
        ids = list(text.encode("utf-8"))
        return _add_specials(ids, [(i, i + 1) for i in range(len(ids))], len(ids), self.bos_id,
                             self.eos_id, add_bos, add_eos)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of the byte ids; special ids are dropped, invalid UTF-8 becomes U+FFFD."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size}, id={self.id!r})"


#: The special tokens of testbed-c's BPE, in id order (ids 0, 1, 2), as roles name them.
BPE_SPECIAL_TOKENS = ("<bos>", "<eos>", "<pad>")


def byte_level_chars() -> Dict[int, str]:
    """The byte-level BPE alphabet: byte value -> the printable character that stands for it
    in token strings (printable Latin-1 bytes stand for themselves, the others for U+0100 on,
    in byte order), the convention of ``tokenizers.pre_tokenizers.ByteLevel``."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    kept = set(keep)
    out = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in kept:
            out[b] = chr(256 + extra)
            extra += 1
    return out


class BPETokenizer:
    """testbed-c's tokenizer: a byte-level BPE (``tokenizers``), with the methods of
    ByteTokenizer.

    The definition is ``models/testbed-c/tokenizer.json``, a plain ``tokenizers.Tokenizer``
    file (``tokenizers.Tokenizer.from_file`` loads it; its post-processor puts ``<bos>`` first,
    as ``encode`` does by default). ``backend`` is that Tokenizer; here it encodes special-token
    text such as "<eos>" inside a text as ordinary bytes (``encode_special_tokens``), as the
    byte tokenizer does. ``id`` (also ``tokenizer_id``) is kvbridge.specs.tokenizer_id of the
    folder, the rule kvbridge.vllm applies too.
    """

    def __init__(self, path: Union[str, "os.PathLike[str]", None] = None):
        from tokenizers import Tokenizer

        path = pathlib.Path(path or MODELS_DIR / BPE_MODEL_NAME / "tokenizer.json")
        if not path.is_file():
            raise FileNotFoundError(f"BPETokenizer: no {path} (run scripts/train_testbed.py "
                                    "--only testbed-c)")
        self.backend = Tokenizer.from_file(str(path))
        self.backend.encode_special_tokens = True
        special = {}
        for name in BPE_SPECIAL_TOKENS:
            i = self.backend.token_to_id(name)
            if i is None:
                raise InvalidArgumentError(f"{path}: no {name} token")
            special[name] = i
        self.bos_id, self.eos_id, self.pad_id = (special[n] for n in BPE_SPECIAL_TOKENS)
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)
        byte_of = {c: b for b, c in byte_level_chars().items()}
        self._bytes: List[bytes] = []
        for i in range(self.vocab_size):
            token = self.backend.id_to_token(i)
            if i in special.values():
                self._bytes.append(b"")
            elif token is None or any(c not in byte_of for c in token):
                raise InvalidArgumentError(f"{path}: token {i} ({token!r}) is not byte-level")
            else:
                self._bytes.append(bytes(byte_of[c] for c in token))
        self.id = specs.tokenizer_id(path.parent)
        self.path = path

    @property
    def tokenizer_id(self) -> str:
        """The ModelSpec tokenizer id (the same as ``id``)."""
        return self.id

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes an ordinary token stands for (b"" for a special token)."""
        return self._bytes[int(token_id)]

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> List[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def encode_with_offsets(self, text: str, add_bos: bool = True,
                            add_eos: bool = False) -> Tuple[List[int], Offsets, Roles]:
        """(ids, offsets, roles) of ``encode(text, add_bos, add_eos)``; offsets are exact UTF-8
        byte ranges (a token may end inside a multi-byte character; the next starts there).
        Raises ValueError if the tokens' bytes do not spell the text (they always do for this
        normaliser-free byte-level BPE; the check guards a changed tokenizer.json)."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        raw = text.encode("utf-8")
        offsets: Offsets = []
        pos = 0
        for i in ids:
            piece = self._bytes[i]
            if not piece or raw[pos:pos + len(piece)] != piece:
                raise InvalidArgumentError(f"encode_with_offsets: token {i} does not spell the text at "
                                 f"byte {pos}")
            offsets.append((pos, pos + len(piece)))
            pos += len(piece)
        if pos != len(raw):
            raise InvalidArgumentError(f"encode_with_offsets: tokens cover {pos} of {len(raw)} bytes")
        return _add_specials(ids, offsets, len(raw), self.bos_id, self.eos_id, add_bos, add_eos)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of the ids; special ids are dropped, invalid UTF-8 becomes U+FFFD."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        raw = b"".join(self._bytes[int(i)] for i in ids if 0 <= int(i) < self.vocab_size)
        return raw.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size}, id={self.id!r})"


Tokenizer = Union[ByteTokenizer, BPETokenizer]


def tokenizer_folder(name: str) -> pathlib.Path:
    """The folder holding a shipped model's tokenizer files (what kvbridge.specs.tokenizer_id
    and a vLLM engine's ``tokenizer`` argument take): models/tokenizer for testbed-a and
    testbed-b, the model's own folder for testbed-c."""
    if name not in MODEL_NAMES:
        raise InvalidArgumentError(f"tokenizer_folder: expected one of {MODEL_NAMES}, got {name!r}")
    return MODELS_DIR / name if name == BPE_MODEL_NAME else TOKENIZER_DIR


@functools.lru_cache(maxsize=None)
def _shared_tokenizer(bpe: bool) -> Tokenizer:
    if bpe:
        return BPETokenizer(tokenizer_folder(BPE_MODEL_NAME) / "tokenizer.json")
    return ByteTokenizer()


def load_tokenizer(name: str = SOURCE_NAME) -> Tokenizer:
    """The tokenizer of a testbed model: ByteTokenizer for testbed-a and testbed-b (one shared
    instance), BPETokenizer for testbed-c."""
    if name not in MODEL_NAMES:
        raise InvalidArgumentError(f"load_tokenizer: expected one of {MODEL_NAMES}, got {name!r}")
    return _shared_tokenizer(name == BPE_MODEL_NAME)


@dataclass(frozen=True)
class TestbedModel:
    """One testbed model: name, the HF model (eval mode, float32), its ModelSpec, its folder,
    its tokenizer."""

    __test__ = False  # not a pytest test class

    name: str
    model: Any
    spec: _core.ModelSpec
    path: pathlib.Path
    tokenizer: Tokenizer


@dataclass(frozen=True)
class TestbedPair:
    """A source and a target model. ``tokenizer`` is their shared tokenizer, or None when they
    tokenize differently (then each model's own ``.tokenizer`` applies)."""

    tokenizer: Optional[Tokenizer]
    source: TestbedModel
    target: TestbedModel


def model_spec(hf_model: Any, name: str, version: Optional[str] = None,
               tokenizer: Optional[str] = None) -> _core.ModelSpec:
    """The kvbridge.ModelSpec of an HF causal LM (Llama/Qwen2/Qwen3-style config), by the rules of
    kvbridge.specs that kvbridge.vllm applies too (so a testbed model gets the same spec in
    both).

    version: defaults to kvbridge.specs.weights_version of ``hf_model.name_or_path`` when it
        holds weight files, else to a hash of the weights in memory.
    tokenizer: defaults to the id of load_tokenizer(name) for a testbed model's name, else of
        the byte tokenizer.
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
        tokenizer = load_tokenizer(name if name in MODEL_NAMES else SOURCE_NAME).id
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
    if name == BPE_MODEL_NAME and path != MODELS_DIR / name:
        tok: Tokenizer = BPETokenizer(path / "tokenizer.json")  # the one beside those weights
    else:
        tok = load_tokenizer(name)
    return TestbedModel(name, model, model_spec(model, name, tokenizer=tok.id), path, tok)


def load_pair(source: str = SOURCE_NAME, target: str = TARGET_NAME,
              models_dir: Union[str, "os.PathLike[str]", None] = None) -> TestbedPair:
    """The source and target models (by default testbed-a and testbed-b) and their shared
    tokenizer (None when their tokenizers differ, as for testbed-a and testbed-c)."""
    if source == target:
        raise InvalidArgumentError(f"load_pair: source and target are both {source!r}")
    src, tgt = load_model(source, models_dir), load_model(target, models_dir)
    shared = src.tokenizer if src.tokenizer.id == tgt.tokenizer.id else None
    return TestbedPair(shared, src, tgt)


@torch.no_grad()
def prefill(model: Union[TestbedModel, Any],
            input_ids: torch.Tensor) -> Tuple[torch.Tensor, LegacyKV]:
    """One forward with use_cache=True: (logits [B, T, vocab], legacy KV tuple, one
    ([B, kv_heads, T, head_dim] key, value) pair per layer)."""
    hf_model = model.model if isinstance(model, TestbedModel) else model
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise InvalidArgumentError("prefill: input_ids must be a [batch, tokens] LongTensor")
    out = hf_model(input_ids, use_cache=True)
    return out.logits, tuple(cache_layers(output_cache(out)))


@torch.no_grad()
def sequence_loss(model: Union[TestbedModel, Any], texts_: Sequence[str],
                  tokenizer: Optional[Tokenizer] = None, batch_size: int = 32,
                  per: str = "token") -> float:
    """Mean next-token loss over `texts_`, each encoded as BOS text EOS and truncated to
    MAX_CONTEXT tokens; the measure TRAINING.json records.

    per: "token": nats/token (token-weighted); "byte": the same total divided by the UTF-8
        bytes the predicted tokens stand for, an EOS counting as one (so models with different
        tokenizers compare; for the byte tokenizer both are the same number).
    tokenizer: defaults to the model's own (a TestbedModel's), else the byte tokenizer.
    Texts are batched by length and right-padded; causal attention keeps padding from reaching
    any real position, and padded positions are left out of the loss.
    """
    if per not in ("token", "byte"):
        raise InvalidArgumentError(f"sequence_loss: per must be 'token' or 'byte', got {per!r}")
    hf_model = model.model if isinstance(model, TestbedModel) else model
    tok = tokenizer or (model.tokenizer if isinstance(model, TestbedModel) else load_tokenizer())
    seqs, units = [], 0
    for t in texts_:
        ids, offsets, roles = tok.encode_with_offsets(t, add_eos=True)
        if len(ids[:MAX_CONTEXT]) < 2:
            continue
        seqs.append(ids[:MAX_CONTEXT])
        units += sum(1 if role == "eos" else e - s
                     for (s, e), role in zip(offsets[1:MAX_CONTEXT], roles[1:MAX_CONTEXT]))
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
    return total / (count if per == "token" else units)


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
    "BRIDGE_OPTIONS",
    "BPETokenizer",
    "BPE_MODEL_NAME",
    "BPE_SPECIAL_TOKENS",
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
    "Tokenizer",
    "byte_level_chars",
    "load_model",
    "load_pair",
    "load_tokenizer",
    "model_spec",
    "prefill",
    "sequence_loss",
    "texts",
    "tokenizer_folder",
]
