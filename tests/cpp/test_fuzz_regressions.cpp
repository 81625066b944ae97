// Inputs the fuzz targets (tests/fuzz) once failed on, kept in tests/fuzz/corpus/<target>/
// as crash-*: each must now be rejected the documented way.
#include <gtest/gtest.h>

#include <string>

#include "kvbridge/adapter.h"
#include "kvbridge/error.h"

namespace kvbridge {
namespace {

const std::string kCorpus = KVBRIDGE_FUZZ_CORPUS;

// A self-consistent source spec (its fingerprint matches) with head_dim 2^40: load sized its
// RoPE table from it before checking any tensor and threw std::bad_alloc (an ASan abort in the
// fuzzer) instead of Corrupt. The file carries a valid checksum, so load gets to the spec.
TEST(FuzzRegressions, AdapterFileWithAHugeHeadDimIsCorrupt) {
  try {
    LinearAdapter::load(kCorpus + "/adapter_file/crash-huge-head-dim.safetensors");
    FAIL() << "loaded";
  } catch (const Corrupt& e) {
    EXPECT_NE(std::string(e.what()).find("head_dim"), std::string::npos) << e.what();
  }
  // Its unmodified seed still loads.
  EXPECT_EQ(LinearAdapter::load(kCorpus + "/adapter_file/two-to-one.safetensors")
                .source()
                .head_dim,
            4);
  // Its copy without a checksum needs the opt-in.
  const std::string unchecked = kCorpus + "/adapter_file/two-to-one-unchecked.safetensors";
  EXPECT_THROW(LinearAdapter::load(unchecked), Corrupt);
  AdapterLoadOptions options;
  options.allow_unchecked = true;
  EXPECT_EQ(LinearAdapter::load(unchecked, options).fingerprint(),
            LinearAdapter::load(kCorpus + "/adapter_file/two-to-one.safetensors").fingerprint());
}

// The per-layer attention seed (no checksum, like the fuzzer's inputs) loads with its entries.
TEST(FuzzRegressions, LayeredSeedLoads) {
  AdapterLoadOptions options;
  options.allow_unchecked = true;
  const LinearAdapter a =
      LinearAdapter::load(kCorpus + "/adapter_file/layered-unchecked.safetensors", options);
  ASSERT_EQ(a.source().layer_attention.size(), 2u);
  EXPECT_EQ(a.source().layer_attention[0].sliding_window, 8);
  EXPECT_EQ(a.source().layer_attention[1].rope_base, 1e6);
  EXPECT_EQ(a.target().layer(0).rope_base, 5e5);
}

}  // namespace
}  // namespace kvbridge
