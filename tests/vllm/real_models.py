"""The real pretrained models for the vLLM tests: their Hugging Face folders, when this machine
has them, and why not otherwise (the reason a test is skipped with)."""
import pathlib
from typing import Optional, Tuple

from kvbridge import models

SMOLLM2, GEMMA3 = "smollm2-135m", "gemma3-270m"
CONVERT = ".venv/bin/python -c \"import kvbridge.models as m; m.resolve('{}')\""


def folder(name: str) -> Tuple[Optional[pathlib.Path], str]:
    """(the model's folder, "") when it is converted already in the current layout (under
    kvbridge.models.models_dir(), KVBRIDGE_MODELS_DIR) or its packages are installed here (then
    it is converted now, about a minute), else (None, the reason to skip). The vLLM venv does not
    carry the model packages: the main venv converts the folders (scripts/bootstrap.sh installs
    the packages there)."""
    path = models.models_dir() / name
    if (path / "config.json").is_file() and models._current(path):
        return path, ""
    if models.installed(name):
        return models.resolve(name), ""
    if (path / "config.json").is_file():
        return None, (f"{path} was converted by an older kvbridge.models (vLLM cannot load that "
                      f"layout) and its packages are not installed here: convert it again with "
                      f"{CONVERT.format(name)}")
    return None, (f"{name} is neither converted under {models.models_dir()} nor installed here "
                  f"(scripts/bootstrap.sh installs it in .venv; {CONVERT.format(name)} converts it)")
