#include <gtest/gtest.h>

#include "test_util.h"

namespace kvbridge {
namespace {

using testing::DenseKV;
using testing::HFKV;
using testing::same_elements;

class CopyKV : public ::testing::TestWithParam<std::tuple<DType, int64_t>> {};

// Every layout pair (dense/strided) against the element-by-element reference.
TEST_P(CopyKV, MatchesElementwiseReference) {
  const auto [dtype, pad] = GetParam();
  const ModelSpec spec = testing::small_spec(dtype, 3, 5, 14);
  const int64_t tokens = 37;
  HFKV hf(spec, tokens, pad, 11);
  DenseKV dense(spec, tokens, 12);
  copy_kv(hf.view(), dense.view);
  EXPECT_TRUE(same_elements(hf.view(), dense.view));

  HFKV back(spec, tokens, pad + 1, 13);
  copy_kv(dense.view, back.view());
  EXPECT_TRUE(same_elements(back.view(), dense.view));

  // Slices at odd offsets.
  DenseKV part(spec, 9, 14);
  copy_kv(hf.view().slice_tokens(17, 9), part.view);
  EXPECT_TRUE(same_elements(hf.view().slice_tokens(17, 9), part.view));
  EXPECT_FALSE(same_elements(hf.view().slice_tokens(16, 9), part.view));
}

INSTANTIATE_TEST_SUITE_P(Layouts, CopyKV,
                         ::testing::Combine(::testing::Values(DType::kFloat32, DType::kBFloat16,
                                                              DType::kFloat16),
                                            ::testing::Values(int64_t{0}, int64_t{3})));

TEST(CopyKV, NonUnitDimStride) {
  const ModelSpec spec = testing::small_spec(DType::kFloat32, 2, 3, 4);
  const int64_t tokens = 5;
  // Planes that store head_dim with stride 2 (every other element).
  std::vector<float> storage(static_cast<size_t>(4 * tokens * 3 * 4 * 2));
  for (size_t i = 0; i < storage.size(); ++i) storage[i] = 0.5f + static_cast<float>(i);
  std::vector<KVPlane> planes;
  for (int p = 0; p < 4; ++p)
    planes.push_back(KVPlane{storage.data() + p * tokens * 3 * 8, 3 * 8, 8, 2});
  KVView strided = KVView::from_planes(planes, DType::kFloat32, Device{}, tokens, 3, 4);
  DenseKV dense(spec, tokens, 3);
  copy_kv(strided, dense.view);
  EXPECT_TRUE(same_elements(strided, dense.view));
}

TEST(KVView, FromHFLayersRejectsBadInput) {
  const ModelSpec spec = testing::small_spec();
  HFKV hf(spec, 8, 0, 1);
  auto keys = hf.keys, values = hf.values;
  EXPECT_NO_THROW(KVView::from_hf_layers(keys, values));

  auto bad = keys;
  bad[1].shape = {1, 2, 8};
  bad[1].strides = {1, 1, 1};
  try {
    KVView::from_hf_layers(bad, values);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("kv[1][0]"), std::string::npos) << e.what();
  }
  bad = values;
  bad[2].shape[0] = 2;
  EXPECT_THROW(KVView::from_hf_layers(keys, bad), InvalidArgument);
  bad = values;
  bad[0].dtype = DType::kFloat16;
  EXPECT_THROW(KVView::from_hf_layers(keys, bad), InvalidArgument);
  bad = values;
  bad[0].shape[2] = 7;
  EXPECT_THROW(KVView::from_hf_layers(keys, bad), InvalidArgument);
  values.pop_back();
  EXPECT_THROW(KVView::from_hf_layers(keys, values), InvalidArgument);
  EXPECT_THROW(KVView::from_hf_layers({}, {}), InvalidArgument);
}

TEST(KVView, CheckMatchesSpec) {
  const ModelSpec spec = testing::small_spec();
  DenseKV dense(spec, 4, 1);
  EXPECT_NO_THROW(dense.view.check_matches(spec, "kv"));
  ModelSpec other = spec;
  other.num_kv_heads = 4;
  EXPECT_THROW(dense.view.check_matches(other, "kv"), InvalidArgument);
  other = spec;
  other.dtype = DType::kBFloat16;
  EXPECT_THROW(dense.view.check_matches(other, "kv"), InvalidArgument);
  EXPECT_THROW(dense.view.slice_tokens(3, 2), InvalidArgument);
}

}  // namespace
}  // namespace kvbridge
