// Element conversion between the KV dtypes and float32, and the strided plane gather/scatter
// built on it: the one dtype dispatch of every float32 pass over KV (adapter conversion and
// fitting, int8 storage).
#include "src/core/dtype_convert.h"

#include <cmath>
#include <cstring>

namespace kvbridge::detail {

float fp16_to_float(uint16_t h) noexcept {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  float f;
  if (exp == 0) {
    f = std::ldexp(static_cast<float>(mant), -24);  // subnormal or zero
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u |= sign;
    std::memcpy(&f, &u, 4);
    return f;
  }
  const uint32_t u = exp == 31 ? (sign | 0x7f800000u | (mant << 13))
                               : (sign | ((exp + 112) << 23) | (mant << 13));
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t float_to_fp16(float value) noexcept {
  uint32_t u;
  std::memcpy(&u, &value, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (abs < 0x38800000u) {  // below the smallest normal half: subnormal, rounded half to even
    float a;
    std::memcpy(&a, &abs, 4);
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(a * 16777216.0f)));
  }
  uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

uint16_t float_to_fp16_saturate(float value) noexcept {
  uint32_t u;
  std::memcpy(&u, &value, 4);
  const uint32_t abs = u & 0x7fffffffu;
  // Finite, but rounds to >= 65520 (float16's infinity): the largest finite half of that sign.
  if (abs >= 0x477ff000u && abs < 0x7f800000u)
    return static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7bffu);
  return float_to_fp16(value);
}

namespace {

// es, the element size, is a template argument so that the contiguous loops vectorize.
template <int64_t es, typename Load>
void gather(const KVPlane& p, int64_t tokens, int64_t heads, int64_t dim, float* out,
            int64_t ld, const int64_t* rows, Load load) {
  const char* base = static_cast<const char*>(p.data);
#pragma omp parallel for schedule(static) if (tokens * heads * dim >= kParallelElements)
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t token = rows ? rows[t] : t;
      const char* row = base + (token * p.token_stride + h * p.head_stride) * es;
      float* o = out + t * ld + h * dim;
      if (p.dim_stride == 1) {  // the usual layout: a loop the compiler vectorizes
        for (int64_t d = 0; d < dim; ++d) o[d] = load(row + d * es);
      } else {
        for (int64_t d = 0; d < dim; ++d) o[d] = load(row + d * p.dim_stride * es);
      }
    }
}

template <int64_t es, typename Store>
void scatter(const float* in, int64_t ld, int64_t tokens, int64_t heads, int64_t dim,
             const KVPlane& p, Store store) {
  char* base = static_cast<char*>(p.data);
#pragma omp parallel for schedule(static) if (tokens * heads * dim >= kParallelElements)
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      char* row = base + (t * p.token_stride + h * p.head_stride) * es;
      const float* i = in + t * ld + h * dim;
      if (p.dim_stride == 1) {
        for (int64_t d = 0; d < dim; ++d) store(row + d * es, i[d]);
      } else {
        for (int64_t d = 0; d < dim; ++d) store(row + d * p.dim_stride * es, i[d]);
      }
    }
}

}  // namespace

void load_plane(const KVPlane& p, DType dtype, int64_t tokens, int64_t heads, int64_t dim,
                float* out, int64_t ld, const int64_t* rows) {
  switch (dtype) {
    case DType::kFloat32:
      return gather<4>(p, tokens, heads, dim, out, ld, rows, [](const char* s) {
        float f;
        std::memcpy(&f, s, 4);
        return f;
      });
    case DType::kBFloat16:
      return gather<2>(p, tokens, heads, dim, out, ld, rows, [](const char* s) {
        uint16_t b;
        std::memcpy(&b, s, 2);
        return bf16_to_float(b);
      });
    case DType::kFloat16:
      return gather<2>(p, tokens, heads, dim, out, ld, rows, [](const char* s) {
        uint16_t b;
        std::memcpy(&b, s, 2);
        return fp16_to_float(b);
      });
  }
}

void store_plane(const float* in, int64_t ld, DType dtype, int64_t tokens, int64_t heads,
                 int64_t dim, const KVPlane& p) {
  switch (dtype) {
    case DType::kFloat32:
      return scatter<4>(in, ld, tokens, heads, dim, p,
                     [](char* d, float v) { std::memcpy(d, &v, 4); });
    case DType::kBFloat16:
      return scatter<2>(in, ld, tokens, heads, dim, p, [](char* d, float v) {
        const uint16_t b = float_to_bf16_saturate(v);
        std::memcpy(d, &b, 2);
      });
    case DType::kFloat16:
      return scatter<2>(in, ld, tokens, heads, dim, p, [](char* d, float v) {
        const uint16_t b = float_to_fp16_saturate(v);
        std::memcpy(d, &b, 2);
      });
  }
}

namespace {

// True when the plane [tokens, heads, dim] holds a NaN or an infinity at token t: the exponent
// bits all set (the test is on bits, so it holds under -ffast-math too).
template <typename Bits, Bits kExponent>
bool token_nonfinite(const KVPlane& p, int64_t t, int64_t heads, int64_t dim) {
  const char* base = static_cast<const char*>(p.data);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t d = 0; d < dim; ++d) {
      Bits b;
      std::memcpy(&b, base + (t * p.token_stride + h * p.head_stride + d * p.dim_stride) *
                                 static_cast<int64_t>(sizeof(Bits)),
                  sizeof(Bits));
      if ((b & kExponent) == kExponent) return true;
    }
  return false;
}

}  // namespace

std::optional<NonFinite> find_nonfinite(const KVView& kv) {
  for (int64_t l = 0; l < kv.num_layers(); ++l)
    for (int kind = 0; kind < 2; ++kind) {
      const KVPlane& p = kv.plane(l, static_cast<KVView::Kind>(kind));
      for (int64_t t = 0; t < kv.tokens(); ++t) {
        bool bad = false;
        switch (kv.dtype()) {
          case DType::kFloat32:
            bad = token_nonfinite<uint32_t, 0x7f800000u>(p, t, kv.kv_heads(), kv.head_dim());
            break;
          case DType::kBFloat16:
            bad = token_nonfinite<uint16_t, 0x7f80u>(p, t, kv.kv_heads(), kv.head_dim());
            break;
          case DType::kFloat16:
            bad = token_nonfinite<uint16_t, 0x7c00u>(p, t, kv.kv_heads(), kv.head_dim());
            break;
        }
        if (bad) return NonFinite{l, kind, t};
      }
    }
  return std::nullopt;
}

}  // namespace kvbridge::detail
