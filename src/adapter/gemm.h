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
#include <vector>

namespace kvbridge::detail {

/// C = A * B (accumulate = false) or C += A * B (accumulate = true). All three are row-major
/// float32 CPU matrices given by pointer and leading dimension in elements: A [m, k] with
/// lda >= k, B [k, n] with ldb >= n, C [m, n] with ldc >= n. C must not overlap A or B.
/// Threaded with OpenMP (omp_get_max_threads() threads).
void gemm_f32(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
              int64_t ldb, float* c, int64_t ldc, bool accumulate);

/// The kernel gemm_f32 uses: "avx512", "avx2" or "generic". The environment variable
/// KVBRIDGE_CPU_ISA (read once: "amx", "avx512", "avx2" or "generic") can lower the choice, never
/// raise it past what the CPU runs.
const char* gemm_isa();

/// Each build of the kernel, for tests: `isa` is one of the names above. Throws
/// InvalidArgument for an unknown name and Unavailable when this CPU cannot run it.
void gemm_f32_isa(const char* isa, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                  const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate);

/// AMX tile geometry: 16 rows; 32 bfloat16 (A, B) or 16 float32 (C) values per row.
constexpr int64_t kAmxTileRows = 16, kAmxTileK = 32, kAmxTileCols = 16;
constexpr int64_t kAmxTileElems = kAmxTileRows * kAmxTileK;  // bfloat16 values per A or B tile

/// B [k, n] rounded to bfloat16 (nearest even) and laid out for the AMX kernel: tiles of 32 k by
/// 16 n, zero beyond k and n, column tiles outermost; tile (nt, kt) holds B[32 kt + 2 r + q]
/// [16 nt + c] at row r, column 2 c + q (the k pairs one AMX dot-product step takes together).
/// Built once per weight matrix.
struct Bf16PackedB {
  int64_t k = 0, n = 0;
  int64_t k_tiles = 0, n_tiles = 0;
  std::vector<uint16_t> tiles;  // k_tiles * n_tiles tiles of 16 x 32 bfloat16
};
/// Packs row-major float32 B [k, n] (ldb >= n, CPU memory, read only). k, n > 0.
Bf16PackedB pack_b_bf16(const float* b, int64_t ldb, int64_t k, int64_t n);

/// Whether gemm_bf16_amx runs here: the CPU has AMX-BF16 and AVX512-BF16, the library was built
/// with them and the OS granted the tile state (asked once per process).
bool amx_bf16_supported();

/// A [m, k] rounded to bfloat16 in the tile layout of Bf16PackedB: ceil(m / 16) row tiles of
/// k_tiles tiles of 16 x 32 (row tiles outermost), zero past m and k. Reused across calls.
struct Bf16TiledA {
  int64_t m = 0, k = 0, k_tiles = 0;
  std::vector<uint16_t> tiles;
};
/// Rounds row-major float32 A [m, k] (lda >= k, CPU memory) into `out`, reusing its storage.
/// Unavailable where amx_bf16_supported() is false.
void tile_a_bf16(int64_t m, int64_t k, const float* a, int64_t lda, Bf16TiledA& out);

/// C += A * B in float32 on AMX: C [a.m, b.n] row-major float32 (ldc >= b.n); a.k must equal
/// b.k. Single-threaded (the convert runs one token block per thread). Columns of C past b.n are
/// never written. Unavailable where amx_bf16_supported() is false.
void gemm_bf16_amx(const Bf16TiledA& a, const Bf16PackedB& b, float* c, int64_t ldc);

/// The bfloat16 convert uses gemm_bf16_amx: amx_bf16_supported() and KVBRIDGE_CPU_ISA unset,
/// empty or "amx" (any lower name keeps it on the float32 GEMM, for comparisons).
bool convert_uses_amx();

/// The AMX build itself (src/adapter/gemm_amx.cpp), behind gemm_bf16_amx.
namespace amx {
/// CPU flags, and the OS's permission for the tile state (asked here, once per process is
/// enough). A build without AMX flags says false.
bool supported();
/// Rounds float32 A [m, k] (lda) to bfloat16 in B's tile layout: ceil(m / 16) row tiles of
/// k_tiles tiles of 16 x 32 each (row tiles outermost), zero past m and k.
void round_rows(const float* a, int64_t lda, int64_t m, int64_t k, int64_t k_tiles,
                uint16_t* a_tiles);
/// C [m, n] (ldc) += A * B, both operands as tiles.
void multiply(int64_t m, const uint16_t* a_tiles, const uint16_t* b_tiles, int64_t k_tiles,
              int64_t n_tiles, int64_t n, float* c, int64_t ldc);
}  // namespace amx

}  // namespace kvbridge::detail
