#include "src/core/xxh3.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace kvbridge::detail {
Hash128 xxh3_128(const void* data, size_t size) noexcept {
  XXH128_hash_t h = XXH3_128bits(data, size);
  return Hash128{h.low64, h.high64};
}
}  // namespace kvbridge::detail
