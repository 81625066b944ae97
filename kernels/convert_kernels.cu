// Device kernels of LinearAdapter::convert (see convert_kernels.cuh for the contracts).
//
// The per-element work lives in convert_elements.cuh (shared with a CPU test of it). Work
// decomposition of the gather and the epilogue: one thread per RoPE pair of a token row (keys and
// values alike, so values use the same indexing and are just not rotated); blockIdx.y walks the
// tokens with a grid stride. Consecutive threads take consecutive pairs, so with a
// dense head_dim both styles read and write consecutive elements.
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/convert_elements.cuh"
#include "kernels/convert_kernels.cuh"
#include "kernels/cuda_check.cuh"

namespace kvbridge::cuda {
namespace {

__global__ void rope_table_kernel(const double* inv_freq, int64_t half, int64_t pos0,
                                  const int64_t* offsets, int64_t tokens, CosSin* table) {
  const int64_t n = tokens * half;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < n;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = k / half, i = k - t * half;
    table[k] = rope_entry(pos0, offsets, t, inv_freq[i]);
  }
}

template <typename T>
__global__ void gather_kernel(KVPlane key, KVPlane value, const int64_t* index, int64_t tokens,
                              int heads, int dim, bool interleaved, const CosSin* table, T* out,
                              int64_t ld) {
  const int p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p >= heads * dim) return;
  const PairIndex ix = pair_index(p, heads, dim, interleaved);
  const KVPlane plane = ix.kind == 0 ? key : value;
  const bool rotate_keys = ix.kind == 0 && table != nullptr;
  const int half = dim / 2;
  const int64_t column = static_cast<int64_t>(ix.kind) * heads * dim + ix.head * dim;
  for (int64_t t = blockIdx.y; t < tokens; t += gridDim.y)
    gather_pair(plane, source_row(index, t), ix,
                rotate_keys ? table + t * half + ix.pair : nullptr, out + t * ld + column);
}

template <typename T>
__global__ void epilogue_kernel(const float* y, int64_t ld, const float* bias,
                                const CosSin* table, bool interleaved, int64_t tokens, int heads,
                                int dim, KVPlane key, KVPlane value) {
  const int p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p >= heads * dim) return;
  const PairIndex ix = pair_index(p, heads, dim, interleaved);
  const KVPlane plane = ix.kind == 0 ? key : value;
  const bool rotate_keys = ix.kind == 0 && table != nullptr;
  const int half = dim / 2;
  const int64_t column = static_cast<int64_t>(ix.kind) * heads * dim + ix.head * dim;
  const float bias_a = bias[column + ix.a], bias_b = bias[column + ix.b];
  for (int64_t t = blockIdx.y; t < tokens; t += gridDim.y)
    epilogue_pair<T>(y + t * ld + column, bias_a, bias_b, ix,
                     rotate_keys ? table + t * half + ix.pair : nullptr, plane, t);
}

// One thread per pair of a token row; blockIdx.y over tokens (grid-stride beyond 65535).
struct RowLaunch {
  dim3 grid, block;
};
RowLaunch row_launch(int64_t tokens, int64_t heads, int64_t dim) {
  KVB_CHECK(heads * dim <= (int64_t{1} << 30),
            "CUDA convert: kv_heads * head_dim " << heads * dim << " is too large");
  const int pairs = static_cast<int>(heads * dim);
  const int threads = std::min(256, (pairs + 31) / 32 * 32);
  RowLaunch l;
  l.block = dim3(static_cast<unsigned>(threads));
  l.grid = dim3(static_cast<unsigned>((pairs + threads - 1) / threads),
                static_cast<unsigned>(std::min<int64_t>(tokens, 65535)));
  return l;
}

}  // namespace

void launch_rope_table(const double* inv_freq, int64_t half, int64_t pos0, const int64_t* offsets,
                       int64_t tokens, CosSin* table, cudaStream_t stream) {
  const int64_t n = tokens * half;
  if (n == 0) return;
  const int threads = 256;
  const unsigned blocks =
      static_cast<unsigned>(std::min<int64_t>((n + threads - 1) / threads, 4096));
  rope_table_kernel<<<blocks, threads, 0, stream>>>(inv_freq, half, pos0, offsets, tokens, table);
  KVB_CUDA_CHECK_LAUNCH();
}

void launch_gather(const KVPlane& key, const KVPlane& value, DType dtype, const int64_t* index,
                   int64_t tokens, int64_t heads, int64_t dim, bool interleaved,
                   const CosSin* table, void* out, int64_t ld, cudaStream_t stream) {
  if (tokens == 0) return;
  const RowLaunch l = row_launch(tokens, heads, dim);
  const int h = static_cast<int>(heads), d = static_cast<int>(dim);
  switch (dtype) {
    case DType::kFloat32:
      gather_kernel<float><<<l.grid, l.block, 0, stream>>>(
          key, value, index, tokens, h, d, interleaved, table, static_cast<float*>(out), ld);
      break;
    case DType::kBFloat16:
      gather_kernel<__nv_bfloat16><<<l.grid, l.block, 0, stream>>>(
          key, value, index, tokens, h, d, interleaved, table, static_cast<__nv_bfloat16*>(out),
          ld);
      break;
    case DType::kFloat16:
      gather_kernel<__half><<<l.grid, l.block, 0, stream>>>(
          key, value, index, tokens, h, d, interleaved, table, static_cast<__half*>(out), ld);
      break;
  }
  KVB_CUDA_CHECK_LAUNCH();
}

void launch_epilogue(const float* y, int64_t ld, const float* bias, const CosSin* table,
                     bool interleaved, int64_t tokens, int64_t heads, int64_t dim, DType dtype,
                     const KVPlane& key, const KVPlane& value, cudaStream_t stream) {
  if (tokens == 0) return;
  const RowLaunch l = row_launch(tokens, heads, dim);
  const int h = static_cast<int>(heads), d = static_cast<int>(dim);
  switch (dtype) {
    case DType::kFloat32:
      epilogue_kernel<float><<<l.grid, l.block, 0, stream>>>(y, ld, bias, table, interleaved,
                                                             tokens, h, d, key, value);
      break;
    case DType::kBFloat16:
      epilogue_kernel<__nv_bfloat16><<<l.grid, l.block, 0, stream>>>(
          y, ld, bias, table, interleaved, tokens, h, d, key, value);
      break;
    case DType::kFloat16:
      epilogue_kernel<__half><<<l.grid, l.block, 0, stream>>>(y, ld, bias, table, interleaved,
                                                              tokens, h, d, key, value);
      break;
  }
  KVB_CUDA_CHECK_LAUNCH();
}

}  // namespace kvbridge::cuda
