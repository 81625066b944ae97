#!/usr/bin/env bash
# Runs every test: the C++ suite (GoogleTest through ctest), the installed-package C++ example
# (find_package(kvbridge)), and the Python suite (pytest) against the installed package.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$ROOT"
JOBS="${JOBS:-$(nproc)}"

echo "== C++ build and tests"
cmake -S . -B build/cpp -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVBRIDGE_BUILD_TESTS=ON \
  -DCMAKE_INSTALL_PREFIX="$ROOT/build/install" >/dev/null
cmake --build build/cpp -j "$JOBS"
ctest --test-dir build/cpp --output-on-failure -j "$JOBS"

echo "== C++ example against the installed package"
cmake --install build/cpp >/dev/null
cmake -S examples/cpp -B build/example -G Ninja -DCMAKE_PREFIX_PATH="$ROOT/build/install" >/dev/null
cmake --build build/example -j "$JOBS" >/dev/null
build/example/store_example
build/example/bridge_example

echo "== Python tests"
install_python_package
"$PY" -m pytest -q tests/python

if [ "${KVBRIDGE_SKIP_VLLM:-0}" != 1 ]; then
  echo "== vLLM connector tests (in .venv-vllm)"
  setup_vllm_venv
  VLLM_CPU_KVCACHE_SPACE=1 "$VLLM_PY" -m pytest -q tests/vllm
fi
