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

/// B [k, n] rounded to bfloat16 (nearest even) and laid out for the bfloat16 kernels: tiles of
/// 32 k by 16 n, zero beyond k and n, column tiles outermost; tile (nt, kt) holds
/// B[32 kt + 2 r + q][16 nt + c] at row r, column 2 c + q (the k pairs one dot-product step takes
/// together: a row of an AMX tile, or one 512-bit vdpbf16ps operand). Built once per weight
/// matrix.
struct Bf16PackedB {
  int64_t k = 0, n = 0;
  int64_t k_tiles = 0, n_tiles = 0;
  std::vector<uint16_t> tiles;  // k_tiles * n_tiles tiles of 16 x 32 bfloat16
};
/// Packs row-major float32 B [k, n] (ldb >= n, CPU memory, read only). k, n > 0.
Bf16PackedB pack_b_bf16(const float* b, int64_t ldb, int64_t k, int64_t n);

/// A [m, k] rounded to bfloat16 in the tile layout of Bf16PackedB: ceil(m / 16) row tiles of
/// k_tiles tiles of 16 x 32 (row tiles outermost), zero past m and k. Reused across calls.
struct Bf16TiledA {
  int64_t m = 0, k = 0, k_tiles = 0;
  std::vector<uint16_t> tiles;
};

/// The bfloat16 GEMM kernel the convert uses here, chosen once per process: "amx-bf16" (AMX
/// tiles: the CPU has AMX-BF16 and the OS granted the tile state), "avx512-bf16" (vdpbf16ps),
/// or nullptr: neither runs (or KVBRIDGE_CPU_ISA caps below it: "avx512bf16" allows the second
/// only; "avx512" and lower keep bfloat16 targets on the float32 GEMM, for comparisons).
const char* bf16_gemm_kernel();

/// Rounds row-major float32 A [m, k] (lda >= k, CPU memory) into `out`, reusing its storage.
/// Unavailable where bf16_gemm_kernel() is nullptr.
void tile_a_bf16(int64_t m, int64_t k, const float* a, int64_t lda, Bf16TiledA& out);

/// C += A * B in float32 from bfloat16 products, on bf16_gemm_kernel(): C [a.m, b.n] row-major
/// float32 (ldc >= b.n); a.k must equal b.k. Single-threaded (the convert runs one token block
/// per thread). Columns of C past b.n are never written. Unavailable where bf16_gemm_kernel()
/// is nullptr.
void gemm_bf16(const Bf16TiledA& a, const Bf16PackedB& b, float* c, int64_t ldc);

/// gemm_bf16 on the named kernel ("amx-bf16" or "avx512-bf16"), for tests: InvalidArgument for
/// another name, Unavailable when this CPU or build cannot run it.
void gemm_bf16_kernel(const char* kernel, const Bf16TiledA& a, const Bf16PackedB& b, float* c,
                      int64_t ldc);

/// The builds behind gemm_bf16, each with its own ISA flags. A build without them says false.
namespace avx512bf16 {
/// CPU flags (AVX512-BF16, AVX512F, AVX512BW).
bool supported();
/// Rounds float32 A [m, k] (lda) to bfloat16 in B's tile layout: ceil(m / 16) row tiles of
/// k_tiles tiles of 16 x 32 each (row tiles outermost), zero past m and k. Both kernels read it.
void round_rows(const float* a, int64_t lda, int64_t m, int64_t k, int64_t k_tiles,
                uint16_t* a_tiles);
/// C [m, n] (ldc) += A * B, both operands as tiles.
void multiply(int64_t m, const uint16_t* a_tiles, const uint16_t* b_tiles, int64_t k_tiles,
              int64_t n_tiles, int64_t n, float* c, int64_t ldc);
}  // namespace avx512bf16
namespace amx {
/// CPU flags (AMX-BF16 with what avx512bf16 needs), and the OS's permission for the tile state
/// (asked here, once per process is enough).
bool supported();
/// C [m, n] (ldc) += A * B, both operands as tiles.
void multiply(int64_t m, const uint16_t* a_tiles, const uint16_t* b_tiles, int64_t k_tiles,
              int64_t n_tiles, int64_t n, float* c, int64_t ldc);
}  // namespace amx

}  // namespace kvbridge::detail
