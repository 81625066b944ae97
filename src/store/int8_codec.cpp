#include "src/store/int8_codec.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kvbridge/error.h"
#include "src/core/dtype_convert.h"

namespace kvbridge::detail {
namespace {

constexpr float kLevels = 127.0f;

// The scale of a group whose largest magnitude is `amax`: 0 only for an all-zero group, so a
// tiny nonzero group keeps |x / scale| <= 127 instead of dividing by an underflowed 0.
float scale_for(float amax) {
  const float s = amax / kLevels;
  return (s == 0.0f && amax > 0.0f) ? std::numeric_limits<float>::denorm_min() : s;
}

int8_t code_for(float x, float scale) {
  if (scale == 0.0f) return 0;
  const float q = std::nearbyint(x / scale);
  return static_cast<int8_t>(std::min(kLevels, std::max(-kLevels, q)));
}

struct Layout {
  int64_t layers, tokens, heads, dim;
  float* key_scales(char* p) const { return reinterpret_cast<float*>(p); }
  float* value_scales(char* p) const {
    return reinterpret_cast<float*>(p) + layers * heads * dim;
  }
  int8_t* codes(char* p) const {
    return reinterpret_cast<int8_t*>(p + 4 * layers * heads * (dim + tokens));
  }
  int64_t plane_elements() const { return tokens * heads * dim; }
};

// One [tokens, heads * dim] float32 plane per thread, reused across calls.
std::vector<float>& scratch(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf;
}

}  // namespace

int64_t int8_payload_bytes(int64_t layers, int64_t tokens, int64_t kv_heads, int64_t head_dim) {
  // Every factor is checked, so a corrupt header's geometry cannot overflow.
  constexpr uint64_t kMax = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  auto mul = [&](uint64_t a, uint64_t b, bool* ok) -> uint64_t {
    if (b != 0 && a > kMax / b) *ok = false;
    return *ok ? a * b : 0;
  };
  for (int64_t d : {layers, tokens, kv_heads, head_dim})
    if (d <= 0) return 0;
  bool ok = true;
  const uint64_t lh = mul(static_cast<uint64_t>(layers), static_cast<uint64_t>(kv_heads), &ok);
  const uint64_t codes =
      mul(mul(mul(2, lh, &ok), static_cast<uint64_t>(tokens), &ok), static_cast<uint64_t>(head_dim),
          &ok);
  const uint64_t scales =
      mul(mul(4, lh, &ok), static_cast<uint64_t>(head_dim) + static_cast<uint64_t>(tokens), &ok);
  if (!ok || codes > kMax - scales) return 0;
  return static_cast<int64_t>(codes + scales);
}

void quantize_int8(const KVView& src, char* payload) {
  const Layout g{src.num_layers(), src.tokens(), src.kv_heads(), src.head_dim()};
  const int64_t row = g.heads * g.dim;
  std::vector<float>& buf = scratch(static_cast<size_t>(g.plane_elements()));
  float* x = buf.data();
  float* ks = g.key_scales(payload);
  float* vs = g.value_scales(payload);
  int8_t* codes = g.codes(payload);
  bool finite = true;
  for (int64_t l = 0; l < g.layers; ++l) {
    // Keys: a scale per (head, channel), over the chunk's tokens.
    load_plane(src.plane(l, KVView::kKey), src.dtype(), g.tokens, g.heads, g.dim, x, row);
    float* kscale = ks + l * row;
    std::fill(kscale, kscale + row, 0.0f);
    for (int64_t t = 0; t < g.tokens; ++t)
      for (int64_t j = 0; j < row; ++j) {
        const float a = std::fabs(x[t * row + j]);
        finite &= a <= FLT_MAX;
        kscale[j] = std::max(kscale[j], a);
      }
    KVB_CHECK(finite, "kv: int8 storage needs finite keys (layer " << l << " has NaN or inf)");
    for (int64_t j = 0; j < row; ++j) kscale[j] = scale_for(kscale[j]);
    int8_t* kc = codes + (2 * l) * g.plane_elements();
    for (int64_t t = 0; t < g.tokens; ++t)
      for (int64_t j = 0; j < row; ++j) kc[t * row + j] = code_for(x[t * row + j], kscale[j]);

    // Values: a scale per (head, token), over the head's channels.
    load_plane(src.plane(l, KVView::kValue), src.dtype(), g.tokens, g.heads, g.dim, x, row);
    int8_t* vc = codes + (2 * l + 1) * g.plane_elements();
    for (int64_t t = 0; t < g.tokens; ++t)
      for (int64_t h = 0; h < g.heads; ++h) {
        const float* v = x + t * row + h * g.dim;
        float amax = 0.0f;
        for (int64_t d = 0; d < g.dim; ++d) {
          const float a = std::fabs(v[d]);
          finite &= a <= FLT_MAX;
          amax = std::max(amax, a);
        }
        KVB_CHECK(finite,
                  "kv: int8 storage needs finite values (layer " << l << " has NaN or inf)");
        const float s = scale_for(amax);
        vs[(l * g.heads + h) * g.tokens + t] = s;
        for (int64_t d = 0; d < g.dim; ++d) vc[t * row + h * g.dim + d] = code_for(v[d], s);
      }
  }
}

void dequantize_int8(const char* payload, int64_t tokens, int64_t begin, const KVView& dst) {
  const Layout g{dst.num_layers(), tokens, dst.kv_heads(), dst.head_dim()};
  const int64_t n = dst.tokens();
  KVB_CHECK(begin >= 0 && begin + n <= tokens,
            "int8 entry: tokens [" << begin << ", " << begin + n << ") outside [0, " << tokens
                                   << ")");
  const int64_t row = g.heads * g.dim;
  std::vector<float>& buf = scratch(static_cast<size_t>(n * row));
  float* x = buf.data();
  char* p = const_cast<char*>(payload);  // Layout's accessors are shared with the writer
  const float* ks = g.key_scales(p);
  const float* vs = g.value_scales(p);
  const int8_t* codes = g.codes(p);
  for (int64_t l = 0; l < g.layers; ++l) {
    const float* kscale = ks + l * row;
    const int8_t* kc = codes + (2 * l) * g.plane_elements() + begin * row;
    for (int64_t t = 0; t < n; ++t)
      for (int64_t j = 0; j < row; ++j) x[t * row + j] = kc[t * row + j] * kscale[j];
    store_plane(x, row, dst.dtype(), n, g.heads, g.dim, dst.plane(l, KVView::kKey));

    const int8_t* vc = codes + (2 * l + 1) * g.plane_elements() + begin * row;
    for (int64_t t = 0; t < n; ++t)
      for (int64_t h = 0; h < g.heads; ++h) {
        const float s = vs[(l * g.heads + h) * g.tokens + begin + t];
        for (int64_t d = 0; d < g.dim; ++d)
          x[t * row + h * g.dim + d] = vc[t * row + h * g.dim + d] * s;
      }
    store_plane(x, row, dst.dtype(), n, g.heads, g.dim, dst.plane(l, KVView::kValue));
  }
}

}  // namespace kvbridge::detail
