// The one place that includes xxHash (inlined, so neither the library nor its users link it).
// Long inputs use the AVX-512 or AVX2 build where the CPU has it (xxh3_impl.h); digests are
// the same.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvbridge/hash128.h"

namespace kvbridge::detail {
Hash128 xxh3_128(const void* data, size_t size) noexcept;

/// The chain over 16-id chunks on a little-endian host: out[i] = xxh3_128 of the 80 bytes
/// (out[i - 1].low, out[i - 1].high as little-endian u64, then ids[16 i, 16 i + 16) as they lie
/// in memory), out[-1] = previous. The same digests as xxh3_128 over such a buffer; the hash is
/// inlined for its one length, so the running key goes from one step to the next in registers.
void xxh3_128_chain16(Hash128 previous, const uint32_t* ids, size_t n, Hash128* out) noexcept;

/// Incremental XXH3-128 (seed 0): update() over consecutive pieces gives the same digest as
/// xxh3_128 over their concatenation. Not copyable.
class Xxh3Stream {
 public:
  Xxh3Stream();
  ~Xxh3Stream();
  Xxh3Stream(const Xxh3Stream&) = delete;
  Xxh3Stream& operator=(const Xxh3Stream&) = delete;
  void reset() noexcept;
  void update(const void* data, size_t size) noexcept;
  Hash128 digest() const noexcept;

 private:
  void* state_;  // XXH3_state_t, 64-byte aligned, owned
};
}  // namespace kvbridge::detail
