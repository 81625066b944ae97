// The AVX2 build of XXH3 (this file is compiled with -mavx2 on x86-64; xxh3.cpp only calls it
// when the CPU has AVX2). About 1.7x the SSE2 build's speed on long inputs.
#include "src/core/xxh3_impl.h"

#if defined(__AVX2__)
#define KVBRIDGE_XXH3_VARIANT xxh3_avx2_impl
#include "src/core/xxh3_variant.inc"
#else
namespace kvbridge::detail {
const Xxh3Impl* xxh3_avx2_impl() { return nullptr; }
}  // namespace kvbridge::detail
#endif
