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

/// Inverse frequencies (head_dim / 2 of them) after the spec's rope_scaling, in float64.
std::vector<double> rope_inv_freq(const ModelSpec& spec);

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

/// Rotates (inverse = false) or un-rotates (inverse = true) keys in place: rows of `x` are tokens
/// at absolute positions start_pos + t, each `heads` heads of `spec.head_dim`, row stride ld.
void apply_rope(const ModelSpec& spec, const std::vector<double>& inv_freq, int64_t start_pos,
                bool inverse, int64_t tokens, int64_t heads, float* x, int64_t ld);
/// float64 version, the reference for tests.
void apply_rope(const ModelSpec& spec, const std::vector<double>& inv_freq, int64_t start_pos,
                bool inverse, int64_t tokens, int64_t heads, double* x, int64_t ld);

}  // namespace kvbridge::detail
