// The float32 GEMM behind the CPU conversion, dispatched once per process to the widest
// instruction set the CPU supports.
//
// The library is built for baseline x86-64 (so it runs anywhere), where Eigen's GEMM reaches
// about a third of an AVX2 or AVX-512 BLAS. The same Eigen product is therefore compiled three
// times, each with its own ISA flags and inside its own renamed Eigen namespace (so the linker
// cannot merge instantiations built for different ISAs), and the widest one the CPU runs is
// picked at first use.
#pragma once

#include <cstdint>

namespace kvbridge::detail {

/// C = A * B (accumulate = false) or C += A * B (accumulate = true). All three are row-major
/// float32 CPU matrices given by pointer and leading dimension in elements: A [m, k] with
/// lda >= k, B [k, n] with ldb >= n, C [m, n] with ldc >= n. C must not overlap A or B.
/// Threaded with OpenMP (omp_get_max_threads() threads).
void gemm_f32(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
              int64_t ldb, float* c, int64_t ldc, bool accumulate);

/// The kernel gemm_f32 uses: "avx512", "avx2" or "generic". The environment variable
/// KVBRIDGE_CPU_ISA (read once) can lower the choice, never raise it past what the CPU runs.
const char* gemm_isa();

/// Each build of the kernel, for tests: `isa` is one of the names above. Throws
/// InvalidArgument for an unknown name and Unavailable when this CPU cannot run it.
void gemm_f32_isa(const char* isa, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                  const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate);

}  // namespace kvbridge::detail
