// The AMX build of the bfloat16 GEMM (src/adapter/gemm.h), compiled with the AMX and AVX-512 BF16
// flags (CMakeLists.txt). gemm.cpp calls in here only after supported() said yes.
//
// Only plain functions and intrinsics: an inline function or template shared with other files
// (std::vector's, std::min's) instantiated here would carry these flags, and the linker may keep
// this copy for the whole library, which then faults on a CPU without AVX-512.
#include "src/adapter/gemm.h"

#include <cstring>

#if defined(__x86_64__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && \
    defined(__AVX512BF16__) && defined(__AVX512BW__)
#define KVB_HAVE_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace kvbridge::detail::amx {

#ifdef KVB_HAVE_AMX

namespace {

constexpr int64_t kRows = kAmxTileRows;  // rows of every tile
constexpr int64_t kK = kAmxTileK;        // bfloat16 values per A-tile row (64 bytes)
constexpr int64_t kCols = kAmxTileCols;  // float32 values per C-tile row (64 bytes)
constexpr int64_t kTileElems = kAmxTileElems;

int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// Every tile 16 rows of 64 bytes: C tiles 0-3 (2 x 2 blocks of 16 x 16 float32), A tiles 4-5
// (16 rows x 32 bfloat16), B tiles 6-7 (16 pairs of rows x 16 columns).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// A C tile is read from and written to C directly when all 16 x 16 values lie inside it, else
// through a zero-padded copy (values past C's edge are never written back).
struct CTile {
  float* c;
  int64_t ldc, rows, cols;
  alignas(64) float edge[kRows * kCols];
  bool whole() const { return rows == kRows && cols == kCols; }
  float* ptr() { return whole() ? c : edge; }
  size_t stride() const { return static_cast<size_t>(whole() ? ldc : kCols) * sizeof(float); }
  void gather() {
    if (whole()) return;
    std::memset(edge, 0, sizeof(edge));
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(edge + r * kCols, c + r * ldc, static_cast<size_t>(cols) * sizeof(float));
  }
  void scatter() const {
    if (whole()) return;
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(c + r * ldc, edge + r * kCols, static_cast<size_t>(cols) * sizeof(float));
  }
};

// C's 32 x 32 block at (i0, j0) += A * B, with MT x NT of its 2 x 2 tiles
// present (the last block row or column may hold one). Tile numbers must be immediates, hence
// the template and the spelled-out cases.
template <int MT, int NT>
void block(const uint16_t* a_tiles, const uint16_t* b_tiles, int64_t k_tiles, int64_t n,
           float* c, int64_t ldc, int64_t m, int64_t i0, int64_t j0) {
  CTile t[2][2];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) {
      const int64_t r0 = i0 + i * kRows, c0 = j0 + j * kCols;
      t[i][j].c = c + r0 * ldc + c0;
      t[i][j].ldc = ldc;
      t[i][j].rows = min64(kRows, m - r0);
      t[i][j].cols = min64(kCols, n - c0);
      t[i][j].gather();
    }
  _tile_loadd(0, t[0][0].ptr(), t[0][0].stride());
  if constexpr (NT == 2) _tile_loadd(1, t[0][1].ptr(), t[0][1].stride());
  if constexpr (MT == 2) _tile_loadd(2, t[1][0].ptr(), t[1][0].stride());
  if constexpr (MT == 2 && NT == 2) _tile_loadd(3, t[1][1].ptr(), t[1][1].stride());
  const uint16_t* a0 = a_tiles + (i0 / kRows) * k_tiles * kTileElems;
  const uint16_t* a1 = a0 + k_tiles * kTileElems;
  const uint16_t* b0 = b_tiles + (j0 / kCols) * k_tiles * kTileElems;
  const uint16_t* b1 = b0 + k_tiles * kTileElems;
  // Each product issued as soon as its tiles are in: the next load overlaps it.
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    const int64_t at = kt * kTileElems;
    _tile_loadd(4, a0 + at, 64);
    _tile_loadd(6, b0 + at, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NT == 2) {
      _tile_loadd(7, b1 + at, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (MT == 2) {
      _tile_loadd(5, a1 + at, 64);
      _tile_dpbf16ps(2, 5, 6);
    }
    if constexpr (MT == 2 && NT == 2) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, t[0][0].ptr(), t[0][0].stride());
  if constexpr (NT == 2) _tile_stored(1, t[0][1].ptr(), t[0][1].stride());
  if constexpr (MT == 2) _tile_stored(2, t[1][0].ptr(), t[1][0].stride());
  if constexpr (MT == 2 && NT == 2) _tile_stored(3, t[1][1].ptr(), t[1][1].stride());
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) t[i][j].scatter();
}

}  // namespace

bool supported() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool amx_tile = (edx >> 24) & 1, amx_bf16 = (edx >> 22) & 1;
  if (!__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) return false;
  const bool avx512_bf16 = (eax >> 5) & 1;
  if (!(amx_tile && amx_bf16 && avx512_bf16 && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512bw")))
    return false;
  // The process-wide permission to use the tile data (Linux 5.16+).
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

void multiply(int64_t m, const uint16_t* a_tiles, const uint16_t* b_tiles, int64_t k_tiles,
              int64_t n_tiles, int64_t n, float* c, int64_t ldc) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = kRows;
  }
  _tile_loadconfig(&config);
  // Whole k per C block: splitting k to keep A in L1 measured slower (each split reloads C).
  const int64_t m_tiles = (m + kRows - 1) / kRows;
  for (int64_t it = 0; it < m_tiles; it += 2) {
    const bool two_rows = it + 1 < m_tiles;
    for (int64_t jt = 0; jt < n_tiles; jt += 2) {
      const bool two_cols = jt + 1 < n_tiles;
      const int64_t i0 = it * kRows, j0 = jt * kCols;
      if (two_rows && two_cols)
        block<2, 2>(a_tiles, b_tiles, k_tiles, n, c, ldc, m, i0, j0);
      else if (two_rows)
        block<2, 1>(a_tiles, b_tiles, k_tiles, n, c, ldc, m, i0, j0);
      else if (two_cols)
        block<1, 2>(a_tiles, b_tiles, k_tiles, n, c, ldc, m, i0, j0);
      else
        block<1, 1>(a_tiles, b_tiles, k_tiles, n, c, ldc, m, i0, j0);
    }
  }
  _tile_release();
}

#else  // a build without the AMX flags: never supported, never called

bool supported() { return false; }
void multiply(int64_t, const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t, float*,
              int64_t) {}

#endif

}  // namespace kvbridge::detail::amx
