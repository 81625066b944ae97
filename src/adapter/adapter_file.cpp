// The adapter file: safetensors with JSON metadata and a content checksum (docs/adapter_file.md).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <type_traits>
#include <nlohmann/json.hpp>

#include "kvbridge/adapter.h"
#include "kvbridge/align.h"
#include "kvbridge/error.h"
#include "src/adapter/adapter_impl.h"
#include "src/adapter/numeric.h"
#include "src/adapter/serving.h"
#include "src/core/byte_order.h"
#include "src/core/xxh3.h"
#include "src/io/safetensors.h"

namespace kvbridge {
namespace {

using nlohmann::json;
constexpr const char* kFormat = "kvbridge.adapter";
constexpr const char* kFormatVersion = "2";
// Version 3: version 2 plus "alignment_policy", written only for adapters between tokenizers
// (the others keep writing version 2, so their files and fingerprints are unchanged and older
// readers, which refuse version 3, cannot use an aligned adapter without its alignment).
constexpr const char* kAlignedVersion = "3";
constexpr const char* kUncheckedVersion = "1";  // the format before the checksum
constexpr const char* kAlignmentPolicyKey = "alignment_policy";
constexpr const char* kChecksumKey = "checksum";
constexpr char kChecksumTag[] = "kvbridge.adapter.checksum";

// A spec field as JSON (enums by name) and back.
json field_json(const std::string& v) { return v; }
json field_json(int64_t v) { return v; }
json field_json(double v) { return v; }
json field_json(DType v) { return dtype_name(v); }
json field_json(RopeStyle v) { return rope_style_name(v); }
json field_json(RopeScaling::Type v) { return rope_scaling_type_name(v); }
void field_from(const json& j, std::string* v) { *v = j.get<std::string>(); }
void field_from(const json& j, int64_t* v) { *v = j.get<int64_t>(); }
void field_from(const json& j, double* v) { *v = j.get<double>(); }
void field_from(const json& j, DType* v) { *v = parse_dtype(j.get<std::string>()); }
void field_from(const json& j, RopeStyle* v) { *v = parse_rope_style(j.get<std::string>()); }
void field_from(const json& j, RopeScaling::Type* v) {
  *v = parse_rope_scaling_type(j.get<std::string>());
}

// A struct field as a JSON object of its own fields, layer_attention as an array of them.
template <class T>
json value_json(const T& value) {
  if constexpr (std::is_same_v<T, RopeScaling> || std::is_same_v<T, LayerAttention>) {
    json r = json::object();
    auto put = [&](const char* k, const auto& v) { r[k] = value_json(v); };
    if constexpr (std::is_same_v<T, RopeScaling>) {
      for_each_rope_scaling_field(put, value);
    } else {
      for_each_layer_attention_field(put, value);
    }
    return r;
  } else if constexpr (std::is_same_v<T, std::vector<LayerAttention>>) {
    json r = json::array();
    for (const LayerAttention& a : value) r.push_back(value_json(a));
    return r;
  } else {
    return field_json(value);
  }
}

// The inverse of value_json; a missing field or a wrong JSON type throws json::exception.
template <class T>
void value_from(const json& j, T* value) {
  if constexpr (std::is_same_v<T, RopeScaling> || std::is_same_v<T, LayerAttention>) {
    auto get = [&](const char* k, auto& v) { value_from(j.at(k), &v); };
    if constexpr (std::is_same_v<T, RopeScaling>) {
      for_each_rope_scaling_field(get, *value);
    } else {
      for_each_layer_attention_field(get, *value);
    }
  } else if constexpr (std::is_same_v<T, std::vector<LayerAttention>>) {
    KVB_CHECK(j.is_array(), "layer_attention is not a list");
    value->resize(j.size());
    for (size_t i = 0; i < j.size(); ++i) value_from(j[i], &(*value)[i]);
  } else {
    field_from(j, value);
  }
}

// Every field of ModelSpec (for_each_spec_field), rope_scaling as an object of its own;
// layer_attention, a list of such objects, only when not empty, so files of specs without
// per-layer attention are written (and checksummed) exactly as before it existed. A reader
// without it ignores the key, and the spec's fingerprint then does not match: it refuses the file.
json spec_json(const ModelSpec& s) {
  json j = json::object();
  for_each_spec_field(
      [&](const char* key, const auto& value) {
        if constexpr (std::is_same_v<std::decay_t<decltype(value)>, std::vector<LayerAttention>>)
          if (value.empty()) return;
        j[key] = value_json(value);
      },
      s);
  j["fingerprint"] = s.fingerprint();
  return j;
}

// Any parse or validation failure of the metadata is a Corrupt file, not a caller error.
ModelSpec spec_from_json(const json& j, const char* what) {
  try {
    ModelSpec s;
    for_each_spec_field(
        [&](const char* key, auto& value) {
          // Files without per-layer attention (every file before it) have no layer_attention.
          if constexpr (std::is_same_v<std::decay_t<decltype(value)>,
                                       std::vector<LayerAttention>>)
            if (!j.contains(key)) return;
          value_from(j.at(key), &value);
        },
        s);
    s.validate();  // bounds layers, KV heads and head dim (load sizes buffers from them)
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
std::string key_norm_name(int64_t layer) {
  return "layers." + std::to_string(layer) + ".key_norm";
}
constexpr char kTokenCodesName[] = "token_codes";
constexpr char kTokenContextKey[] = "token_context";


// A tensor as the checksum sees it: shape and raw little-endian bytes.
struct TensorBytes {
  std::vector<int64_t> shape;
  const void* data;
  size_t bytes;
};

// XXH3-128 over the tag, every metadata (key, value) but the checksum in key order, then every
// tensor (name, shape, bytes) in name order; each string and byte run is preceded by its length
// as u64 little-endian. Metadata values are hashed as stored, so the JSON of the specs, layer map
// and fit report is covered byte for byte, and key names bind each spec to its role (source or
// target): swapping them changes the checksum.
Hash128 content_checksum(const std::map<std::string, std::string>& meta,
                         const std::map<std::string, TensorBytes>& tensors) {
  detail::Xxh3Stream h;
  auto u64 = [&](uint64_t v) {
    unsigned char b[8];
    detail::store_le64(b, v);
    h.update(b, 8);
  };
  auto bytes = [&](const void* data, size_t n) {
    u64(n);
    h.update(data, n);
  };
  h.update(kChecksumTag, sizeof kChecksumTag - 1);
  for (const auto& [key, value] : meta) {
    if (key == kChecksumKey) continue;
    bytes(key.data(), key.size());
    bytes(value.data(), value.size());
  }
  for (const auto& [name, t] : tensors) {
    bytes(name.data(), name.size());
    u64(t.shape.size());
    for (int64_t d : t.shape) u64(static_cast<uint64_t>(d));
    bytes(t.data, t.bytes);
  }
  return h.digest();
}

// The metadata save() writes, without the checksum.
std::map<std::string, std::string> file_metadata(const LinearAdapter::Impl& a) {
  json layers = json::array(), report = json::array();
  for (int64_t j = 0; j < a.target.num_layers; ++j) {
    layers.push_back(a.layers[static_cast<size_t>(j)]);
    const LayerFit& lf = a.report.layers[static_cast<size_t>(j)];
    json entry = {{"r2_key", lf.r2_key}, {"r2_value", lf.r2_value},
                  {"ridge_key", lf.ridge_key}, {"ridge_value", lf.ridge_value}};
    // The token codes' ridges where a map has that term (NaN, none, is left out).
    if (std::isfinite(lf.token_ridge_key)) entry["token_ridge_key"] = lf.token_ridge_key;
    if (std::isfinite(lf.token_ridge_value)) entry["token_ridge_value"] = lf.token_ridge_value;
    // kAuto's steps, only where there are any: files of other fits stay byte for byte as before.
    if (!lf.selection.empty()) {
      json steps = json::array();
      for (const SelectionStep& st : lf.selection)
        steps.push_back({{"source_layer", st.source_layer}, {"r2_key", st.r2_key},
                         {"r2_value", st.r2_value}, {"screen", st.screen},
                         {"accepted", st.accepted}});
      entry["selection"] = std::move(steps);
    }
    report.push_back(std::move(entry));
  }
  const json fit = {{"layers", report},
                    {"train_tokens", a.report.train_tokens},
                    {"holdout_tokens", a.report.holdout_tokens}};
  std::map<std::string, std::string> meta = {
      {"format", kFormat},
      {"format_version", kFormatVersion},
      {"source_spec", spec_json(a.source).dump()},
      {"target_spec", spec_json(a.target).dump()},
      {"layer_map", layers.dump()},
      {"rope_aware", a.report.rope_aware ? "true" : "false"},
      {"fit_report", fit.dump()}};
  if (!a.report.alignment_policy.empty()) {
    meta["format_version"] = kAlignedVersion;
    meta[kAlignmentPolicyKey] = a.report.alignment_policy;
  }
  if (!a.token_codes.empty()) meta[kTokenContextKey] = std::to_string(a.token_context);
  return meta;
}

// The adapter's tensors by file name, viewing its weights (no copy).
std::map<std::string, TensorBytes> file_tensors(const LinearAdapter::Impl& a) {
  std::map<std::string, TensorBytes> out;
  for (int64_t j = 0; j < a.target.num_layers; ++j) {
    const auto& S = a.layers[static_cast<size_t>(j)];
    const int64_t features = static_cast<int64_t>(S.size()) * 2 * a.source_width();
    for (int kind = 0; kind < 2; ++kind) {
      const std::vector<float>& w = a.weights[static_cast<size_t>(j)][static_cast<size_t>(kind)];
      const std::vector<float>& b = a.bias[static_cast<size_t>(j)][static_cast<size_t>(kind)];
      out[tensor_name(j, kind, "weight")] = {{features, a.target_width()}, w.data(), 4 * w.size()};
      out[tensor_name(j, kind, "bias")] = {{a.target_width()}, b.data(), 4 * b.size()};
    }
    if (!a.key_norm.empty()) {
      const std::vector<float>& g = a.key_norm[static_cast<size_t>(j)];
      out[key_norm_name(j)] = {{a.target.head_dim}, g.data(), 4 * g.size()};
    }
    for (int kind = 0; kind < 2 && !a.token_codes.empty(); ++kind) {
      const std::vector<float>& w =
          a.token_weights[static_cast<size_t>(j)][static_cast<size_t>(kind)];
      if (!w.empty())
        out[tensor_name(j, kind, "token_weight")] = {
            {a.token_context * a.token_codes.dims, a.target_width()}, w.data(), 4 * w.size()};
    }
  }
  if (!a.token_codes.empty())
    out[kTokenCodesName] = {{a.token_codes.vocab, a.token_codes.dims},
                            a.token_codes.values.data(), 4 * a.token_codes.values.size()};
  return out;
}

// A fit-report number, named in the error when it is missing, not a number or out of range.
double report_number(const json& j, const char* key, size_t layer) {
  const auto it = j.find(key);
  KVB_CHECK_AS(Corrupt, it != j.end() && it->is_number(),
               "adapter file: fit_report.layers[" << layer << "]." << key << " is not a number");
  return it->get<double>();
}

int64_t report_count(const json& j, const char* key) {
  const auto it = j.find(key);
  // JSON integers >= 0 parse as unsigned; negative ones and fractions do not.
  constexpr auto kMax = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  KVB_CHECK_AS(Corrupt, it != j.end() && it->is_number_unsigned() && it->get<uint64_t>() <= kMax,
               "adapter file: fit_report." << key << " must be an integer >= 0");
  return it->get<int64_t>();
}

// The report's ranges: R² finite and at most 1 (1 - SSE/SST with SSE >= 0), ridge finite and >= 0.
LayerFit report_layer(const json& j, size_t layer) {
  LayerFit lf;
  for (auto [key, out] : {std::pair<const char*, double*>{"r2_key", &lf.r2_key},
                          {"r2_value", &lf.r2_value}}) {
    *out = report_number(j, key, layer);
    KVB_CHECK_AS(Corrupt, std::isfinite(*out) && *out <= 1,
                 "adapter file: fit_report.layers[" << layer << "]." << key << " is " << *out
                                                    << ", not a finite R² <= 1");
  }
  for (auto [key, out] : {std::pair<const char*, double*>{"ridge_key", &lf.ridge_key},
                          {"ridge_value", &lf.ridge_value}}) {
    *out = report_number(j, key, layer);
    KVB_CHECK_AS(Corrupt, std::isfinite(*out) && *out >= 0,
                 "adapter file: fit_report.layers[" << layer << "]." << key << " is " << *out
                                                    << ", not a finite ridge >= 0");
  }
  for (auto [key, out] : {std::pair<const char*, double*>{"token_ridge_key", &lf.token_ridge_key},
                          {"token_ridge_value", &lf.token_ridge_value}}) {
    if (!j.contains(key)) continue;  // no token codes' term for that map
    *out = report_number(j, key, layer);
    KVB_CHECK_AS(Corrupt, std::isfinite(*out) && *out >= 0,
                 "adapter file: fit_report.layers[" << layer << "]." << key << " is " << *out
                                                    << ", not a finite ridge >= 0");
  }
  return lf;
}

// kAuto's selection steps of one report layer (optional: files before them have none).
std::vector<SelectionStep> report_selection(const json& j, size_t layer, int64_t source_layers) {
  std::vector<SelectionStep> out;
  const auto it = j.find("selection");
  if (it == j.end()) return out;
  KVB_CHECK_AS(Corrupt, it->is_array(),
               "adapter file: fit_report.layers[" << layer << "].selection is not a list");
  for (const json& e : *it) {
    SelectionStep st;
    const auto l = e.is_object() ? e.find("source_layer") : e.end();
    const auto acc = e.is_object() ? e.find("accepted") : e.end();
    KVB_CHECK_AS(Corrupt,
                 l != e.end() && l->is_number_integer() && l->get<int64_t>() >= 0 &&
                     l->get<int64_t>() < source_layers && acc != e.end() && acc->is_boolean(),
                 "adapter file: fit_report.layers[" << layer
                                                    << "].selection holds a malformed step");
    st.source_layer = l->get<int64_t>();
    st.accepted = acc->get<bool>();
    for (auto [key, out_value] : {std::pair<const char*, double*>{"r2_key", &st.r2_key},
                                  {"r2_value", &st.r2_value},
                                  {"screen", &st.screen}}) {
      *out_value = report_number(e, key, layer);
      KVB_CHECK_AS(Corrupt, std::isfinite(*out_value) && *out_value <= 1,
                   "adapter file: fit_report.layers[" << layer << "].selection: " << key << " is "
                                                      << *out_value << ", not a finite R² <= 1");
    }
    out.push_back(st);
  }
  return out;
}

}  // namespace

std::string LinearAdapter::fingerprint() const {
  std::call_once(impl_->fingerprint_once, [&] {
    impl_->fingerprint = content_checksum(file_metadata(*impl_), file_tensors(*impl_)).hex();
  });
  return impl_->fingerprint;
}

void LinearAdapter::save(const std::string& path) const {
  const Impl& a = *impl_;
  std::map<std::string, std::string> meta = file_metadata(a);
  // Serving defaults: checksummed with the rest, but not part of fingerprint() (file_metadata).
  if (const ServingDefaults serving = this->serving(); serving.recorded)
    meta[detail::kServingKey] = detail::serving_json(serving);
  const std::map<std::string, TensorBytes> views = file_tensors(a);
  meta[kChecksumKey] = content_checksum(meta, views).hex();
  std::vector<io::StTensor> tensors;
  for (const auto& [name, t] : views) {
    io::StTensor st;
    st.name = name;
    st.dtype = io::StDType::kF32;
    st.shape = t.shape;
    st.data.resize(t.bytes);
    std::memcpy(st.data.data(), t.data, t.bytes);
    tensors.push_back(std::move(st));
  }
  io::write_safetensors(path, tensors, meta);
}

LinearAdapter LinearAdapter::load(const std::string& path, const AdapterLoadOptions& options) {
  const io::StFile file = io::read_safetensors(path);
  const auto& meta = file.metadata;
  auto get = [&](const char* key) {
    auto it = meta.find(key);
    KVB_CHECK_AS(Corrupt, it != meta.end(), "adapter file " << path << ": no '" << key << "'");
    return it->second;
  };
  KVB_CHECK_AS(Corrupt, get("format") == kFormat,
               "adapter file " << path << ": format is '" << get("format") << "', not " << kFormat);
  const std::string version = get("format_version");
  KVB_CHECK_AS(Corrupt,
               version == kFormatVersion || version == kAlignedVersion ||
                   version == kUncheckedVersion,
               "adapter file " << path << ": unknown format_version '" << version
                               << "' (this library reads " << kUncheckedVersion << ", "
                               << kFormatVersion << " and " << kAlignedVersion << ")");
  // The checksum first: nothing of a damaged or edited file is trusted.
  const auto sum = meta.find(kChecksumKey);
  if (sum != meta.end()) {
    std::map<std::string, TensorBytes> views;
    for (const auto& [name, t] : file.tensors)
      views[name] = {t.shape, t.data.data(), t.data.size()};
    const std::string actual = content_checksum(meta, views).hex();
    KVB_CHECK_AS(Corrupt, sum->second == actual,
                 "adapter file " << path << ": checksum mismatch (the file says " << sum->second
                                 << ", its content hashes to " << actual
                                 << "): it is damaged or was edited");
  } else {
    KVB_CHECK_AS(Corrupt, options.allow_unchecked,
                 "adapter file " << path << ": no checksum (format_version " << version
                                 << " or a writer that dropped it), so damage cannot be detected; "
                                    "load it with allow_unchecked=True only if you trust it, "
                                    "and save() it again to add one");
  }
  auto a = std::make_unique<Impl>();
  a->source = spec_from_json(parse_json(meta, "source_spec"), "source_spec");
  a->target = spec_from_json(parse_json(meta, "target_spec"), "target_spec");
  a->source_inv_freq = detail::layer_inv_freq(a->source);
  a->target_inv_freq = detail::layer_inv_freq(a->target);
  const std::string rope = get("rope_aware");
  KVB_CHECK_AS(Corrupt, rope == "true" || rope == "false", "adapter file: rope_aware is '" << rope << "'");
  a->report.rope_aware = rope == "true";
  const auto policy = meta.find(kAlignmentPolicyKey);
  KVB_CHECK_AS(Corrupt, (policy != meta.end()) == (version == kAlignedVersion),
               "adapter file " << path << ": format_version " << version
                               << (policy != meta.end() ? " has an " : " needs an ")
                               << kAlignmentPolicyKey << " (version " << kAlignedVersion
                               << " files alone carry one)");
  if (policy != meta.end()) {
    try {
      a->report.alignment_policy = align_policy_name(parse_align_policy(policy->second));
    } catch (const InvalidArgument& e) {
      KVB_CHECK_AS(Corrupt, false, "adapter file " << path << ": " << e.message());
    }
  }

  const json layers = parse_json(meta, "layer_map");
  const json fit = parse_json(meta, "fit_report");
  try {
    KVB_CHECK_AS(Corrupt, layers.is_array() && static_cast<int64_t>(layers.size()) == a->target.num_layers,
                 "adapter file: layer_map needs one list per target layer");
    KVB_CHECK_AS(Corrupt, fit.is_object(), "adapter file: fit_report is not an object");
    const json& fit_layers = fit.at("layers");
    KVB_CHECK_AS(Corrupt, fit_layers.is_array() && fit_layers.size() == layers.size(),
                 "adapter file: fit_report.layers needs one entry per target layer");
    a->report.train_tokens = report_count(fit, "train_tokens");
    a->report.holdout_tokens = report_count(fit, "holdout_tokens");
    for (size_t j = 0; j < layers.size(); ++j) {
      std::vector<int64_t> S = layers[j].get<std::vector<int64_t>>();
      KVB_CHECK_AS(Corrupt, !S.empty() && std::is_sorted(S.begin(), S.end()) &&
                                std::adjacent_find(S.begin(), S.end()) == S.end(),
                   "adapter file: layer_map[" << j << "] must be a non-empty ascending list");
      for (int64_t l : S)
        KVB_CHECK_AS(Corrupt, l >= 0 && l < a->source.num_layers,
                     "adapter file: layer_map[" << j << "] names source layer " << l);
      KVB_CHECK_AS(Corrupt, fit_layers[j].is_object(),
                   "adapter file: fit_report.layers[" << j << "] is not an object");
      LayerFit lf = report_layer(fit_layers[j], j);
      lf.selection = report_selection(fit_layers[j], j, a->source.num_layers);
      lf.source_layers = S;
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
  // The target's key norm: every layer's gains or none.
  for (int64_t j = 0; j < a->target.num_layers; ++j) {
    const std::string name = key_norm_name(j);
    const auto it = file.tensors.find(name);
    const bool present = it != file.tensors.end();
    KVB_CHECK_AS(Corrupt, j == 0 || present == !a->key_norm.empty(),
                 "adapter file: tensor " << name << (present ? " present" : " missing")
                                         << ": key_norm tensors are for every target layer or none");
    if (!present) continue;
    const io::StTensor& t = it->second;
    KVB_CHECK_AS(Corrupt,
                 t.dtype == io::StDType::kF32 && t.shape == std::vector<int64_t>{a->target.head_dim},
                 "adapter file: tensor " << name << " must be F32 of [head_dim]");
    std::vector<float> g(t.data.size() / 4);
    std::memcpy(g.data(), t.data.data(), t.data.size());
    for (float v : g)
      KVB_CHECK_AS(Corrupt, std::isfinite(v), "adapter file: tensor " << name << " is not finite");
    a->key_norm.push_back(std::move(g));
    ++used;
  }
  // The target's token codes and, per map that has the term, its weights.
  const auto codes = file.tensors.find(kTokenCodesName);
  const auto context = meta.find(kTokenContextKey);
  KVB_CHECK_AS(Corrupt, (codes != file.tensors.end()) == (context != meta.end()),
               "adapter file: tensor " << kTokenCodesName << " and metadata '" << kTokenContextKey
                                       << "' come together");
  if (codes != file.tensors.end()) {
    const io::StTensor& t = codes->second;
    KVB_CHECK_AS(Corrupt, t.dtype == io::StDType::kF32 && t.shape.size() == 2 && t.shape[0] > 0 &&
                              t.shape[1] > 0,
                 "adapter file: tensor " << kTokenCodesName << " must be F32 of [vocab, dims]");
    KVB_CHECK_AS(Corrupt, context->second.size() == 1 && context->second[0] >= '1' &&
                              context->second[0] <= '8',
                 "adapter file: " << kTokenContextKey << " is '" << context->second
                                  << "', not a count in [1, 8]");
    a->token_context = context->second[0] - '0';
    a->token_codes.vocab = t.shape[0];
    a->token_codes.dims = t.shape[1];
    a->token_codes.values.resize(t.data.size() / 4);
    std::memcpy(a->token_codes.values.data(), t.data.data(), t.data.size());
    for (float v : a->token_codes.values)
      KVB_CHECK_AS(Corrupt, std::isfinite(v),
                   "adapter file: tensor " << kTokenCodesName << " is not finite");
    ++used;
    const std::vector<int64_t> want = {a->token_context * a->token_codes.dims, a->target_width()};
    a->token_weights.resize(static_cast<size_t>(a->target.num_layers));
    for (int64_t j = 0; j < a->target.num_layers; ++j)
      for (int kind = 0; kind < 2; ++kind) {
        const std::string name = tensor_name(j, kind, "token_weight");
        const auto it = file.tensors.find(name);
        if (it == file.tensors.end()) continue;  // that map has no codes' term
        KVB_CHECK_AS(Corrupt, it->second.dtype == io::StDType::kF32 && it->second.shape == want,
                     "adapter file: tensor " << name
                                             << " must be F32 of [token_context * dims, width]");
        std::vector<float>& w = a->token_weights[static_cast<size_t>(j)][static_cast<size_t>(kind)];
        w.resize(it->second.data.size() / 4);
        std::memcpy(w.data(), it->second.data.data(), it->second.data.size());
        for (float v : w)
          KVB_CHECK_AS(Corrupt, std::isfinite(v), "adapter file: tensor " << name << " is not finite");
        ++used;
      }
  }
  KVB_CHECK_AS(Corrupt, used == file.tensors.size(),
               "adapter file: " << file.tensors.size() - used << " tensors the layer map does not use");
  if (const auto serving = meta.find(detail::kServingKey); serving != meta.end())
    a->serving = detail::parse_serving(serving->second);
  return LinearAdapter(std::move(a));
}

}  // namespace kvbridge
