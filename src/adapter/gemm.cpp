#include "src/adapter/gemm.h"

#include <cstdlib>
#include <cstring>
#include <vector>

#include "kvbridge/error.h"
#include "src/core/dtype_convert.h"

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

// KVBRIDGE_CPU_ISA, unset or empty: no cap. Nor do the bfloat16 kernels' names ("amx",
// "avx512bf16"), which lie above every float32 kernel.
bool uncapped(const char* cap) {
  return cap == nullptr || *cap == '\0' || std::strcmp(cap, "amx") == 0 ||
         std::strcmp(cap, "avx512bf16") == 0;
}

const Kernel& chosen_kernel() {
  static const Kernel& chosen = [&]() -> const Kernel& {
    const char* cap = std::getenv("KVBRIDGE_CPU_ISA");
    bool allowed = uncapped(cap);
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

Bf16PackedB pack_b_bf16(const float* b, int64_t ldb, int64_t k, int64_t n) {
  KVB_CHECK(k > 0 && n > 0 && ldb >= n, "pack_b_bf16: bad shape k=" << k << " n=" << n
                                                                    << " ldb=" << ldb);
  Bf16PackedB p;
  p.k = k;
  p.n = n;
  p.k_tiles = (k + kAmxTileK - 1) / kAmxTileK;
  p.n_tiles = (n + kAmxTileCols - 1) / kAmxTileCols;
  p.tiles.assign(static_cast<size_t>(p.k_tiles * p.n_tiles * kAmxTileElems), 0);
  for (int64_t row = 0; row < k; ++row) {
    const int64_t kt = row / kAmxTileK, r = (row % kAmxTileK) / 2, q = row % 2;
    for (int64_t col = 0; col < n; ++col) {
      const int64_t nt = col / kAmxTileCols, c = col % kAmxTileCols;
      const int64_t at = (nt * p.k_tiles + kt) * kAmxTileElems + r * kAmxTileK + 2 * c + q;
      p.tiles[static_cast<size_t>(at)] = float_to_bf16(b[row * ldb + col]);
    }
  }
  return p;
}

namespace {

struct Bf16Kernel {
  const char* name;
  const char* cap;  // the KVBRIDGE_CPU_ISA name that still allows it
  bool (*supported)();
  void (*multiply)(int64_t, const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t, float*,
                   int64_t);
};

// Widest first. Both read A rounded by avx512bf16::round_rows: every AMX-BF16 CPU has
// AVX512-BF16.
bool amx_runs() { return avx512bf16::supported() && amx::supported(); }
constexpr Bf16Kernel kBf16Kernels[] = {
    {"amx-bf16", "amx", amx_runs, amx::multiply},
    {"avx512-bf16", "avx512bf16", avx512bf16::supported, avx512bf16::multiply},
};

const Bf16Kernel* find_bf16_kernel(const char* name) {
  for (const Bf16Kernel& k : kBf16Kernels)
    if (std::strcmp(k.name, name) == 0) return &k;
  return nullptr;
}

// Each kernel's support, asked once (AMX asks the OS for the tile state).
bool bf16_kernel_runs(const Bf16Kernel& k) {
  static const bool runs[] = {kBf16Kernels[0].supported(), kBf16Kernels[1].supported()};
  static_assert(sizeof(runs) / sizeof(runs[0]) == sizeof(kBf16Kernels) / sizeof(kBf16Kernels[0]));
  return runs[&k - kBf16Kernels];
}

const Bf16Kernel* chosen_bf16_kernel() {
  static const Bf16Kernel* chosen = []() -> const Bf16Kernel* {
    const char* cap = std::getenv("KVBRIDGE_CPU_ISA");
    bool allowed = cap == nullptr || *cap == '\0';
    for (const Bf16Kernel& k : kBf16Kernels) {
      allowed = allowed || std::strcmp(k.cap, cap) == 0;
      if (allowed && bf16_kernel_runs(k)) return &k;
    }
    return nullptr;
  }();
  return chosen;
}

void check_shapes(const Bf16TiledA& a, const Bf16PackedB& b, int64_t ldc) {
  KVB_CHECK(a.k == b.k && a.k_tiles == b.k_tiles && ldc >= b.n,
            "gemm_bf16: A has k=" << a.k << ", B k=" << b.k << " n=" << b.n << ", ldc=" << ldc);
}

}  // namespace

const char* bf16_gemm_kernel() {
  const Bf16Kernel* k = chosen_bf16_kernel();
  return k ? k->name : nullptr;
}

void tile_a_bf16(int64_t m, int64_t k, const float* a, int64_t lda, Bf16TiledA& out) {
  KVB_CHECK_AS(Unavailable, bf16_kernel_runs(kBf16Kernels[1]),
               "this CPU (or this build of kvbridge) has no bfloat16 GEMM");
  KVB_CHECK(m >= 0 && k > 0 && lda >= k,
            "tile_a_bf16: bad shape m=" << m << " k=" << k << " lda=" << lda);
  out.m = m;
  out.k = k;
  out.k_tiles = (k + kAmxTileK - 1) / kAmxTileK;
  const int64_t m_tiles = (m + kAmxTileRows - 1) / kAmxTileRows;
  out.tiles.resize(static_cast<size_t>(m_tiles * out.k_tiles * kAmxTileElems));
  avx512bf16::round_rows(a, lda, m, k, out.k_tiles, out.tiles.data());
}

void gemm_bf16(const Bf16TiledA& a, const Bf16PackedB& b, float* c, int64_t ldc) {
  const Bf16Kernel* kernel = chosen_bf16_kernel();
  KVB_CHECK_AS(Unavailable, kernel != nullptr,
               "this CPU (or this build of kvbridge) has no bfloat16 GEMM");
  check_shapes(a, b, ldc);
  if (a.m == 0) return;
  kernel->multiply(a.m, a.tiles.data(), b.tiles.data(), b.k_tiles, b.n_tiles, b.n, c, ldc);
}

void gemm_bf16_kernel(const char* name, const Bf16TiledA& a, const Bf16PackedB& b, float* c,
                      int64_t ldc) {
  const Bf16Kernel* kernel = find_bf16_kernel(name);
  KVB_CHECK(kernel != nullptr,
            "unknown bfloat16 kernel '" << name << "' (amx-bf16 or avx512-bf16)");
  KVB_CHECK_AS(Unavailable, bf16_kernel_runs(*kernel),
               "this CPU (or this build of kvbridge) cannot run the " << name << " kernel");
  check_shapes(a, b, ldc);
  if (a.m == 0) return;
  kernel->multiply(a.m, a.tiles.data(), b.tiles.data(), b.k_tiles, b.n_tiles, b.n, c, ldc);
}

}  // namespace kvbridge::detail
