"""The OpenBLAS core type, set before ``kvbridge._core`` loads the system OpenBLAS.

The fitter's float64 GEMMs and eigensolver run on the system BLAS/LAPACK (Debian's OpenBLAS
0.3.21). That OpenBLAS picks its kernels from the CPU model it knows at load time, and it takes
a CPU model newer than itself for a Prescott (SSE3): measured on one such Xeon, its float64 GEMM
ran at about a sixth of the AVX-512 kernels' rate. OpenBLAS reads ``OPENBLAS_CORETYPE`` once,
when the library loads, so the default is set here, from the instruction sets the CPU reports,
and only when the user has not set it. C++ programs that link kvbridge set it themselves.
"""
from __future__ import annotations

import os
import platform

# The first core type whose instruction sets the CPU has. For float64, OpenBLAS's newer x86
# cores (Cooperlake, SapphireRapids, Zen) reuse these two cores' kernels.
_CORE_BY_FLAGS = (
    ("SkylakeX", frozenset({"avx512f", "avx512dq", "avx512bw", "avx512vl"})),
    ("Haswell", frozenset({"avx2", "fma"})),
)


def core_type_for(cpu_flags: frozenset[str]) -> str | None:
    """The OpenBLAS core type for a CPU with these /proc/cpuinfo flags, or None to leave
    OpenBLAS's own detection alone."""
    for core, needed in _CORE_BY_FLAGS:
        if needed <= cpu_flags:
            return core
    return None


def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def set_default_core_type() -> None:
    if "OPENBLAS_CORETYPE" in os.environ:
        return
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return
    core = core_type_for(_cpu_flags())
    if core is not None:
        os.environ["OPENBLAS_CORETYPE"] = core
