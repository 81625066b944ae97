// ModelSpec: a model's identity and KV geometry. Two specs are the same model exactly when they
// are equal field by field, and then (and only then, up to XXH3-128 collisions) their
// fingerprints are equal. The fingerprint keys every cache entry, so any change of weights,
// LoRA or revision must show up in `version`.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvbridge/dtype.h"

namespace kvbridge {

/// How a model lays out rotary pairs inside a head.
enum class RopeStyle : uint8_t {
  kHalf = 0,         ///< Hugging Face Llama/Qwen `rotate_half`: pair (i, i + head_dim/2).
  kInterleaved = 1,  ///< GPT-J / original RoPE: pairs (0,1), (2,3), ...
};

/// RoPE frequency scaling as found in Hugging Face configs (`rope_scaling`).
struct RopeScaling {
  enum class Type : uint8_t { kNone = 0, kLinear = 1, kLlama3 = 2 };
  Type type = Type::kNone;
  double factor = 1.0;                       ///< linear and llama3
  double low_freq_factor = 1.0;              ///< llama3 only
  double high_freq_factor = 4.0;             ///< llama3 only
  int64_t original_max_position = 8192;      ///< llama3 only

  bool operator==(const RopeScaling& other) const noexcept;
  bool operator!=(const RopeScaling& other) const noexcept { return !(*this == other); }
};

/// One layer's attention: its RoPE and its window. Gemma 3, for example, alternates five
/// sliding-window layers (window 512, base 1e4) with one full-attention layer (base 1e6).
struct LayerAttention {
  double rope_base = 10000.0;  ///< > 0, finite
  RopeScaling rope_scaling{};  ///< checked as ModelSpec::rope_scaling is
  /// 0: full attention; otherwise (>= 1) the layer attends to this many most recent tokens.
  /// Identity and metadata only: kvbridge stores and converts every layer's KV for every token
  /// whatever its window (the runtime decides what a sliding layer's cache keeps).
  int64_t sliding_window = 0;

  bool operator==(const LayerAttention& other) const noexcept;
  bool operator!=(const LayerAttention& other) const noexcept { return !(*this == other); }
};

struct ModelSpec {
  std::string name;            ///< human-readable model id, e.g. "meta-llama/Llama-3.1-8B"
  std::string version;         ///< weights revision / LoRA id; part of the identity
  std::string tokenizer;       ///< tokenizer id; cross-model reuse requires equal tokenizers
  /// Largest num_layers, num_kv_heads and head_dim: with them kv_bytes_per_token() stays far
  /// below 2^63 (at most 2^51).
  static constexpr int64_t kMaxDim = int64_t{1} << 16;
  int64_t num_layers = 0;      ///< in [1, kMaxDim]
  int64_t num_kv_heads = 0;    ///< in [1, kMaxDim]
  int64_t head_dim = 0;        ///< in [2, kMaxDim], even (RoPE rotates pairs)
  DType dtype = DType::kFloat32;  ///< dtype of the model's KV cache
  /// > 0, finite. With layer_attention empty every layer's RoPE base; otherwise unused by the
  /// numerics (the entries rule) but still part of the identity as given.
  double rope_base = 10000.0;
  RopeStyle rope_style = RopeStyle::kHalf;  ///< every layer's (a model has one style)
  RopeScaling rope_scaling{};  ///< as rope_base: every layer's unless layer_attention is given
  /// Per-layer attention. Empty (the default): every layer uses rope_base and rope_scaling with
  /// full attention, and the fingerprint is that of a spec without this field. Otherwise
  /// exactly num_layers entries, entry l ruling layer l.
  std::vector<LayerAttention> layer_attention;

  /// Throws InvalidArgument naming the first bad field.
  void validate() const;

  /// Layer l's attention (l in [0, num_layers), else InvalidArgument): layer_attention[l], or
  /// {rope_base, rope_scaling, full attention} when layer_attention is empty.
  LayerAttention layer(int64_t l) const;

  /// True when every layer has the same RoPE (base and scaling) and window, whether or not
  /// layer_attention is given.
  bool uniform_attention() const;

  /// 32 lowercase hex digits: XXH3-128 over a length-prefixed encoding of every field
  /// (see docs/hashing.md). Stable across processes, platforms and library builds.
  std::string fingerprint() const;

  /// Bytes of K plus V for one token across all layers.
  int64_t kv_bytes_per_token() const noexcept;

  bool operator==(const ModelSpec& other) const noexcept;
  bool operator!=(const ModelSpec& other) const noexcept { return !(*this == other); }
};

/// The one list of RopeScaling's fields: calls f(name, field of each of `s`...) for type,
/// factor, low_freq_factor, high_freq_factor and original_max_position, in that order.
/// Equality, the fingerprint, the adapter file's JSON, the Python pickle and the Python
/// constructor (whose arguments are in this order) and properties are written from it.
/// constexpr, so the bindings read the names at compile time.
template <class F, class... S>
constexpr void for_each_rope_scaling_field(F&& f, S&... s) {
  f("type", s.type...);
  f("factor", s.factor...);
  f("low_freq_factor", s.low_freq_factor...);
  f("high_freq_factor", s.high_freq_factor...);
  f("original_max_position", s.original_max_position...);
}

/// The one list of LayerAttention's fields, used as for_each_rope_scaling_field is: rope_base,
/// rope_scaling (a RopeScaling) and sliding_window, in that order.
template <class F, class... S>
constexpr void for_each_layer_attention_field(F&& f, S&... s) {
  f("rope_base", s.rope_base...);
  f("rope_scaling", s.rope_scaling...);
  f("sliding_window", s.sliding_window...);
}

/// The one list of ModelSpec's fields: calls f(name, field of each of `s`...) for every field
/// in the order of the fingerprint encoding (docs/hashing.md). Fields are std::string, int64_t,
/// DType, double, RopeStyle, (for "rope_scaling") a RopeScaling, whose own fields
/// for_each_rope_scaling_field lists, or (for "layer_attention") a std::vector of
/// LayerAttention, whose fields for_each_layer_attention_field lists. Equality, the
/// fingerprint, the adapter file's JSON, the Python pickle and the Python constructor's
/// conversions and properties are written from it; a new field is one line here, its check in
/// validate() and its place in the Python constructor's argument order
/// (python/src/bindings.cpp, checked at import). A new kind of struct field also needs its case
/// wherever these walk into struct fields (the fingerprint, the adapter file's JSON, the pickle).
template <class F, class... S>
void for_each_spec_field(F&& f, S&... s) {
  f("name", s.name...);
  f("version", s.version...);
  f("tokenizer", s.tokenizer...);
  f("num_layers", s.num_layers...);
  f("num_kv_heads", s.num_kv_heads...);
  f("head_dim", s.head_dim...);
  f("dtype", s.dtype...);
  f("rope_base", s.rope_base...);
  f("rope_style", s.rope_style...);
  f("rope_scaling", s.rope_scaling...);
  f("layer_attention", s.layer_attention...);
}

const char* rope_style_name(RopeStyle style) noexcept;
/// "none", "linear" or "llama3".
const char* rope_scaling_type_name(RopeScaling::Type type) noexcept;
/// The inverse of rope_scaling_type_name; throws InvalidArgument otherwise.
RopeScaling::Type parse_rope_scaling_type(const std::string& name);
/// "half" or "interleaved"; throws InvalidArgument otherwise.
RopeStyle parse_rope_style(const std::string& name);

}  // namespace kvbridge
