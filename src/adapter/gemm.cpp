#include "src/adapter/gemm.h"

#include <cstdlib>
#include <cstring>

#include "kvbridge/error.h"

namespace kvbridge::detail {

namespace generic {
void gemm_f32(int64_t, int64_t, int64_t, const float*, int64_t, const float*, int64_t, float*,
              int64_t, bool);
}
namespace avx2 {
void gemm_f32(int64_t, int64_t, int64_t, const float*, int64_t, const float*, int64_t, float*,
              int64_t, bool);
}
namespace avx512 {
void gemm_f32(int64_t, int64_t, int64_t, const float*, int64_t, const float*, int64_t, float*,
              int64_t, bool);
}

namespace {

using GemmFn = void (*)(int64_t, int64_t, int64_t, const float*, int64_t, const float*, int64_t,
                        float*, int64_t, bool);

struct Kernel {
  const char* name;
  GemmFn fn;
  bool (*supported)();
};

// __builtin_cpu_supports also checks that the OS saves the wider registers (XCR0). On other
// architectures the "avx" files are built without ISA flags and never chosen.
#if defined(__x86_64__)
bool cpu_has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2") &&
         __builtin_cpu_supports("fma");
}
bool cpu_has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
#else
bool cpu_has_avx512() { return false; }
bool cpu_has_avx2() { return false; }
#endif
bool always() { return true; }

// Widest first.
constexpr Kernel kKernels[] = {
    {"avx512", avx512::gemm_f32, cpu_has_avx512},
    {"avx2", avx2::gemm_f32, cpu_has_avx2},
    {"generic", generic::gemm_f32, always},
};

const Kernel* find_kernel(const char* name) {
  for (const Kernel& k : kKernels)
    if (std::strcmp(k.name, name) == 0) return &k;
  return nullptr;
}

const Kernel& chosen_kernel() {
  static const Kernel& chosen = [&]() -> const Kernel& {
    const char* cap = std::getenv("KVBRIDGE_CPU_ISA");
    bool allowed = cap == nullptr || *cap == '\0';
    for (const Kernel& k : kKernels) {
      allowed = allowed || std::strcmp(k.name, cap) == 0;
      if (allowed && k.supported()) return k;
    }
    return kKernels[2];
  }();
  return chosen;
}

}  // namespace

void gemm_f32(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
              int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  chosen_kernel().fn(m, n, k, a, lda, b, ldb, c, ldc, accumulate);
}

const char* gemm_isa() { return chosen_kernel().name; }

void gemm_f32_isa(const char* isa, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                  const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  const Kernel* kernel = find_kernel(isa);
  KVB_CHECK(kernel != nullptr, "unknown CPU kernel '" << isa << "' (avx512, avx2 or generic)");
  KVB_CHECK_AS(Unavailable, kernel->supported(), "this CPU cannot run the " << isa << " kernel");
  kernel->fn(m, n, k, a, lda, b, ldb, c, ldc, accumulate);
}

}  // namespace kvbridge::detail
