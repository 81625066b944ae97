"""The real pretrained models for the vLLM tests: their Hugging Face folders, when this machine
has them, and why not otherwise (the reason a test is skipped with)."""
import json
import pathlib
from typing import Optional, Tuple

from kvbridge import models

SMOLLM2, GEMMA3 = "smollm2-135m", "gemma3-270m"


def _vllm_loadable(folder: pathlib.Path) -> Optional[str]:
    """None when vLLM can load the folder, else why not: folders kvbridge.models converted
    before it named the architecture and stored tied weights under the embedding's name."""
    config = json.loads((folder / "config.json").read_text())
    if not config.get("architectures"):
        return (f"{folder} was converted by an older kvbridge.models (no architectures, tied "
                "weights stored as lm_head.weight only): vLLM cannot load it; delete the folder "
                "and convert it again (kvbridge.models.resolve)")
    return None


def folder(name: str) -> Tuple[Optional[pathlib.Path], str]:
    """(the model's folder, "") when it is converted already (under kvbridge.models.models_dir(),
    KVBRIDGE_MODELS_DIR) or its packages are installed (then converted now, about a minute),
    else (None, the reason to skip)."""
    converted = models.models_dir() / name
    if not (converted / "config.json").is_file() and not models.installed(name):
        return None, (f"{name} is neither converted under {models.models_dir()} nor installed "
                      f"(scripts/bootstrap.sh installs it in .venv; `.venv/bin/python -c \"import "
                      f"kvbridge.models as m; m.resolve('{name}')\"` converts it)")
    path = models.resolve(name)
    why = _vllm_loadable(path)
    return (None, why) if why else (path, "")
