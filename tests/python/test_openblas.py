"""kvbridge sets OPENBLAS_CORETYPE from the CPU's flags before the system OpenBLAS loads."""
import os
import platform
import subprocess
import sys

import pytest

from kvbridge import _openblas

AVX512 = frozenset({"sse3", "avx2", "fma", "avx512f", "avx512dq", "avx512bw", "avx512vl"})


def test_core_type_for_flags():
    assert _openblas.core_type_for(AVX512) == "SkylakeX"
    assert _openblas.core_type_for(AVX512 - {"avx512bw"}) == "Haswell"
    assert _openblas.core_type_for(frozenset({"sse3", "avx2", "fma"})) == "Haswell"
    assert _openblas.core_type_for(frozenset({"sse3", "avx2"})) is None
    assert _openblas.core_type_for(frozenset()) is None


# Asks the OpenBLAS that kvbridge._core loaded (found in this process's maps) for its core.
PROBE = r"""
import ctypes, os, kvbridge
paths = {line.split()[-1] for line in open("/proc/self/maps")
         if "openblas" in line and line.split()[-1].startswith("/")}
names = set()
for path in paths:
    lib = ctypes.CDLL(path)
    if hasattr(lib, "openblas_get_corename"):
        lib.openblas_get_corename.restype = ctypes.c_char_p
        names.add(lib.openblas_get_corename().decode())
print(os.environ.get("OPENBLAS_CORETYPE"), ",".join(sorted(names)))
"""


def _probe(**env_overrides):
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    env.update(env_overrides)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, check=True, capture_output=True,
                         text=True).stdout.split()
    return out[0], (out[1].split(",") if len(out) > 1 else [])


@pytest.mark.skipif(platform.system() != "Linux" or platform.machine() != "x86_64",
                    reason="the default is set only on Linux x86-64")
def test_loaded_openblas_uses_the_default_and_respects_the_user():
    expected = _openblas.core_type_for(_openblas._cpu_flags())
    if expected is None:
        pytest.skip("this CPU has neither AVX-512 nor AVX2+FMA")
    env_value, cores = _probe()
    assert env_value == expected
    if not cores:
        pytest.skip("kvbridge._core is not linked with OpenBLAS here")
    assert cores == [expected]
    env_value, cores = _probe(OPENBLAS_CORETYPE="Prescott")
    assert env_value == "Prescott"
    assert cores == ["Prescott"]
