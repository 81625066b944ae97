#include "src/core/xxh3.h"

#include <cstring>
#include <new>

#include "src/core/xxh3_impl.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace kvbridge::detail {
namespace {

Hash128 base_hash128(const void* data, size_t size) {
  const XXH128_hash_t h = XXH3_128bits(data, size);
  return Hash128{h.low64, h.high64};
}
void base_reset(void* s) { XXH3_128bits_reset(static_cast<XXH3_state_t*>(s)); }
void base_update(void* s, const void* data, size_t size) {
  XXH3_128bits_update(static_cast<XXH3_state_t*>(s), data, size);
}
Hash128 base_digest(const void* s) {
  const XXH128_hash_t h = XXH3_128bits_digest(static_cast<const XXH3_state_t*>(s));
  return Hash128{h.low64, h.high64};
}
const Xxh3Impl kBase{base_hash128, base_reset, base_update, base_digest};

// The one dispatch point: chosen once, on first use.
const Xxh3Impl& impl() {
  static const Xxh3Impl* chosen = [] {
#if defined(__x86_64__) || defined(__i386__)
    // __builtin_cpu_supports also checks that the OS saves the wider registers (XCR0).
    if (const Xxh3Impl* avx512 = xxh3_avx512_impl()) {
      if (__builtin_cpu_supports("avx512f")) return avx512;
    }
    if (const Xxh3Impl* avx2 = xxh3_avx2_impl()) {
      if (__builtin_cpu_supports("avx2")) return avx2;
    }
#endif
    return &kBase;
  }();
  return *chosen;
}

}  // namespace

Hash128 xxh3_128(const void* data, size_t size) noexcept { return impl().hash128(data, size); }

void xxh3_128_chain16(Hash128 previous, const uint32_t* ids, size_t n, Hash128* out) noexcept {
  uint64_t low = previous.low, high = previous.high;
  for (size_t i = 0; i < n; ++i) {
    unsigned char buf[16 + 4 * 16];
    std::memcpy(buf, &low, 8);
    std::memcpy(buf + 8, &high, 8);
    std::memcpy(buf + 16, ids + 16 * i, 4 * 16);
    const XXH128_hash_t h = XXH3_128bits(buf, sizeof buf);  // short input: no SIMD build
    out[i] = Hash128{h.low64, h.high64};
    low = h.low64;
    high = h.high64;
  }
}

Xxh3Stream::Xxh3Stream() : state_(XXH3_createState()) {
  if (!state_) throw std::bad_alloc();
  reset();
}
Xxh3Stream::~Xxh3Stream() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }
void Xxh3Stream::reset() noexcept { impl().reset(state_); }
void Xxh3Stream::update(const void* data, size_t size) noexcept {
  impl().update(state_, data, size);
}
Hash128 Xxh3Stream::digest() const noexcept { return impl().digest(state_); }
}  // namespace kvbridge::detail
