// Internal numeric helpers of the adapter: RoPE and position checks. Element conversion and the
// float32 plane gather/scatter (the one dtype dispatch) are core's, src/core/dtype_convert.h.
#pragma once

#include <cstdint>
#include <vector>

#include "kvbridge/error.h"
#include "kvbridge/kv_view.h"
#include "kvbridge/model_spec.h"
#include "src/core/dtype_convert.h"

namespace kvbridge::detail {

/// Inverse frequencies (head_dim / 2 of them) of one layer's RoPE after its scaling, in float64.
std::vector<double> rope_inv_freq(const LayerAttention& attention, int64_t head_dim);
/// Layer `layer`'s inverse frequencies (spec.layer(layer)).
std::vector<double> rope_inv_freq(const ModelSpec& spec, int64_t layer);

/// A spec's inverse frequencies for every layer, each distinct set once (Gemma 3's 18 layers have
/// two), so that converts compute one table of angles per set, not per layer.
struct LayerInvFreq {
  std::vector<std::vector<double>> sets;  ///< distinct sets, in order of first use
  std::vector<int64_t> set_of;            ///< per layer: its index into sets
  /// Layer l's set: its index into sets.
  size_t set(int64_t l) const { return static_cast<size_t>(set_of[static_cast<size_t>(l)]); }
  /// Layer l's inverse frequencies.
  const std::vector<double>& operator[](int64_t l) const { return sets[set(l)]; }
  int64_t num_sets() const { return static_cast<int64_t>(sets.size()); }
};
/// Every layer's inverse frequencies of `spec` (valid).
LayerInvFreq layer_inv_freq(const ModelSpec& spec);

/// Largest absolute position a RoPE angle is computed for: positions are exact in double up to
/// 2^53, so start_pos + tokens must not pass it (nor overflow int64).
constexpr int64_t kMaxPosition = int64_t{1} << 53;
/// The one check of a token range [start_pos, start_pos + tokens): InvalidArgument unless
/// start_pos >= 0 and start_pos + tokens <= kMaxPosition.
inline void check_positions(int64_t start_pos, int64_t tokens) {
  KVB_CHECK(start_pos >= 0, "start_pos must be >= 0, got " << start_pos);
  KVB_CHECK(start_pos <= kMaxPosition - tokens,
            "start_pos " << start_pos << " + " << tokens
                         << " tokens passes the largest position 2^53");
}

/// cos and sin of the RoPE angles of `tokens` consecutive positions, computed in float64 and
/// rounded to T: row t (position start_pos + t) holds head_dim / 2 of each, row-major.
template <typename T>
struct RopeTable {
  int64_t tokens = 0, half = 0;
  std::vector<T> cos, sin;
};
/// Fills `table` (reusing its storage) for positions start_pos + t, t < tokens, or
/// start_pos + offsets[t] when offsets (`tokens` of them) is given.
void rope_table(const std::vector<double>& inv_freq, int64_t start_pos, int64_t tokens,
                RopeTable<float>& table, const int64_t* offsets = nullptr);
void rope_table(const std::vector<double>& inv_freq, int64_t start_pos, int64_t tokens,
                RopeTable<double>& table, const int64_t* offsets = nullptr);

/// Rotates (inverse = false) or un-rotates (inverse = true) keys in place with the angles of
/// `table`: rows of `x` are its tokens (table.tokens of them), each `heads` heads of
/// `spec.head_dim` (= 2 * table.half), row stride ld.
void apply_rope(const ModelSpec& spec, const RopeTable<float>& table, bool inverse,
                int64_t heads, float* x, int64_t ld);
void apply_rope(const ModelSpec& spec, const RopeTable<double>& table, bool inverse,
                int64_t heads, double* x, int64_t ld);

/// As above for tokens at absolute positions start_pos + t (start_pos + offsets[t] when offsets
/// is given), the angles computed on the way.
void apply_rope(const ModelSpec& spec, const std::vector<double>& inv_freq, int64_t start_pos,
                bool inverse, int64_t tokens, int64_t heads, float* x, int64_t ld,
                const int64_t* offsets = nullptr);
/// float64 version, the reference for tests.
void apply_rope(const ModelSpec& spec, const std::vector<double>& inv_freq, int64_t start_pos,
                bool inverse, int64_t tokens, int64_t heads, double* x, int64_t ld,
                const int64_t* offsets = nullptr);

}  // namespace kvbridge::detail
