#include <cmath>
#include <cstring>

#include "kvbridge/error.h"
#include "src/adapter/numeric.h"

namespace kvbridge::detail {

std::vector<double> rope_inv_freq(const ModelSpec& spec) {
  const int64_t half = spec.head_dim / 2;
  std::vector<double> inv(static_cast<size_t>(half));
  const RopeScaling& s = spec.rope_scaling;
  const double pi = 3.14159265358979323846;
  for (int64_t i = 0; i < half; ++i) {
    double f = 1.0 / std::pow(spec.rope_base, static_cast<double>(2 * i) / spec.head_dim);
    if (s.type == RopeScaling::Type::kLinear) {
      f /= s.factor;
    } else if (s.type == RopeScaling::Type::kLlama3) {
      const double wavelen = 2 * pi / f;
      const double low_wavelen = s.original_max_position / s.low_freq_factor;
      const double high_wavelen = s.original_max_position / s.high_freq_factor;
      if (wavelen > low_wavelen) {
        f /= s.factor;
      } else if (wavelen >= high_wavelen) {
        const double smooth = (s.original_max_position / wavelen - s.low_freq_factor) /
                              (s.high_freq_factor - s.low_freq_factor);
        f = (1 - smooth) * f / s.factor + smooth * f;
      }
    }
    inv[static_cast<size_t>(i)] = f;
  }
  return inv;
}

namespace {
template <typename T>
void rope_impl(const ModelSpec& spec, const std::vector<double>& inv_freq, int64_t start_pos,
               bool inverse, int64_t tokens, int64_t heads, T* x, int64_t ld) {
  const int64_t dim = spec.head_dim, half = dim / 2;
  const bool interleaved = spec.rope_style == RopeStyle::kInterleaved;
#pragma omp parallel if (tokens * heads * dim >= kParallelElements)
  {
  std::vector<T> cs(static_cast<size_t>(half)), sn(static_cast<size_t>(half));
#pragma omp for schedule(static)
  for (int64_t t = 0; t < tokens; ++t) {
    const double pos = static_cast<double>(start_pos + t);
    for (int64_t i = 0; i < half; ++i) {
      const double angle = pos * inv_freq[static_cast<size_t>(i)];  // angles in float64
      cs[static_cast<size_t>(i)] = static_cast<T>(std::cos(angle));
      sn[static_cast<size_t>(i)] = static_cast<T>(inverse ? -std::sin(angle) : std::sin(angle));
    }
    for (int64_t h = 0; h < heads; ++h) {
      T* v = x + t * ld + h * dim;
      for (int64_t i = 0; i < half; ++i) {
        T& a = interleaved ? v[2 * i] : v[i];
        T& b = interleaved ? v[2 * i + 1] : v[i + half];
        const T c = cs[static_cast<size_t>(i)], s = sn[static_cast<size_t>(i)];
        const T a0 = a, b0 = b;
        a = a0 * c - b0 * s;
        b = b0 * c + a0 * s;
      }
    }
  }
  }
}
}  // namespace

void apply_rope(const ModelSpec& spec, const std::vector<double>& inv_freq, int64_t start_pos,
                bool inverse, int64_t tokens, int64_t heads, float* x, int64_t ld) {
  rope_impl(spec, inv_freq, start_pos, inverse, tokens, heads, x, ld);
}
void apply_rope(const ModelSpec& spec, const std::vector<double>& inv_freq, int64_t start_pos,
                bool inverse, int64_t tokens, int64_t heads, double* x, int64_t ld) {
  rope_impl(spec, inv_freq, start_pos, inverse, tokens, heads, x, ld);
}

}  // namespace kvbridge::detail
