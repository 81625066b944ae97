#!/usr/bin/env bash
# The main job: builds and installs kvbridge, then runs the end-to-end example.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$ROOT"
install_python_package
"$PY" examples/python/quickstart.py "$@"
