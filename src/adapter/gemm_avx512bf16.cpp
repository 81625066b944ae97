// The AVX-512 BF16 build of the bfloat16 GEMM (src/adapter/gemm.h), for CPUs that have
// vdpbf16ps but no AMX (AMD Zen 4 and later, Intel Cooper Lake), and the rounding of A into the
// tile layout that both bfloat16 kernels read. Compiled with the AVX-512 BF16 flags
// (CMakeLists.txt); gemm.cpp calls in here only after supported() said yes.
//
// Only plain functions and intrinsics: an inline function or template shared with other files
// instantiated here would carry these flags, and the linker may keep this copy for the whole
// library, which then faults on a CPU without AVX-512.
#include "src/adapter/gemm.h"

#include <cstring>

#if defined(__x86_64__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define KVB_HAVE_AVX512BF16 1
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace kvbridge::detail::avx512bf16 {

#ifdef KVB_HAVE_AVX512BF16

namespace {

constexpr int64_t kRows = kAmxTileRows;  // rows of every tile
constexpr int64_t kK = kAmxTileK;        // bfloat16 values per tile row (16 k pairs)
constexpr int64_t kCols = kAmxTileCols;  // columns per B tile: one 32-bit lane each
constexpr int64_t kTileElems = kAmxTileElems;
constexpr int64_t kMicroRows = 8;  // C rows per micro tile, by 2 B tiles: 16 accumulators

__mmask16 lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF)
                 : n <= 0 ? static_cast<__mmask16>(0) : static_cast<__mmask16>((1u << n) - 1);
}

// C [rows, cols] (ldc; rows <= 8, cols <= 32) += A rows (8 rows of A's tiles from a_rows, row r
// of k tile kt at a_rows + kt * kTileElems + r * kK) times B tiles b0 and b1 (column tiles; b1
// zero past n, or b0 again when there is none, its sums never stored). Each step of the k
// loop: one pair of k values of each A row broadcast to all lanes, against the same pair of
// every column (a row of a B tile), with float32 accumulation.
void micro(const uint16_t* a_rows, const uint16_t* b0, const uint16_t* b1, int64_t k_tiles,
           float* c, int64_t ldc, int64_t rows, int64_t cols) {
  const __mmask16 m0 = lanes(cols), m1 = lanes(cols - 16);
  __m512 acc[kMicroRows][2];
  for (int64_t r = 0; r < kMicroRows; ++r) {
    acc[r][0] = r < rows ? _mm512_maskz_loadu_ps(m0, c + r * ldc) : _mm512_setzero_ps();
    acc[r][1] = r < rows ? _mm512_maskz_loadu_ps(m1, c + r * ldc + 16) : _mm512_setzero_ps();
  }
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    const uint16_t* a = a_rows + kt * kTileElems;
    const uint16_t* t0 = b0 + kt * kTileElems;
    const uint16_t* t1 = b1 + kt * kTileElems;
    for (int64_t p = 0; p < kK / 2; ++p) {
      const __m512bh lo = (__m512bh)_mm512_loadu_si512(t0 + p * kK);
      const __m512bh hi = (__m512bh)_mm512_loadu_si512(t1 + p * kK);
      for (int64_t r = 0; r < kMicroRows; ++r) {
        int32_t pair;
        std::memcpy(&pair, a + r * kK + 2 * p, sizeof pair);
        const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, lo);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, hi);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    _mm512_mask_storeu_ps(c + r * ldc, m0, acc[r][0]);
    _mm512_mask_storeu_ps(c + r * ldc + 16, m1, acc[r][1]);
  }
}

}  // namespace

bool supported() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) return false;
  const bool avx512_bf16 = (eax >> 5) & 1;
  // __builtin_cpu_supports also checks that the OS saves the AVX-512 state (XCR0).
  return avx512_bf16 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
}

void round_rows(const float* a, int64_t lda, int64_t m, int64_t k, int64_t k_tiles,
                uint16_t* a_tiles) {
  const int64_t m_tiles = (m + kRows - 1) / kRows;
  for (int64_t i = 0; i < m_tiles * kRows; ++i) {
    const float* src = a + (i < m ? i : 0) * lda;  // rows past m: all lanes masked off
    uint16_t* dst = a_tiles + (i / kRows) * k_tiles * kTileElems + (i % kRows) * kK;
    for (int64_t kt = 0; kt < k_tiles; ++kt, dst += kTileElems) {
      const int64_t left = i < m ? k - kt * kK : 0;
      const __m512 lo = _mm512_maskz_loadu_ps(lanes(left), src + kt * kK);
      const __m512 hi = _mm512_maskz_loadu_ps(lanes(left - 16), src + kt * kK + 16);
      _mm512_storeu_si512(dst, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    }
  }
}

void multiply(int64_t m, const uint16_t* a_tiles, const uint16_t* b_tiles, int64_t k_tiles,
              int64_t n_tiles, int64_t n, float* c, int64_t ldc) {
  // A column block of B (two tiles, k x 32) stays in L2 while every row of A passes it.
  for (int64_t jt = 0; jt < n_tiles; jt += 2) {
    const uint16_t* b0 = b_tiles + jt * k_tiles * kTileElems;
    const uint16_t* b1 = jt + 1 < n_tiles ? b0 + k_tiles * kTileElems : b0;
    const int64_t j0 = jt * kCols;
    const int64_t cols = n - j0 < 2 * kCols ? n - j0 : 2 * kCols;
    for (int64_t i0 = 0; i0 < m; i0 += kMicroRows) {
      const uint16_t* a_rows =
          a_tiles + (i0 / kRows) * k_tiles * kTileElems + (i0 % kRows) * kK;
      const int64_t rows = m - i0 < kMicroRows ? m - i0 : kMicroRows;
      micro(a_rows, b0, b1, k_tiles, c + i0 * ldc + j0, ldc, rows, cols);
    }
  }
}

#else  // a build without the AVX-512 BF16 flags: never supported, never called

bool supported() { return false; }
void round_rows(const float*, int64_t, int64_t, int64_t, int64_t, uint16_t*) {}
void multiply(int64_t, const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t, float*,
              int64_t) {}

#endif

}  // namespace kvbridge::detail::avx512bf16
