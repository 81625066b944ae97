#!/usr/bin/env bash
# The CUDA checks on a GPU machine, in one run (see benchmarks/README.md, "CUDA convert"):
#   1. the machine: GPU, driver, nvcc, torch;
#   2. cuBLAS: exports KVBRIDGE_CUBLAS when libcublas.so.13 is not on the loader's path;
#   3. the CUDA GoogleTest suite (ctest -L cuda when the build tree is usable here, else the test
#      binary itself): convert against the CPU path, and the fitter on CUDA views against the CPU
#      fitter (FitterCudaVsCpu.*); then the CPU suite's convert and fitter tests;
#   4. the Python CUDA tests (pytest -m cuda) with the carried extension module, when it matches
#      this Python;
#   5. kvbridge_cuda_bench (extra arguments are passed to it).
# If the carried binaries do not start here, they are rebuilt in build/h200-local with cmake.
#
#   benchmarks/cuda/run_h200.sh [BUILD_DIR=build/h200] [bench options...]
#
# Exit status: 0 when every step that ran passed; otherwise the number of failed steps.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
BUILD="${1:-build/h200}"
shift || true
failed=0
fail() {
  echo "!! FAILED: $*"
  failed=$((failed + 1))
}
PY="$(command -v python3 || command -v python || true)"

echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader ||
  echo "(no nvidia-smi)"
(nvcc --version 2>/dev/null || /usr/local/cuda/bin/nvcc --version 2>/dev/null) | tail -1
[ -n "$PY" ] && "$PY" -c "import sys, torch; print('python', sys.version.split()[0], '| torch',
torch.__version__, '| cuda', torch.version.cuda, '| available', torch.cuda.is_available())" 2>&1 |
  tail -1
echo "repo $(pwd), build dir $BUILD, $(nproc) cores"

echo "== cuBLAS"
if [ -z "${KVBRIDGE_CUBLAS:-}" ]; then
  if [ -n "$PY" ] && "$PY" -c "import ctypes; ctypes.CDLL('libcublas.so.13')" 2>/dev/null; then
    echo "libcublas.so.13 is on the loader's path"
  else
    dirs="/usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib"
    if [ -n "$PY" ]; then
      dirs="$dirs $("$PY" -c "import site; print(' '.join(site.getsitepackages()))" 2>/dev/null)"
    fi
    for d in $dirs; do
      found="$(find "$d" -name libcublas.so.13 2>/dev/null | head -1)"
      if [ -n "$found" ]; then
        export KVBRIDGE_CUBLAS="$found"
        export LD_LIBRARY_PATH="$(dirname "$found")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        break
      fi
    done
  fi
fi
echo "KVBRIDGE_CUBLAS=${KVBRIDGE_CUBLAS:-(unset: the soname is used)}"

TESTS="$BUILD/tests/cuda/kvbridge_cuda_tests"
CPU_TESTS="$BUILD/tests/cpp/kvbridge_tests"
BENCH="$BUILD/benchmarks/cuda/kvbridge_cuda_bench"
if ! "$TESTS" --gtest_list_tests >/dev/null 2>&1 || ! "$BENCH" --help >/dev/null 2>&1; then
  echo "== carried binaries do not start here; rebuilding in build/h200-local"
  "$TESTS" --gtest_list_tests 2>&1 | tail -3
  BUILD=build/h200-local
  gen=()
  command -v ninja >/dev/null && gen=(-G Ninja)
  if cmake -S . -B "$BUILD" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DKVBRIDGE_ENABLE_CUDA=ON \
      -DKVBRIDGE_BUILD_TESTS=ON -DCMAKE_CUDA_ARCHITECTURES=90 &&
    cmake --build "$BUILD" -j "$(nproc)" --target kvbridge_cuda_tests kvbridge_cuda_bench \
      kvbridge_tests; then
    TESTS="$BUILD/tests/cuda/kvbridge_cuda_tests"
    CPU_TESTS="$BUILD/tests/cpp/kvbridge_tests"
    BENCH="$BUILD/benchmarks/cuda/kvbridge_cuda_bench"
  else
    fail "rebuild (missing dependencies? see the CMake output above)"
  fi
fi

echo "== CUDA tests"
if [ -x "$TESTS" ]; then
  # ctest's files name absolute paths of the machine that built them.
  if [ -f "$BUILD/CTestTestfile.cmake" ] &&
    grep -q "$(pwd)/$BUILD" "$BUILD/tests/cuda/"*_tests.cmake 2>/dev/null; then
    ctest --test-dir "$BUILD" -L cuda --output-on-failure || fail "ctest -L cuda"
  else
    "$TESTS" || fail "kvbridge_cuda_tests"
  fi
  if [ -x "$CPU_TESTS" ]; then
    "$CPU_TESTS" --gtest_filter='ConvertDevice.*:ConvertVsReference.*:AdapterFitter.*' ||
      fail "kvbridge_tests (convert, fitter)"
  fi
else
  fail "no test binary at $TESTS"
fi

echo "== Python CUDA tests"
if [ -z "$PY" ] || ! "$PY" -c "import pytest, torch" 2>/dev/null; then
  echo "skipped: no python with pytest and torch"
else
  tag="$("$PY" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")"
  module="$(ls "$BUILD"/_core"$tag" 2>/dev/null | head -1)"
  pydir=""
  if [ -n "$module" ]; then
    pydir="$(mktemp -d)"
    mkdir "$pydir/kvbridge"
    cp python/kvbridge/*.py python/kvbridge/*.pyi python/kvbridge/py.typed "$pydir/kvbridge/"
    cp "$module" "$pydir/kvbridge/"
    echo "using $module"
  elif "$PY" -c "import kvbridge" 2>/dev/null; then
    echo "using the installed kvbridge"
  else
    echo "no extension module for $tag in $BUILD; trying pip install ."
    "$PY" -m pip install -q --no-build-isolation --no-deps . >/dev/null 2>&1 ||
      echo "(pip install failed: build tools or dependencies missing)"
  fi
  if PYTHONPATH="$pydir${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c "import kvbridge" 2>/dev/null; then
    PYTHONPATH="$pydir${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pytest -q -p no:cacheprovider -m cuda \
      tests/python/test_convert_cuda.py tests/python/test_adapter.py || fail "pytest -m cuda"
  else
    echo "skipped: kvbridge cannot be imported with $PY"
  fi
fi

echo "== benchmark"
if [ -x "$BENCH" ]; then
  "$BENCH" "$@" || fail "kvbridge_cuda_bench (exit $?)"
else
  fail "no benchmark binary at $BENCH"
fi

echo "== done: $failed failed step(s)"
exit "$failed"
