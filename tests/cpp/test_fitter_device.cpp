// AdapterFitter::add on CUDA views, in every build: without a CUDA path or without a device they
// raise Unavailable; with a device, addresses that are not device memory are bad arguments; and
// whatever the build, a fitter takes its samples from one device. The CUDA fitter's results are
// checked against the CPU fitter in tests/cuda (which needs a device).
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "kvbridge/kvbridge.h"

namespace kvbridge {
namespace {

ModelSpec small_spec(const char* name, int64_t layers, int64_t heads, int64_t dim) {
  ModelSpec s;
  s.name = name;
  s.num_layers = layers;
  s.num_kv_heads = heads;
  s.head_dim = dim;
  s.dtype = DType::kFloat32;
  return s;
}

TEST(AdapterFitter, CudaViewsUnavailableOrRefused) {
  const ModelSpec s = small_spec("s", 2, 3, 10), t = small_spec("t", 2, 2, 6);
  AdapterFitter fitter(s, t);
  const Device cuda{DeviceType::kCUDA, 0};
  const int64_t tokens = 9;
  const auto fake = [&](const ModelSpec& m, uintptr_t base) {
    return KVView::contiguous(reinterpret_cast<void*>(base), m.dtype, cuda, m.num_layers, tokens,
                              m.num_kv_heads, m.head_dim);
  };
  const KVView src = fake(s, 0x1000), tgt = fake(t, 0x100000);
  if (cuda_device_count() == 0) {
    try {
      fitter.add(src, tgt);
      ADD_FAILURE() << "no exception";
    } catch (const Unavailable& e) {
      EXPECT_NE(std::string(e.what()).find("cuda:0"), std::string::npos) << e.what();
    }
  } else {
    EXPECT_THROW(fitter.add(src, tgt), InvalidArgument);  // not device memory
  }
  EXPECT_EQ(fitter.train_tokens() + fitter.holdout_tokens(), 0);

  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.f, 1.f);
  const auto random_kv = [&](const ModelSpec& m) {
    std::vector<float> v(static_cast<size_t>(m.num_layers * 2 * tokens * m.num_kv_heads *
                                             m.head_dim));
    for (float& x : v) x = normal(rng);
    return v;
  };
  std::vector<float> hs = random_kv(s), ht = random_kv(t);
  const KVView host_src = KVView::contiguous(hs.data(), s.dtype, Device{}, s.num_layers, tokens,
                                             s.num_kv_heads, s.head_dim);
  const KVView host_tgt = KVView::contiguous(ht.data(), t.dtype, Device{}, t.num_layers, tokens,
                                             t.num_kv_heads, t.head_dim);
  // Views on two devices are a bad argument.
  EXPECT_THROW(fitter.add(host_src, tgt), InvalidArgument);
  EXPECT_THROW(fitter.add(src, host_tgt), InvalidArgument);
  // A refused CUDA sample does not tie the fitter to CUDA: CPU samples still go in ...
  fitter.add(host_src, host_tgt);
  EXPECT_EQ(fitter.train_tokens() + fitter.holdout_tokens(), tokens);
  // ... and then CUDA samples are refused as a mix, before any device is looked at.
  try {
    fitter.add(src, tgt);
    ADD_FAILURE() << "no exception";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("one device"), std::string::npos) << e.what();
  }
  EXPECT_EQ(fitter.train_tokens() + fitter.holdout_tokens(), tokens);
}

}  // namespace
}  // namespace kvbridge
