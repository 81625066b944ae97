#include "src/core/xxh3.h"

#include <new>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace kvbridge::detail {
Hash128 xxh3_128(const void* data, size_t size) noexcept {
  XXH128_hash_t h = XXH3_128bits(data, size);
  return Hash128{h.low64, h.high64};
}

uint64_t xxh3_64(const void* data, size_t size, uint64_t seed) noexcept {
  return XXH3_64bits_withSeed(data, size, seed);
}

Xxh3Stream::Xxh3Stream() : state_(XXH3_createState()) {
  if (!state_) throw std::bad_alloc();
  reset();
}
Xxh3Stream::~Xxh3Stream() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }
void Xxh3Stream::reset() noexcept { XXH3_128bits_reset(static_cast<XXH3_state_t*>(state_)); }
void Xxh3Stream::update(const void* data, size_t size) noexcept {
  XXH3_128bits_update(static_cast<XXH3_state_t*>(state_), data, size);
}
Hash128 Xxh3Stream::digest() const noexcept {
  XXH128_hash_t h = XXH3_128bits_digest(static_cast<const XXH3_state_t*>(state_));
  return Hash128{h.low64, h.high64};
}
}  // namespace kvbridge::detail
