#!/usr/bin/env bash
# The main job: builds and installs kvbridge, then runs the end-to-end demo: testbed-b reuses
# testbed-a's prompt caches through kvbridge.Bridge, and testbed-c, whose tokenizer differs, does
# too (python/kvbridge/demo.py; options: --help).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$ROOT"
install_python_package
"$PY" -m kvbridge.demo "$@"
