// Per-element functions of the CUDA convert kernels (convert_kernels.cu), compiled for the device
// there and for the host by the CPU test of the device arithmetic (tests/cpp/test_convert_elements.cpp):
// the pair indexing, the RoPE table entry, the rotation, and one pair of one token of the gather
// and of the epilogue. Host builds see the float32 forms only (bfloat16 / float16 element types
// are device-only).
//
// Index conventions (shared with src/adapter/convert_cuda.cpp): a token row of a layer's features
// or GEMM output holds keys then values, each [heads, head_dim] flattened, so column
// kind * heads * dim + h * dim + d is element d of head h of the keys (kind 0) or values (kind 1).
// RoPE pairs follow src/adapter/numeric.cpp: (i, i + dim/2) for the half style, (2i, 2i + 1) for
// the interleaved one.
#pragma once

#include <cmath>
#include <cstdint>

#include "kvbridge/kv_view.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define KVB_HD __host__ __device__ __forceinline__
#else
#define KVB_HD inline
#endif

namespace kvbridge::cuda {

/// cos and sin of one RoPE angle, rounded to float32.
struct alignas(8) CosSin {
  float c, s;
};

/// Position of pair p of a token row: kind (0 keys, 1 values), head, pair within the head, and
/// the pair's two elements within the head.
struct PairIndex {
  int kind, head, pair, a, b;
};
KVB_HD PairIndex pair_index(int p, int heads, int dim, bool interleaved) {
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

/// Token t's source row: index[t] with an index (a gather across tokenizers), else t.
KVB_HD int64_t source_row(const int64_t* index, int64_t t) { return index ? index[t] : t; }

/// RoPE table entry of row t: the angle (pos0 + source_row(offsets, t)) * inv_freq in float64,
/// both functions in float64, rounded to float32 (as the CPU path does).
KVB_HD CosSin rope_entry(int64_t pos0, const int64_t* offsets, int64_t t, double inv_freq) {
  const double angle = static_cast<double>(pos0 + source_row(offsets, t)) * inv_freq;
  double s, c;
#if defined(__CUDA_ARCH__)
  sincos(angle, &s, &c);
#else
  s = std::sin(angle);
  c = std::cos(angle);
#endif
  return CosSin{static_cast<float>(c), static_cast<float>(s)};
}

/// (a, b) <- (a c - b s, b c + a s) with every operation rounded on its own (no FMA
/// contraction), the float32 arithmetic of the CPU path. (The host form relies on the baseline
/// x86-64 target having no FMA instructions to contract into, as the CPU path does.)
KVB_HD void rotate(float& a, float& b, float c, float s) {
  const float a0 = a, b0 = b;
#if defined(__CUDA_ARCH__)
  a = __fsub_rn(__fmul_rn(a0, c), __fmul_rn(b0, s));
  b = __fadd_rn(__fmul_rn(b0, c), __fmul_rn(a0, s));
#else
  a = a0 * c - b0 * s;
  b = b0 * c + a0 * s;
#endif
}

KVB_HD float to_float(float v) { return v; }
template <typename T>
KVB_HD T from_float(float v);
template <>
KVB_HD float from_float<float>(float v) {
  return v;
}
#if defined(__CUDACC__)
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
// Saturating, as the CPU path's store_plane (src/core/dtype_convert.h): a finite value past the
// type's range becomes its largest finite value, so finite input never converts to an infinity;
// NaN and infinities pass through.
KVB_HD float saturate(float v, float largest) {
  return isfinite(v) ? fminf(fmaxf(v, -largest), largest) : v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(saturate(v, 3.38953139e38f));  // bits 0x7f7f
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(saturate(v, 65504.0f));
}
#endif

/// One pair of the gather: reads pair ix of token `row` of `plane` (element strides), un-rotates
/// it with `cs` (nullptr: no rotation) and writes it, in the GEMM input type T, to the feature row
/// `out` (already offset to the pair's kind and head).
template <typename T>
KVB_HD void gather_pair(const KVPlane& plane, int64_t row, const PairIndex& ix, const CosSin* cs,
                        T* out) {
  const T* in = static_cast<const T*>(plane.data) + row * plane.token_stride +
                ix.head * plane.head_stride;
  float xa = to_float(in[ix.a * plane.dim_stride]);
  float xb = to_float(in[ix.b * plane.dim_stride]);
  if (cs) rotate(xa, xb, cs->c, -cs->s);  // the inverse rotation
  out[ix.a] = from_float<T>(xa);
  out[ix.b] = from_float<T>(xb);
}

/// One pair of the epilogue: x = y (the GEMM output row, offset to the pair's kind and head) plus
/// the bias pair, keys rotated with `cs` (nullptr: none), rounded to T and written to token `row`
/// of `plane`.
template <typename T>
KVB_HD void epilogue_pair(const float* y, float bias_a, float bias_b, const PairIndex& ix,
                          const CosSin* cs, const KVPlane& plane, int64_t row) {
  float xa = y[ix.a] + bias_a;
  float xb = y[ix.b] + bias_b;
  if (cs) rotate(xa, xb, cs->c, cs->s);
  T* out = static_cast<T*>(plane.data) + row * plane.token_stride + ix.head * plane.head_stride;
  out[ix.a * plane.dim_stride] = from_float<T>(xa);
  out[ix.b * plane.dim_stride] = from_float<T>(xb);
}

}  // namespace kvbridge::cuda
