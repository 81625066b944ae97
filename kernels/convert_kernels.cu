// Device kernels of LinearAdapter::convert (see convert_kernels.cuh for the contracts).
//
// Work decomposition of the gather and the epilogue: one thread per RoPE pair of a token row
// (keys and values alike, so values use the same indexing and are just not rotated); blockIdx.y
// walks the tokens with a grid stride. Consecutive threads take consecutive pairs, so with a
// dense head_dim both styles read and write consecutive elements.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/convert_kernels.cuh"
#include "kernels/cuda_check.cuh"

namespace kvbridge::cuda {
namespace {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}

// (a, b) <- (a c - b s, b c + a s) with every operation rounded on its own (no FMA contraction),
// the float32 arithmetic of the CPU path.
__device__ __forceinline__ void rotate(float& a, float& b, float c, float s) {
  const float a0 = a, b0 = b;
  a = __fsub_rn(__fmul_rn(a0, c), __fmul_rn(b0, s));
  b = __fadd_rn(__fmul_rn(b0, c), __fmul_rn(a0, s));
}

// Position of pair p of a token row: kind (0 keys, 1 values), head, and the two elements.
struct PairIndex {
  int kind, head, pair, a, b;
};
__device__ __forceinline__ PairIndex pair_index(int p, int heads, int dim, bool interleaved) {
  const int half = dim / 2, per_kind = heads * half;
  PairIndex r;
  r.kind = p / per_kind;
  const int rest = p - r.kind * per_kind;
  r.head = rest / half;
  r.pair = rest - r.head * half;
  r.a = interleaved ? 2 * r.pair : r.pair;
  r.b = interleaved ? 2 * r.pair + 1 : r.pair + half;
  return r;
}

__global__ void rope_table_kernel(const double* inv_freq, int64_t half, int64_t pos0,
                                  int64_t tokens, float2* table) {
  const int64_t n = tokens * half;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < n;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = k / half, i = k - t * half;
    const double angle = static_cast<double>(pos0 + t) * inv_freq[i];
    double s, c;
    sincos(angle, &s, &c);
    table[k] = make_float2(static_cast<float>(c), static_cast<float>(s));
  }
}

template <typename T>
__global__ void gather_kernel(KVPlane key, KVPlane value, int64_t tokens, int heads, int dim,
                              bool interleaved, const float2* table, T* out, int64_t ld) {
  const int p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p >= heads * dim) return;
  const PairIndex ix = pair_index(p, heads, dim, interleaved);
  const KVPlane plane = ix.kind == 0 ? key : value;
  const bool rotate_keys = ix.kind == 0 && table != nullptr;
  const int half = dim / 2;
  const int64_t column = static_cast<int64_t>(ix.kind) * heads * dim + ix.head * dim;
  for (int64_t t = blockIdx.y; t < tokens; t += gridDim.y) {
    const T* row = static_cast<const T*>(plane.data) + t * plane.token_stride +
                   ix.head * plane.head_stride;
    float xa = to_float(row[ix.a * plane.dim_stride]);
    float xb = to_float(row[ix.b * plane.dim_stride]);
    if (rotate_keys) {
      const float2 cs = table[t * half + ix.pair];
      rotate(xa, xb, cs.x, -cs.y);  // the inverse rotation
    }
    T* o = out + t * ld + column;
    o[ix.a] = from_float<T>(xa);
    o[ix.b] = from_float<T>(xb);
  }
}

template <typename T>
__global__ void epilogue_kernel(const float* y, int64_t ld, const float* bias,
                                const float2* table, bool interleaved, int64_t tokens, int heads,
                                int dim, KVPlane key, KVPlane value) {
  const int p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p >= heads * dim) return;
  const PairIndex ix = pair_index(p, heads, dim, interleaved);
  const KVPlane plane = ix.kind == 0 ? key : value;
  const bool rotate_keys = ix.kind == 0 && table != nullptr;
  const int half = dim / 2;
  const int64_t column = static_cast<int64_t>(ix.kind) * heads * dim + ix.head * dim;
  const float bias_a = bias[column + ix.a], bias_b = bias[column + ix.b];
  for (int64_t t = blockIdx.y; t < tokens; t += gridDim.y) {
    const float* in = y + t * ld + column;
    float xa = in[ix.a] + bias_a;
    float xb = in[ix.b] + bias_b;
    if (rotate_keys) {
      const float2 cs = table[t * half + ix.pair];
      rotate(xa, xb, cs.x, cs.y);
    }
    T* row = static_cast<T*>(plane.data) + t * plane.token_stride + ix.head * plane.head_stride;
    row[ix.a * plane.dim_stride] = from_float<T>(xa);
    row[ix.b * plane.dim_stride] = from_float<T>(xb);
  }
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

void launch_rope_table(const double* inv_freq, int64_t half, int64_t pos0, int64_t tokens,
                       float2* table, cudaStream_t stream) {
  const int64_t n = tokens * half;
  if (n == 0) return;
  const int threads = 256;
  const unsigned blocks =
      static_cast<unsigned>(std::min<int64_t>((n + threads - 1) / threads, 4096));
  rope_table_kernel<<<blocks, threads, 0, stream>>>(inv_freq, half, pos0, tokens, table);
  KVB_CUDA_CHECK_LAUNCH();
}

void launch_gather(const KVPlane& key, const KVPlane& value, DType dtype, int64_t tokens,
                   int64_t heads, int64_t dim, bool interleaved, const float2* table, void* out,
                   int64_t ld, cudaStream_t stream) {
  if (tokens == 0) return;
  const RowLaunch l = row_launch(tokens, heads, dim);
  const int h = static_cast<int>(heads), d = static_cast<int>(dim);
  switch (dtype) {
    case DType::kFloat32:
      gather_kernel<float><<<l.grid, l.block, 0, stream>>>(key, value, tokens, h, d, interleaved,
                                                           table, static_cast<float*>(out), ld);
      break;
    case DType::kBFloat16:
      gather_kernel<__nv_bfloat16><<<l.grid, l.block, 0, stream>>>(
          key, value, tokens, h, d, interleaved, table, static_cast<__nv_bfloat16*>(out), ld);
      break;
    case DType::kFloat16:
      gather_kernel<__half><<<l.grid, l.block, 0, stream>>>(key, value, tokens, h, d, interleaved,
                                                            table, static_cast<__half*>(out), ld);
      break;
  }
  KVB_CUDA_CHECK_LAUNCH();
}

void launch_epilogue(const float* y, int64_t ld, const float* bias, const float2* table,
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
