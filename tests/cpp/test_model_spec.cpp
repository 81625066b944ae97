#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "test_util.h"

namespace kvbridge {
namespace {

TEST(ModelSpec, FingerprintCoversEveryField) {
  const ModelSpec base = testing::small_spec();
  std::vector<ModelSpec> variants(11, base);
  variants[0].name = "other";
  variants[1].version = "rev2";
  variants[2].tokenizer = "tok";
  variants[3].num_layers += 1;
  variants[4].num_kv_heads += 1;
  variants[5].head_dim += 2;
  variants[6].dtype = DType::kBFloat16;
  variants[7].rope_base = 500000.0;
  variants[8].rope_style = RopeStyle::kInterleaved;
  variants[9].rope_scaling.type = RopeScaling::Type::kLinear;
  variants[10].rope_scaling.factor = 2.0;
  std::set<std::string> seen{base.fingerprint()};
  for (const ModelSpec& v : variants) {
    EXPECT_NE(v, base);
    EXPECT_TRUE(seen.insert(v.fingerprint()).second) << v.fingerprint();
  }
  ModelSpec copy = base;
  EXPECT_EQ(copy, base);
  EXPECT_EQ(copy.fingerprint(), base.fingerprint());
  EXPECT_EQ(base.fingerprint().size(), 32u);
}

// Calls f(path, leaf) for every leaf field of `s` in its field list's order: struct fields'
// fields ("rope_scaling.factor") and every layer_attention entry's ("layer_attention.2.
// rope_scaling.type").
template <class S, class F>
void for_each_leaf(S& s, const std::string& prefix, F&& f) {
  auto leaf = [&](const char* name, auto& value) {
    using V = std::decay_t<decltype(value)>;
    const std::string path = prefix + name;
    if constexpr (std::is_same_v<V, RopeScaling> || std::is_same_v<V, LayerAttention>) {
      for_each_leaf(value, path + ".", f);
    } else if constexpr (std::is_same_v<V, std::vector<LayerAttention>>) {
      for (size_t i = 0; i < value.size(); ++i)
        for_each_leaf(value[i], path + "." + std::to_string(i) + ".", f);
    } else {
      f(path, value);
    }
  };
  using T = std::remove_const_t<S>;
  if constexpr (std::is_same_v<T, ModelSpec>) {
    for_each_spec_field(leaf, s);
  } else if constexpr (std::is_same_v<T, LayerAttention>) {
    for_each_layer_attention_field(leaf, s);
  } else {
    for_each_rope_scaling_field(leaf, s);
  }
}

// Every field for_each_spec_field lists (rope_scaling's and every layer_attention entry's
// included) changes the fingerprint and equality when perturbed alone.
TEST(ModelSpec, EveryListedFieldIsPartOfTheIdentity) {
  ModelSpec base = testing::small_spec();
  base.rope_scaling.type = RopeScaling::Type::kLlama3;
  base.layer_attention.resize(3);
  base.layer_attention[1].rope_base = 1e6;
  base.layer_attention[1].rope_scaling.type = RopeScaling::Type::kLlama3;
  base.layer_attention[2].sliding_window = 512;
  auto perturb = [](auto& v) {
    using T = std::decay_t<decltype(v)>;
    if constexpr (std::is_same_v<T, std::string>) {
      v += "x";
    } else if constexpr (std::is_same_v<T, int64_t>) {
      v += 2;
    } else if constexpr (std::is_same_v<T, double>) {
      v *= 1.5;
    } else if constexpr (std::is_same_v<T, DType>) {
      v = v == DType::kFloat32 ? DType::kBFloat16 : DType::kFloat32;
    } else if constexpr (std::is_same_v<T, RopeStyle>) {
      v = v == RopeStyle::kHalf ? RopeStyle::kInterleaved : RopeStyle::kHalf;
    } else {
      v = v == RopeScaling::Type::kNone ? RopeScaling::Type::kLinear : RopeScaling::Type::kNone;
    }
  };
  std::vector<std::string> names;
  for_each_leaf(base, "", [&](const std::string& name, const auto&) { names.push_back(name); });
  ASSERT_EQ(names.size(), 14u + 3 * 7u);
  EXPECT_EQ(names.back(), "layer_attention.2.sliding_window");
  std::set<std::string> seen{base.fingerprint()};
  for (size_t i = 0; i < names.size(); ++i) {
    ModelSpec v = base;
    size_t k = 0;
    for_each_leaf(v, "", [&](const std::string&, auto& f) {
      if (k++ == i) perturb(f);
    });
    EXPECT_NE(v, base) << names[i];
    EXPECT_TRUE(seen.insert(v.fingerprint()).second) << names[i];
  }
  // Without the entries, and with them in another order.
  ModelSpec cleared = base, swapped = base;
  cleared.layer_attention.clear();
  std::swap(swapped.layer_attention[0], swapped.layer_attention[2]);
  for (const ModelSpec& v : {cleared, swapped}) {
    EXPECT_NE(v, base);
    EXPECT_TRUE(seen.insert(v.fingerprint()).second);
  }
}

TEST(ModelSpec, FieldBoundariesCannotAlias) {
  ModelSpec a = testing::small_spec(), b = testing::small_spec();
  a.name = "ab";
  a.version = "c";
  b.name = "a";
  b.version = "bc";
  EXPECT_NE(a.fingerprint(), b.fingerprint());
}

TEST(ModelSpec, ValidateNamesTheField) {
  ModelSpec s = testing::small_spec();
  s.head_dim = 7;
  try {
    s.validate();
    FAIL() << "odd head_dim accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("head_dim"), std::string::npos) << e.what();
  }
  s = testing::small_spec();
  s.num_layers = 0;
  EXPECT_THROW(s.validate(), InvalidArgument);
  s = testing::small_spec();
  s.rope_base = -1;
  EXPECT_THROW(s.validate(), InvalidArgument);
  s = testing::small_spec();
  s.name.clear();
  EXPECT_THROW(s.validate(), InvalidArgument);
  EXPECT_NO_THROW(testing::small_spec().validate());
}

// Sizes have upper bounds (kv_bytes_per_token() wrapped to 0 at 2^62), and every RoPE scaling
// field is finite whatever the type (a NaN made the spec unequal to itself).
TEST(ModelSpec, SizesAreBoundedAndRopeScalingIsFinite) {
  for (int64_t ModelSpec::*field :
       {&ModelSpec::num_layers, &ModelSpec::num_kv_heads, &ModelSpec::head_dim}) {
    ModelSpec s = testing::small_spec();
    s.*field = ModelSpec::kMaxDim;
    EXPECT_NO_THROW(s.validate());
    s.*field = int64_t{1} << 62;
    EXPECT_THROW(s.validate(), InvalidArgument);
  }
  ModelSpec big = testing::small_spec();
  big.num_layers = big.num_kv_heads = big.head_dim = ModelSpec::kMaxDim;
  big.dtype = DType::kFloat32;
  EXPECT_EQ(big.kv_bytes_per_token(), int64_t{1} << 51);
  for (double bad : {NAN, INFINITY, -INFINITY}) {
    for (double RopeScaling::*field : {&RopeScaling::factor, &RopeScaling::low_freq_factor,
                                       &RopeScaling::high_freq_factor}) {
      ModelSpec s = testing::small_spec();
      s.rope_scaling.*field = bad;
      EXPECT_THROW(s.validate(), InvalidArgument);
    }
  }
}

// A small Gemma-3-like spec: two sliding-window layers (base 1e4, window 512), then a full
// attention layer (base 1e6, linear scaling 8).
ModelSpec gemma_like() {
  ModelSpec s = testing::small_spec(DType::kBFloat16, 3, 1, 4);
  s.name = "gemma-ish";
  LayerAttention local, global;
  local.sliding_window = 512;
  global.rope_base = 1e6;
  global.rope_scaling.type = RopeScaling::Type::kLinear;
  global.rope_scaling.factor = 8.0;
  s.layer_attention = {local, local, global};
  return s;
}

// The value of docs/hashing.md's encoding computed independently (Python's xxhash package, as
// tests/python/test_layer_attention.py does); specs without layer_attention keep the pinned
// vectors of tests/vectors/prefix_hash.txt (test_prefix_hash.cpp).
TEST(LayerAttention, PinnedFingerprint) {
  EXPECT_EQ(gemma_like().fingerprint(), "8db50e085962ab3f88fe429da49d78df");
}

TEST(LayerAttention, LayerFallsBackToTheSpecWideFields) {
  ModelSpec s = testing::small_spec(DType::kFloat32, 3, 1, 4);
  s.rope_base = 5e5;
  s.rope_scaling.type = RopeScaling::Type::kLinear;
  s.rope_scaling.factor = 3.0;
  for (int64_t l = 0; l < 3; ++l) {
    const LayerAttention a = s.layer(l);
    EXPECT_EQ(a.rope_base, 5e5);
    EXPECT_EQ(a.rope_scaling, s.rope_scaling);
    EXPECT_EQ(a.sliding_window, 0);
  }
  EXPECT_TRUE(s.uniform_attention());
  EXPECT_THROW(s.layer(3), InvalidArgument);
  EXPECT_THROW(s.layer(-1), InvalidArgument);

  const ModelSpec g = gemma_like();
  EXPECT_NO_THROW(g.validate());
  EXPECT_EQ(g.layer(0).sliding_window, 512);
  EXPECT_EQ(g.layer(2).rope_base, 1e6);
  EXPECT_EQ(g.layer(2).rope_scaling.factor, 8.0);
  EXPECT_FALSE(g.uniform_attention());
  // Entries rule even where they all equal the spec-wide fields: still a different identity.
  ModelSpec explicit_uniform = s;
  explicit_uniform.layer_attention.assign(3, s.layer(0));
  EXPECT_TRUE(explicit_uniform.uniform_attention());
  EXPECT_NE(explicit_uniform, s);
  EXPECT_NE(explicit_uniform.fingerprint(), s.fingerprint());
}

TEST(LayerAttention, ValidateNamesTheEntry) {
  auto expect_invalid = [](const ModelSpec& s, const std::string& needle) {
    try {
      s.validate();
      ADD_FAILURE() << "accepted, expected an error naming " << needle;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  ModelSpec s = gemma_like();
  s.layer_attention.pop_back();
  expect_invalid(s, "layer_attention must be empty or hold one entry per layer (3), got 2");
  for (double bad : {0.0, -1.0, double{NAN}, double{INFINITY}}) {
    s = gemma_like();
    s.layer_attention[1].rope_base = bad;
    expect_invalid(s, "layer_attention[1].rope_base");
  }
  s = gemma_like();
  s.layer_attention[2].rope_scaling.factor = 0;
  expect_invalid(s, "layer_attention[2].rope_scaling.factor");
  s = gemma_like();
  s.layer_attention[0].rope_scaling.type = RopeScaling::Type::kLlama3;
  s.layer_attention[0].rope_scaling.high_freq_factor = 0.5;
  expect_invalid(s, "layer_attention[0].rope_scaling: llama3");
  s = gemma_like();
  s.layer_attention[2].rope_scaling.low_freq_factor = NAN;
  expect_invalid(s, "layer_attention[2].rope_scaling");
  s = gemma_like();
  s.layer_attention[0].sliding_window = -1;
  expect_invalid(s, "layer_attention[0].sliding_window");
  s = gemma_like();
  s.layer_attention[0].sliding_window = 1;
  EXPECT_NO_THROW(s.validate());
  // The spec-wide fields are still checked, and still named as before.
  s = gemma_like();
  s.rope_base = -2;
  expect_invalid(s, "ModelSpec.rope_base");
}

TEST(DType, ParseAndNames) {
  EXPECT_EQ(parse_dtype("torch.bfloat16"), DType::kBFloat16);
  EXPECT_EQ(parse_dtype("float16"), DType::kFloat16);
  EXPECT_STREQ(dtype_name(parse_dtype("float32")), "float32");
  EXPECT_THROW(parse_dtype("int8"), InvalidArgument);
  EXPECT_THROW(parse_rope_style("full"), InvalidArgument);
  EXPECT_EQ(parse_rope_style("interleaved"), RopeStyle::kInterleaved);
}

TEST(Error, CarriesLocation) {
  try {
    KVB_CHECK_AS(Corrupt, 1 == 2, "value " << 42);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.message(), "value 42");
    EXPECT_NE(std::string(e.what()).find("test_model_spec.cpp:"), std::string::npos);
    EXPECT_GT(e.line(), 0);
  }
}

}  // namespace
}  // namespace kvbridge
