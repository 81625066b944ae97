#include "kvbridge/model_spec.h"

#include <cmath>
#include <cstdio>
#include <string>
#include <type_traits>

#include "kvbridge/error.h"
#include "src/core/byte_order.h"
#include "src/core/xxh3.h"

namespace kvbridge {
namespace {

std::string format_double(double v) {
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
}

// Length-prefixed key/value pairs: nothing a field holds can make two specs encode alike.
void append_field(std::string& out, const std::string& key, const std::string& value) {
  auto append_u32 = [&out](uint32_t n) {
    unsigned char le[4];
    detail::store_le32(le, n);
    out.append(reinterpret_cast<const char*>(le), 4);
  };
  append_u32(static_cast<uint32_t>(key.size()));
  out += key;
  append_u32(static_cast<uint32_t>(value.size()));
  out += value;
}

// A field's text in the fingerprint encoding.
std::string field_text(const std::string& v) { return v; }
std::string field_text(int64_t v) { return std::to_string(v); }
std::string field_text(double v) { return format_double(v); }
std::string field_text(DType v) { return dtype_name(v); }
std::string field_text(RopeStyle v) { return rope_style_name(v); }
std::string field_text(RopeScaling::Type v) { return rope_scaling_type_name(v); }

}  // namespace

bool RopeScaling::operator==(const RopeScaling& o) const noexcept {
  bool same = true;
  for_each_rope_scaling_field([&](const char*, const auto& a, const auto& b) { same &= a == b; },
                              *this, o);
  return same;
}

bool LayerAttention::operator==(const LayerAttention& o) const noexcept {
  bool same = true;
  for_each_layer_attention_field(
      [&](const char*, const auto& a, const auto& b) { same &= a == b; }, *this, o);
  return same;
}

const char* rope_scaling_type_name(RopeScaling::Type type) noexcept {
  switch (type) {
    case RopeScaling::Type::kNone:
      return "none";
    case RopeScaling::Type::kLinear:
      return "linear";
    case RopeScaling::Type::kLlama3:
      return "llama3";
  }
  return "unknown";
}

RopeScaling::Type parse_rope_scaling_type(const std::string& name) {
  if (name == "none") return RopeScaling::Type::kNone;
  if (name == "linear") return RopeScaling::Type::kLinear;
  if (name == "llama3") return RopeScaling::Type::kLlama3;
  KVB_CHECK(false, "rope_scaling.type: expected 'none', 'linear' or 'llama3', got '" << name << "'");
  return RopeScaling::Type::kNone;
}

const char* rope_style_name(RopeStyle style) noexcept {
  return style == RopeStyle::kHalf ? "half" : "interleaved";
}

RopeStyle parse_rope_style(const std::string& name) {
  if (name == "half") return RopeStyle::kHalf;
  if (name == "interleaved") return RopeStyle::kInterleaved;
  KVB_CHECK(false, "rope_style: expected 'half' or 'interleaved', got '" << name << "'");
  return RopeStyle::kHalf;
}

namespace {
// The checks of one RoPE (the spec-wide one or a layer's), `what` naming its fields in messages.
void check_rope(const std::string& what, double rope_base, const RopeScaling& s) {
  KVB_CHECK(std::isfinite(rope_base) && rope_base > 0,
            what << "rope_base must be finite and > 0, got " << rope_base);
  KVB_CHECK(std::isfinite(s.factor) && s.factor > 0,
            what << "rope_scaling.factor must be finite and > 0, got " << s.factor);
  // Every field is finite whatever the type: it is part of the identity (a NaN would make the
  // spec unequal to itself).
  KVB_CHECK(std::isfinite(s.low_freq_factor) && std::isfinite(s.high_freq_factor),
            what << "rope_scaling: low_freq_factor and high_freq_factor must be finite, got "
                 << s.low_freq_factor << ", " << s.high_freq_factor);
  if (s.type == RopeScaling::Type::kLlama3) {
    KVB_CHECK(s.low_freq_factor > 0 && s.high_freq_factor > s.low_freq_factor,
              what << "rope_scaling: llama3 needs 0 < low_freq_factor < high_freq_factor, got "
                   << s.low_freq_factor << ", " << s.high_freq_factor);
    KVB_CHECK(s.original_max_position > 0 && s.original_max_position <= (int64_t{1} << 53),
              what << "rope_scaling.original_max_position must be > 0, got "
                   << s.original_max_position << " (at most 2^53)");
  }
}
}  // namespace

void ModelSpec::validate() const {
  KVB_CHECK(!name.empty(), "ModelSpec.name must not be empty");
  KVB_CHECK(num_layers > 0 && num_layers <= kMaxDim,
            "ModelSpec.num_layers must be in [1, " << kMaxDim << "], got " << num_layers);
  KVB_CHECK(num_kv_heads > 0 && num_kv_heads <= kMaxDim,
            "ModelSpec.num_kv_heads must be in [1, " << kMaxDim << "], got " << num_kv_heads);
  KVB_CHECK(head_dim > 0 && head_dim <= kMaxDim && head_dim % 2 == 0,
            "ModelSpec.head_dim must be an even number in [2, " << kMaxDim << "], got "
                                                               << head_dim);
  check_rope("ModelSpec.", rope_base, rope_scaling);
  KVB_CHECK(layer_attention.empty() || static_cast<int64_t>(layer_attention.size()) == num_layers,
            "ModelSpec.layer_attention must be empty or hold one entry per layer ("
                << num_layers << "), got " << layer_attention.size());
  for (size_t l = 0; l < layer_attention.size(); ++l) {
    const LayerAttention& a = layer_attention[l];
    const std::string what = "ModelSpec.layer_attention[" + std::to_string(l) + "].";
    check_rope(what, a.rope_base, a.rope_scaling);
    KVB_CHECK(a.sliding_window >= 0,
              what << "sliding_window must be >= 0 (0: full attention), got " << a.sliding_window);
  }
}

LayerAttention ModelSpec::layer(int64_t l) const {
  KVB_CHECK(l >= 0 && l < num_layers,
            "ModelSpec.layer: no layer " << l << " in a spec of " << num_layers << " layers");
  if (!layer_attention.empty()) {
    // Only a spec that fails validate() can lack the entry.
    KVB_CHECK(static_cast<size_t>(l) < layer_attention.size(),
              "ModelSpec.layer: layer_attention has " << layer_attention.size()
                                                      << " entries, not one per layer");
    return layer_attention[static_cast<size_t>(l)];
  }
  LayerAttention a;
  a.rope_base = rope_base;
  a.rope_scaling = rope_scaling;
  return a;
}

bool ModelSpec::uniform_attention() const {
  for (const LayerAttention& a : layer_attention)
    if (a != layer_attention.front()) return false;
  return true;
}

namespace {
// Appends `value` under `key` to the fingerprint encoding: a leaf as one length-prefixed pair;
// a struct as its fields under "key.field"; layer_attention as its size under its key, then
// entry i's fields under "key.i.field" (nothing at all when empty, so specs without per-layer
// entries keep their fingerprints).
template <class T>
void encode(std::string& enc, const std::string& key, const T& value) {
  if constexpr (std::is_same_v<T, RopeScaling>) {
    for_each_rope_scaling_field(
        [&](const char* sub, const auto& v) { encode(enc, key + "." + sub, v); }, value);
  } else if constexpr (std::is_same_v<T, LayerAttention>) {
    for_each_layer_attention_field(
        [&](const char* sub, const auto& v) { encode(enc, key + "." + sub, v); }, value);
  } else if constexpr (std::is_same_v<T, std::vector<LayerAttention>>) {
    if (value.empty()) return;
    append_field(enc, key, std::to_string(value.size()));
    for (size_t i = 0; i < value.size(); ++i) encode(enc, key + "." + std::to_string(i), value[i]);
  } else {
    append_field(enc, key, field_text(value));
  }
}
}  // namespace

std::string ModelSpec::fingerprint() const {
  std::string enc = "kvbridge.ModelSpec.v1";
  for_each_spec_field([&](const char* key, const auto& value) { encode(enc, key, value); },
                      *this);
  return detail::xxh3_128(enc.data(), enc.size()).hex();
}

int64_t ModelSpec::kv_bytes_per_token() const noexcept {
  return 2 * num_layers * num_kv_heads * head_dim * static_cast<int64_t>(dtype_size(dtype));
}

bool ModelSpec::operator==(const ModelSpec& o) const noexcept {
  bool same = true;
  for_each_spec_field([&](const char*, const auto& a, const auto& b) { same &= a == b; }, *this,
                      o);
  return same;
}

}  // namespace kvbridge
