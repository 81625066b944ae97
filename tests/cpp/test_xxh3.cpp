// The dispatched XXH3 (AVX-512 or AVX2 where the CPU has it), its streaming form and each
// instruction-set build against xxHash's own baseline build, on seeded random data of odd sizes
// at odd offsets.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "src/core/byte_order.h"
#include "src/core/xxh3.h"
#include "src/core/xxh3_impl.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace kvbridge {
namespace {

Hash128 reference(const unsigned char* p, size_t n) {
  const XXH128_hash_t h = XXH3_128bits(p, n);  // this file is built for the baseline ISA
  return Hash128{h.low64, h.high64};
}

TEST(Xxh3, DispatchedAndStreamingMatchTheBaseline) {
  std::mt19937_64 rng(3);
  std::vector<unsigned char> buf((size_t{1} << 20) + 4096);
  for (auto& b : buf) b = static_cast<unsigned char>(rng());
  std::vector<size_t> sizes = {0, 1, 3, 16, 17, 128, 129, 240, 241, 1023, 1024, 1025, 4099,
                               65537, (size_t{1} << 20) + 7};
  for (int i = 0; i < 20; ++i) sizes.push_back(rng() % 300000);
  const detail::Xxh3Impl* avx2 = detail::xxh3_avx2_impl();
  const bool has_avx2 = avx2 && __builtin_cpu_supports("avx2");
  const detail::Xxh3Impl* avx512 = detail::xxh3_avx512_impl();
  const bool has_avx512 = avx512 && __builtin_cpu_supports("avx512f");
  for (size_t n : sizes) {
    const size_t offset = rng() % 61;  // unaligned starts
    const unsigned char* p = buf.data() + offset;
    const Hash128 want = reference(p, n);
    EXPECT_EQ(detail::xxh3_128(p, n), want) << n;
    detail::Xxh3Stream s;
    for (size_t done = 0; done < n;) {  // random piece boundaries
      const size_t piece = std::min(n - done, 1 + rng() % 70000);
      s.update(p + done, piece);
      done += piece;
    }
    EXPECT_EQ(s.digest(), want) << n;
    if (has_avx2) EXPECT_EQ(avx2->hash128(p, n), want) << n;
    if (has_avx512) {
      EXPECT_EQ(avx512->hash128(p, n), want) << n;
      alignas(64) unsigned char state[1024];  // an XXH3_state_t, driven through the build
      static_assert(sizeof(XXH3_state_t) <= sizeof(state));
      avx512->reset(state);
      for (size_t done = 0; done < n;) {
        const size_t piece = std::min(n - done, 1 + rng() % 70000);
        avx512->update(state, p + done, piece);
        done += piece;
      }
      EXPECT_EQ(avx512->digest(state), want) << n;
    }
  }
  if (!has_avx2 || !has_avx512)
    GTEST_SKIP() << "no AVX2 or AVX-512 build or CPU: not every build was compared";
}

}  // namespace
}  // namespace kvbridge

namespace kvbridge {
namespace {

// The inlined chain over 16-id chunks against xxh3_128 of each step's 80-byte buffer built by
// hand (previous key's halves little-endian, then the ids), on seeded random keys and ids.
TEST(Xxh3, Chain16MatchesHashOfEachBuffer) {
  if (!detail::kLittleEndianHost) GTEST_SKIP() << "the 16-id chain is used on little-endian hosts";
  std::mt19937_64 rng(16);
  for (size_t n : {size_t{1}, size_t{2}, size_t{7}, size_t{33}}) {
    std::vector<uint32_t> ids(16 * n);
    for (auto& id : ids) id = static_cast<uint32_t>(rng());
    const Hash128 first{rng(), rng()};
    std::vector<Hash128> got(n);
    detail::xxh3_128_chain16(first, ids.data(), n, got.data());
    Hash128 previous = first;
    for (size_t i = 0; i < n; ++i) {
      unsigned char buf[80];
      for (int b = 0; b < 8; ++b) {
        buf[b] = static_cast<unsigned char>(previous.low >> (8 * b));
        buf[8 + b] = static_cast<unsigned char>(previous.high >> (8 * b));
      }
      for (int t = 0; t < 16; ++t)
        for (int b = 0; b < 4; ++b)
          buf[16 + 4 * t + b] = static_cast<unsigned char>(ids[16 * i + t] >> (8 * b));
      const Hash128 want = reference(buf, sizeof buf);
      ASSERT_EQ(got[i], want) << "n " << n << ", step " << i;
      previous = want;
    }
  }
}

}  // namespace
}  // namespace kvbridge
