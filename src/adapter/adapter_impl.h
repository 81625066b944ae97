// State shared by the fitter and the adapter.
#pragma once

#include <array>
#include <vector>

#include "kvbridge/adapter.h"

namespace kvbridge {

struct LinearAdapter::Impl {
  ModelSpec source, target;
  FitReport report;
  std::vector<double> source_inv_freq, target_inv_freq;
  /// Per target layer: source layers (ascending), and for K (0) and V (1) the weights
  /// [features, outputs] row-major and bias [outputs].
  std::vector<std::vector<int64_t>> layers;
  std::vector<std::array<std::vector<float>, 2>> weights, bias;

  int64_t source_width() const { return source.num_kv_heads * source.head_dim; }
  int64_t target_width() const { return target.num_kv_heads * target.head_dim; }
};

/// Checks that a source/target view pair fits the specs (shared by the fitter and the adapter).
void check_pair(const ModelSpec& source, const ModelSpec& target, const KVView& src,
                const KVView& dst, const char* src_name, const char* dst_name);

}  // namespace kvbridge
