// XXH3 entry points compiled once per instruction set (xxh3.cpp: the baseline, xxh3_avx2.cpp:
// AVX2, xxh3_avx512.cpp: AVX-512F); xxh3.cpp picks one at run time. Every variant computes the
// same digests.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvbridge/hash128.h"

namespace kvbridge::detail {
struct Xxh3Impl {
  Hash128 (*hash128)(const void* data, size_t size);
  void (*reset)(void* state);
  void (*update)(void* state, const void* data, size_t size);
  Hash128 (*digest)(const void* state);
};
/// The AVX2 build, or nullptr where it was not compiled.
const Xxh3Impl* xxh3_avx2_impl();
/// The AVX-512F build, or nullptr where it was not compiled.
const Xxh3Impl* xxh3_avx512_impl();
}  // namespace kvbridge::detail
