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

// Every field for_each_spec_field lists (rope_scaling's included) changes the fingerprint
// and equality when perturbed alone.
TEST(ModelSpec, EveryListedFieldIsPartOfTheIdentity) {
  ModelSpec base = testing::small_spec();
  base.rope_scaling.type = RopeScaling::Type::kLlama3;
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
  for_each_spec_field(
      [&](const char* name, const auto& value) {
        if constexpr (std::is_same_v<std::decay_t<decltype(value)>, RopeScaling>) {
          for_each_rope_scaling_field(
              [&](const char* sub, const auto&) { names.push_back(std::string(name) + "." + sub); },
              value);
        } else {
          names.push_back(name);
        }
      },
      base);
  ASSERT_EQ(names.size(), 14u);
  std::set<std::string> seen{base.fingerprint()};
  for (size_t i = 0; i < names.size(); ++i) {
    ModelSpec v = base;
    size_t k = 0;
    for_each_spec_field(
        [&](const char*, auto& value) {
          if constexpr (std::is_same_v<std::decay_t<decltype(value)>, RopeScaling>) {
            for_each_rope_scaling_field(
                [&](const char*, auto& f) {
                  if (k++ == i) perturb(f);
                },
                value);
          } else {
            if (k++ == i) perturb(value);
          }
        },
        v);
    EXPECT_NE(v, base) << names[i];
    EXPECT_TRUE(seen.insert(v.fingerprint()).second) << names[i];
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
