// Element conversion between the KV dtypes and float32, and plane gather/scatter in float32.
// The one dtype dispatch of every float32 pass over KV lives in load_plane / store_plane.
#pragma once

#include <cstdint>
#include <cstring>

#include "kvbridge/dtype.h"
#include "kvbridge/kv_view.h"

namespace kvbridge::detail {

/// Below this many elements a pass over a plane is too short to be worth waking threads.
constexpr int64_t kParallelElements = int64_t{1} << 16;

// Inline: the plane passes call these once per element, and inlined they vectorize.
inline float bf16_to_float(uint16_t bits) noexcept {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
/// Rounds to nearest even; NaN stays NaN.
inline uint16_t float_to_bf16(float value) noexcept {
  uint32_t u;
  std::memcpy(&u, &value, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float fp16_to_float(uint16_t bits) noexcept;
uint16_t float_to_fp16(float value) noexcept;  // round to nearest even, overflow to inf

/// Copies plane [tokens, heads, dim] (any dtype, any strides) into `out`, dense row-major
/// float32 with row length heads*dim: out[t * ld + h * dim + d], ld >= heads*dim.
/// rows: nullptr, or the plane's token to read for each output row t (rows[t]; a gather).
void load_plane(const KVPlane& plane, DType dtype, int64_t tokens, int64_t heads, int64_t dim,
                float* out, int64_t ld, const int64_t* rows = nullptr);
/// The inverse of load_plane: rounds `in` to `dtype` and writes the strided plane.
void store_plane(const float* in, int64_t ld, DType dtype, int64_t tokens, int64_t heads,
                 int64_t dim, const KVPlane& plane);

}  // namespace kvbridge::detail
