// Element conversion between the KV dtypes and float32, and plane gather/scatter in float32.
// The one dtype dispatch of every float32 pass over KV lives in load_plane / store_plane.
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>

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

/// Saturating casts, what store_plane (and so every convert's output) uses: round to nearest
/// even, and a finite value beyond the dtype's range becomes its largest finite value of the same
/// sign (float16 +-65504, bfloat16 +-3.3895e38) instead of an infinity. NaN and +-inf stay as they
/// are: finite input never gives a non-finite element.
uint16_t float_to_fp16_saturate(float value) noexcept;
inline uint16_t float_to_bf16_saturate(float value) noexcept {
  const uint16_t b = float_to_bf16(value);
  uint32_t u;
  std::memcpy(&u, &value, 4);
  const bool finite = (u & 0x7f800000u) != 0x7f800000u;
  if (finite && (b & 0x7fffu) == 0x7f80u) return static_cast<uint16_t>((b & 0x8000u) | 0x7f7fu);
  return b;
}

/// Where a KV view holds a NaN or an infinity: the first such element's layer, kind (K or V)
/// and token (layers in order, K before V, then tokens in order).
struct NonFinite {
  int64_t layer = 0;
  int kind = 0;  ///< KVView::kKey or KVView::kValue
  int64_t token = 0;
};
/// The first non-finite element of `kv` (a CPU view, any dtype and strides), or nullopt when every
/// element is finite. Reads the whole view when it is finite.
std::optional<NonFinite> find_nonfinite(const KVView& kv);

/// Copies plane [tokens, heads, dim] (any dtype, any strides) into `out`, dense row-major
/// float32 with row length heads*dim: out[t * ld + h * dim + d], ld >= heads*dim.
/// rows: nullptr, or the plane's token to read for each output row t (rows[t]; a gather).
void load_plane(const KVPlane& plane, DType dtype, int64_t tokens, int64_t heads, int64_t dim,
                float* out, int64_t ld, const int64_t* rows = nullptr);
/// The inverse of load_plane: rounds `in` to `dtype` (the saturating casts above) and writes the
/// strided plane.
void store_plane(const float* in, int64_t ld, DType dtype, int64_t tokens, int64_t heads,
                 int64_t dim, const KVPlane& plane);

}  // namespace kvbridge::detail
