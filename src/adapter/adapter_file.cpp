// The adapter file: safetensors with JSON metadata.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>

#include "kvbridge/adapter.h"
#include "kvbridge/error.h"
#include "src/adapter/adapter_impl.h"
#include "src/adapter/numeric.h"
#include "src/io/safetensors.h"

namespace kvbridge {
namespace {

using nlohmann::json;
constexpr const char* kFormat = "kvbridge.adapter";
constexpr const char* kFormatVersion = "1";
// Largest layer count, KV heads and head dim a file may declare: the fingerprint only proves
// the fields agree, and load sizes buffers from them before any tensor is checked.
constexpr int64_t kMaxFileDim = int64_t{1} << 16;

json spec_json(const ModelSpec& s) {
  return json{{"name", s.name},
              {"version", s.version},
              {"tokenizer", s.tokenizer},
              {"num_layers", s.num_layers},
              {"num_kv_heads", s.num_kv_heads},
              {"head_dim", s.head_dim},
              {"dtype", dtype_name(s.dtype)},
              {"rope_base", s.rope_base},
              {"rope_style", rope_style_name(s.rope_style)},
              {"rope_scaling",
               {{"type", rope_scaling_type_name(s.rope_scaling.type)},
                {"factor", s.rope_scaling.factor},
                {"low_freq_factor", s.rope_scaling.low_freq_factor},
                {"high_freq_factor", s.rope_scaling.high_freq_factor},
                {"original_max_position", s.rope_scaling.original_max_position}}},
              {"fingerprint", s.fingerprint()}};
}

// Any parse or validation failure of the metadata is a Corrupt file, not a caller error.
ModelSpec spec_from_json(const json& j, const char* what) {
  try {
    ModelSpec s;
    s.name = j.at("name").get<std::string>();
    s.version = j.at("version").get<std::string>();
    s.tokenizer = j.at("tokenizer").get<std::string>();
    s.num_layers = j.at("num_layers").get<int64_t>();
    s.num_kv_heads = j.at("num_kv_heads").get<int64_t>();
    s.head_dim = j.at("head_dim").get<int64_t>();
    s.dtype = parse_dtype(j.at("dtype").get<std::string>());
    s.rope_base = j.at("rope_base").get<double>();
    s.rope_style = parse_rope_style(j.at("rope_style").get<std::string>());
    const json& r = j.at("rope_scaling");
    s.rope_scaling.type = parse_rope_scaling_type(r.at("type").get<std::string>());
    s.rope_scaling.factor = r.at("factor").get<double>();
    s.rope_scaling.low_freq_factor = r.at("low_freq_factor").get<double>();
    s.rope_scaling.high_freq_factor = r.at("high_freq_factor").get<double>();
    s.rope_scaling.original_max_position = r.at("original_max_position").get<int64_t>();
    s.validate();
    KVB_CHECK(s.num_layers <= kMaxFileDim && s.num_kv_heads <= kMaxFileDim &&
                  s.head_dim <= kMaxFileDim,
              "layers, KV heads and head dim must be at most " << kMaxFileDim);
    KVB_CHECK(s.fingerprint() == j.at("fingerprint").get<std::string>(),
              "fingerprint does not match the fields");
    return s;
  } catch (const json::exception& e) {
    KVB_CHECK_AS(Corrupt, false, "adapter file: " << what << ": " << e.what());
  } catch (const InvalidArgument& e) {
    KVB_CHECK_AS(Corrupt, false, "adapter file: " << what << ": " << e.message());
  }
  return {};
}

json parse_json(const std::map<std::string, std::string>& meta, const char* key) {
  auto it = meta.find(key);
  KVB_CHECK_AS(Corrupt, it != meta.end(), "adapter file: metadata has no '" << key << "'");
  try {
    return json::parse(it->second);
  } catch (const json::exception& e) {
    KVB_CHECK_AS(Corrupt, false, "adapter file: metadata '" << key << "' is not JSON: " << e.what());
  }
  return {};
}

std::string tensor_name(int64_t layer, int kind, const char* part) {
  return "layers." + std::to_string(layer) + (kind == 0 ? ".key." : ".value.") + part;
}

io::StTensor f32_tensor(std::string name, const std::vector<float>& v, std::vector<int64_t> shape) {
  io::StTensor t;
  t.name = std::move(name);
  t.dtype = io::StDType::kF32;
  t.shape = std::move(shape);
  t.data.resize(v.size() * 4);
  std::memcpy(t.data.data(), v.data(), t.data.size());
  return t;
}

}  // namespace

void LinearAdapter::save(const std::string& path) const {
  const Impl& a = *impl_;
  std::vector<io::StTensor> tensors;
  json layers = json::array(), report = json::array();
  for (int64_t j = 0; j < a.target.num_layers; ++j) {
    const auto& S = a.layers[static_cast<size_t>(j)];
    layers.push_back(S);
    const int64_t features = static_cast<int64_t>(S.size()) * 2 * a.source_width();
    for (int kind = 0; kind < 2; ++kind) {
      tensors.push_back(f32_tensor(tensor_name(j, kind, "weight"),
                                   a.weights[static_cast<size_t>(j)][static_cast<size_t>(kind)],
                                   {features, a.target_width()}));
      tensors.push_back(f32_tensor(tensor_name(j, kind, "bias"),
                                   a.bias[static_cast<size_t>(j)][static_cast<size_t>(kind)],
                                   {a.target_width()}));
    }
    const LayerFit& lf = a.report.layers[static_cast<size_t>(j)];
    report.push_back({{"r2_key", lf.r2_key}, {"r2_value", lf.r2_value},
                      {"ridge_key", lf.ridge_key}, {"ridge_value", lf.ridge_value}});
  }
  const json fit = {{"layers", report},
                    {"train_tokens", a.report.train_tokens},
                    {"holdout_tokens", a.report.holdout_tokens}};
  const std::map<std::string, std::string> meta = {
      {"format", kFormat},
      {"format_version", kFormatVersion},
      {"source_spec", spec_json(a.source).dump()},
      {"target_spec", spec_json(a.target).dump()},
      {"layer_map", layers.dump()},
      {"rope_aware", a.report.rope_aware ? "true" : "false"},
      {"fit_report", fit.dump()}};
  io::write_safetensors(path, tensors, meta);
}

LinearAdapter LinearAdapter::load(const std::string& path) {
  const io::StFile file = io::read_safetensors(path);
  const auto& meta = file.metadata;
  auto get = [&](const char* key) {
    auto it = meta.find(key);
    KVB_CHECK_AS(Corrupt, it != meta.end(), "adapter file " << path << ": no '" << key << "'");
    return it->second;
  };
  KVB_CHECK_AS(Corrupt, get("format") == kFormat,
               "adapter file " << path << ": format is '" << get("format") << "', not " << kFormat);
  KVB_CHECK_AS(Corrupt, get("format_version") == kFormatVersion,
               "adapter file " << path << ": unknown format_version '" << get("format_version")
                               << "' (this library reads " << kFormatVersion << ")");
  auto a = std::make_unique<Impl>();
  a->source = spec_from_json(parse_json(meta, "source_spec"), "source_spec");
  a->target = spec_from_json(parse_json(meta, "target_spec"), "target_spec");
  a->source_inv_freq = detail::rope_inv_freq(a->source);
  a->target_inv_freq = detail::rope_inv_freq(a->target);
  const std::string rope = get("rope_aware");
  KVB_CHECK_AS(Corrupt, rope == "true" || rope == "false", "adapter file: rope_aware is '" << rope << "'");
  a->report.rope_aware = rope == "true";

  const json layers = parse_json(meta, "layer_map");
  const json fit = parse_json(meta, "fit_report");
  try {
    KVB_CHECK_AS(Corrupt, layers.is_array() && static_cast<int64_t>(layers.size()) == a->target.num_layers,
                 "adapter file: layer_map needs one list per target layer");
    const json& fit_layers = fit.at("layers");
    KVB_CHECK_AS(Corrupt, fit_layers.is_array() && fit_layers.size() == layers.size(),
                 "adapter file: fit_report.layers needs one entry per target layer");
    a->report.train_tokens = fit.at("train_tokens").get<int64_t>();
    a->report.holdout_tokens = fit.at("holdout_tokens").get<int64_t>();
    for (size_t j = 0; j < layers.size(); ++j) {
      std::vector<int64_t> S = layers[j].get<std::vector<int64_t>>();
      KVB_CHECK_AS(Corrupt, !S.empty() && std::is_sorted(S.begin(), S.end()) &&
                                std::adjacent_find(S.begin(), S.end()) == S.end(),
                   "adapter file: layer_map[" << j << "] must be a non-empty ascending list");
      for (int64_t l : S)
        KVB_CHECK_AS(Corrupt, l >= 0 && l < a->source.num_layers,
                     "adapter file: layer_map[" << j << "] names source layer " << l);
      LayerFit lf;
      lf.source_layers = S;
      lf.r2_key = fit_layers[j].at("r2_key").get<double>();
      lf.r2_value = fit_layers[j].at("r2_value").get<double>();
      lf.ridge_key = fit_layers[j].at("ridge_key").get<double>();
      lf.ridge_value = fit_layers[j].at("ridge_value").get<double>();
      a->report.layers.push_back(lf);
      a->layers.push_back(std::move(S));
    }
  } catch (const json::exception& e) {
    KVB_CHECK_AS(Corrupt, false, "adapter file: layer_map or fit_report: " << e.what());
  }

  size_t used = 0;
  for (int64_t j = 0; j < a->target.num_layers; ++j) {
    const int64_t features =
        static_cast<int64_t>(a->layers[static_cast<size_t>(j)].size()) * 2 * a->source_width();
    std::array<std::vector<float>, 2> w, b;
    for (int kind = 0; kind < 2; ++kind)
      for (int part = 0; part < 2; ++part) {
        const std::string name = tensor_name(j, kind, part == 0 ? "weight" : "bias");
        auto it = file.tensors.find(name);
        KVB_CHECK_AS(Corrupt, it != file.tensors.end(), "adapter file: tensor " << name << " missing");
        const io::StTensor& t = it->second;
        const std::vector<int64_t> want =
            part == 0 ? std::vector<int64_t>{features, a->target_width()}
                      : std::vector<int64_t>{a->target_width()};
        KVB_CHECK_AS(Corrupt, t.dtype == io::StDType::kF32 && t.shape == want,
                     "adapter file: tensor " << name << " must be F32 of the layer map's shape");
        std::vector<float>& dst = (part == 0 ? w : b)[static_cast<size_t>(kind)];
        dst.resize(t.data.size() / 4);
        std::memcpy(dst.data(), t.data.data(), t.data.size());
        for (float v : dst)
          KVB_CHECK_AS(Corrupt, std::isfinite(v), "adapter file: tensor " << name << " is not finite");
        ++used;
      }
    a->weights.push_back(std::move(w));
    a->bias.push_back(std::move(b));
  }
  KVB_CHECK_AS(Corrupt, used == file.tensors.size(),
               "adapter file: " << file.tensors.size() - used << " tensors the layer map does not use");
  return LinearAdapter(std::move(a));
}

}  // namespace kvbridge
