#include <algorithm>
#include <cmath>
#include <cstring>

#include "kvbridge/error.h"
#include "src/adapter/numeric.h"

namespace kvbridge::detail {

std::vector<double> rope_inv_freq(const LayerAttention& attention, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  std::vector<double> inv(static_cast<size_t>(half));
  const RopeScaling& s = attention.rope_scaling;
  const double pi = 3.14159265358979323846;
  for (int64_t i = 0; i < half; ++i) {
    double f = 1.0 / std::pow(attention.rope_base, static_cast<double>(2 * i) / head_dim);
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

std::vector<double> rope_inv_freq(const ModelSpec& spec, int64_t layer) {
  return rope_inv_freq(spec.layer(layer), spec.head_dim);
}

LayerInvFreq layer_inv_freq(const ModelSpec& spec) {
  LayerInvFreq out;
  out.set_of.reserve(static_cast<size_t>(spec.num_layers));
  for (int64_t l = 0; l < spec.num_layers; ++l) {
    // Layers whose attention differs only in its window share a set; so do different RoPE
    // settings that happen to give the same frequencies.
    std::vector<double> inv = rope_inv_freq(spec, l);
    const auto it = std::find(out.sets.begin(), out.sets.end(), inv);
    out.set_of.push_back(static_cast<int64_t>(it - out.sets.begin()));
    if (it == out.sets.end()) out.sets.push_back(std::move(inv));
  }
  return out;
}

namespace {
template <typename T>
void fill_rope_table(const std::vector<double>& inv_freq, int64_t start_pos, int64_t tokens,
                     RopeTable<T>& table, const int64_t* offsets) {
  const int64_t half = static_cast<int64_t>(inv_freq.size());
  table.tokens = tokens;
  table.half = half;
  table.cos.resize(static_cast<size_t>(tokens * half));
  table.sin.resize(static_cast<size_t>(tokens * half));
#pragma omp parallel for schedule(static) if (tokens * half >= kParallelElements / 8)
  for (int64_t t = 0; t < tokens; ++t) {
    const double pos = static_cast<double>(start_pos + (offsets ? offsets[t] : t));
    for (int64_t i = 0; i < half; ++i) {
      const double angle = pos * inv_freq[static_cast<size_t>(i)];  // angles in float64
      table.cos[static_cast<size_t>(t * half + i)] = static_cast<T>(std::cos(angle));
      table.sin[static_cast<size_t>(t * half + i)] = static_cast<T>(std::sin(angle));
    }
  }
}

template <typename T>
void rope_impl(const ModelSpec& spec, const RopeTable<T>& table, bool inverse, int64_t heads,
               T* x, int64_t ld) {
  const int64_t dim = spec.head_dim, half = dim / 2, tokens = table.tokens;
  KVB_CHECK(table.half == half, "RoPE table of " << table.half << " angles for head_dim " << dim);
  const bool interleaved = spec.rope_style == RopeStyle::kInterleaved;
  const T sign = inverse ? T(-1) : T(1);
#pragma omp parallel for schedule(static) if (tokens * heads * dim >= kParallelElements)
  for (int64_t t = 0; t < tokens; ++t) {
    const T* cs = table.cos.data() + t * half;
    const T* sn = table.sin.data() + t * half;
    for (int64_t h = 0; h < heads; ++h) {
      T* v = x + t * ld + h * dim;
      for (int64_t i = 0; i < half; ++i) {
        T& a = interleaved ? v[2 * i] : v[i];
        T& b = interleaved ? v[2 * i + 1] : v[i + half];
        const T c = cs[i], s = sign * sn[i];
        const T a0 = a, b0 = b;
        a = a0 * c - b0 * s;
        b = b0 * c + a0 * s;
      }
    }
  }
}

// Positions in blocks of this many tokens, so the table stays small.
constexpr int64_t kRopeBlockTokens = 1024;

template <typename T>
void rope_positions(const ModelSpec& spec, const std::vector<double>& inv_freq,
                    int64_t start_pos, bool inverse, int64_t tokens, int64_t heads, T* x,
                    int64_t ld, const int64_t* offsets) {
  RopeTable<T> table;
  for (int64_t t0 = 0; t0 < tokens; t0 += kRopeBlockTokens) {
    const int64_t n = std::min(kRopeBlockTokens, tokens - t0);
    if (offsets) {
      fill_rope_table(inv_freq, start_pos, n, table, offsets + t0);
    } else {
      fill_rope_table(inv_freq, start_pos + t0, n, table, nullptr);
    }
    rope_impl(spec, table, inverse, heads, x + t0 * ld, ld);
  }
}
}  // namespace

void rope_table(const std::vector<double>& inv_freq, int64_t start_pos, int64_t tokens,
                RopeTable<float>& table, const int64_t* offsets) {
  fill_rope_table(inv_freq, start_pos, tokens, table, offsets);
}
void rope_table(const std::vector<double>& inv_freq, int64_t start_pos, int64_t tokens,
                RopeTable<double>& table, const int64_t* offsets) {
  fill_rope_table(inv_freq, start_pos, tokens, table, offsets);
}

void apply_rope(const ModelSpec& spec, const RopeTable<float>& table, bool inverse,
                int64_t heads, float* x, int64_t ld) {
  rope_impl(spec, table, inverse, heads, x, ld);
}
void apply_rope(const ModelSpec& spec, const RopeTable<double>& table, bool inverse,
                int64_t heads, double* x, int64_t ld) {
  rope_impl(spec, table, inverse, heads, x, ld);
}

void apply_rope(const ModelSpec& spec, const std::vector<double>& inv_freq, int64_t start_pos,
                bool inverse, int64_t tokens, int64_t heads, float* x, int64_t ld,
                const int64_t* offsets) {
  rope_positions(spec, inv_freq, start_pos, inverse, tokens, heads, x, ld, offsets);
}
void apply_rope(const ModelSpec& spec, const std::vector<double>& inv_freq, int64_t start_pos,
                bool inverse, int64_t tokens, int64_t heads, double* x, int64_t ld,
                const int64_t* offsets) {
  rope_positions(spec, inv_freq, start_pos, inverse, tokens, heads, x, ld, offsets);
}

}  // namespace kvbridge::detail
