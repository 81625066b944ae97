// A LinearAdapter with seeded random weights and any layer map, for the CUDA tests and the CUDA
// benchmark: written as an adapter file (the format of LinearAdapter::save) and loaded, so no fit
// is needed and the geometry can be as large as the benchmark's.
#pragma once

#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kvbridge/kvbridge.h"
#include "src/io/safetensors.h"

namespace kvbridge::testing {

/// Uniform in [-1, 1), from a splitmix64 stream (fast enough for GiB of weights).
class UniformStream {
 public:
  explicit UniformStream(uint64_t seed) : state_(seed) {}
  float next() {
    uint64_t x = (state_ += 0x9e3779b97f4a7c15ull);
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    x ^= x >> 31;
    return static_cast<float>(x >> 40) * 0x1p-23f - 1.f;
  }

 private:
  uint64_t state_;
};

inline nlohmann::json rope_scaling_json(const RopeScaling& r) {
  return {{"type", rope_scaling_type_name(r.type)},
          {"factor", r.factor},
          {"low_freq_factor", r.low_freq_factor},
          {"high_freq_factor", r.high_freq_factor},
          {"original_max_position", r.original_max_position}};
}

inline nlohmann::json adapter_spec_json(const ModelSpec& s) {
  nlohmann::json j = {{"name", s.name},
          {"version", s.version},
          {"tokenizer", s.tokenizer},
          {"num_layers", s.num_layers},
          {"num_kv_heads", s.num_kv_heads},
          {"head_dim", s.head_dim},
          {"dtype", dtype_name(s.dtype)},
          {"rope_base", s.rope_base},
          {"rope_style", rope_style_name(s.rope_style)},
          {"rope_scaling", rope_scaling_json(s.rope_scaling)},
          {"fingerprint", s.fingerprint()}};
  // Written only when present, as LinearAdapter::save does.
  if (!s.layer_attention.empty()) {
    nlohmann::json layers = nlohmann::json::array();
    for (const LayerAttention& a : s.layer_attention)
      layers.push_back({{"rope_base", a.rope_base},
                        {"rope_scaling", rope_scaling_json(a.rope_scaling)},
                        {"sliding_window", a.sliding_window}});
    j["layer_attention"] = layers;
  }
  return j;
}

/// Weights uniform with variance weight_scale^2 / features (outputs of the order of
/// weight_scale * input), biases uniform in [-bias_scale, bias_scale). layers[j]: target layer
/// j's source layers, ascending.
inline LinearAdapter make_random_adapter(const ModelSpec& source, const ModelSpec& target,
                                         const std::vector<std::vector<int64_t>>& layers,
                                         bool rope_aware, uint64_t seed, float weight_scale = 1.f,
                                         float bias_scale = 0.5f) {
  static std::atomic<int> counter{0};
  const int64_t sw = source.num_kv_heads * source.head_dim;
  const int64_t tw = target.num_kv_heads * target.head_dim;
  UniformStream rng(seed);
  std::vector<io::StTensor> tensors;
  nlohmann::json fit_layers = nlohmann::json::array();
  for (size_t j = 0; j < layers.size(); ++j) {
    const int64_t features = static_cast<int64_t>(layers[j].size()) * 2 * sw;
    const float w_range = weight_scale * std::sqrt(3.f / static_cast<float>(features));
    for (const char* kind : {"key", "value"})
      for (const char* part : {"weight", "bias"}) {
        const bool weight = std::strcmp(part, "weight") == 0;
        io::StTensor t;
        t.name = "layers." + std::to_string(j) + "." + kind + "." + part;
        t.dtype = io::StDType::kF32;
        t.shape = weight ? std::vector<int64_t>{features, tw} : std::vector<int64_t>{tw};
        std::vector<float> v(static_cast<size_t>(weight ? features * tw : tw));
        for (float& x : v) x = rng.next() * (weight ? w_range : bias_scale);
        t.data.resize(v.size() * 4);
        std::memcpy(t.data.data(), v.data(), t.data.size());
        tensors.push_back(std::move(t));
      }
    fit_layers.push_back({{"r2_key", 0.0}, {"r2_value", 0.0}, {"ridge_key", 0.0},
                          {"ridge_value", 0.0}});
  }
  const std::map<std::string, std::string> meta = {
      {"format", "kvbridge.adapter"},
      {"format_version", "1"},
      {"source_spec", adapter_spec_json(source).dump()},
      {"target_spec", adapter_spec_json(target).dump()},
      {"layer_map", nlohmann::json(layers).dump()},
      {"rope_aware", rope_aware ? "true" : "false"},
      {"fit_report",
       nlohmann::json{{"layers", fit_layers}, {"train_tokens", 0}, {"holdout_tokens", 0}}.dump()}};
  const std::filesystem::path path =
      std::filesystem::temp_directory_path() /
      ("kvbridge-random-adapter-" + std::to_string(getpid()) + "-" + std::to_string(counter++) +
       ".safetensors");
  io::write_safetensors(path.string(), tensors, meta);
  tensors.clear();
  // Written without a checksum (format 1), which load refuses unless asked to accept it.
  AdapterLoadOptions options;
  options.allow_unchecked = true;
  LinearAdapter adapter = LinearAdapter::load(path.string(), options);
  std::filesystem::remove(path);
  return adapter;
}

}  // namespace kvbridge::testing
