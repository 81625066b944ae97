// Inputs the fuzz targets (tests/fuzz) once failed on, kept in tests/fuzz/corpus/<target>/
// as crash-*: each must now be rejected the documented way.
#include <gtest/gtest.h>

#include "kvbridge/adapter.h"
#include "kvbridge/error.h"

namespace kvbridge {
namespace {

const std::string kCorpus = KVBRIDGE_FUZZ_CORPUS;

// A self-consistent source spec (its fingerprint matches) with head_dim 2^40: load sized its
// RoPE table from it before checking any tensor and threw std::bad_alloc (an ASan abort in the
// fuzzer) instead of Corrupt.
TEST(FuzzRegressions, AdapterFileWithAHugeHeadDimIsCorrupt) {
  EXPECT_THROW(LinearAdapter::load(kCorpus + "/adapter_file/crash-huge-head-dim.safetensors"),
               Corrupt);
  // Its unmodified seed still loads.
  EXPECT_EQ(LinearAdapter::load(kCorpus + "/adapter_file/two-to-one.safetensors")
                .source()
                .head_dim,
            4);
}

}  // namespace
}  // namespace kvbridge
