// MemoryTier::pin_prefix (runs of chunks pinned under one lock per shard) against the per-chunk
// probe() it replaces in KVStore::match: two tiers get the same seeded random operations
// (puts of chained prompts sharing prefixes, forged collisions, erases, invalidations, clears,
// evictions under a small budget, TTL expiry, pins held across operations), one answering
// lookups with pin_prefix in runs of random length, the other with a probe per chunk. Every
// lookup must pin the same entries and stop at the same chunk for the same reason, and the two
// tiers must stay identical (contents, stats, and hence eviction order).
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <random>
#include <tuple>
#include <vector>

#include "kvbridge/error.h"
#include "kvbridge/prefix_hash.h"
#include "src/store/memory_tier.h"

namespace kvbridge::detail {
namespace {

using Pins = std::vector<std::shared_ptr<const ChunkEntry>>;

struct Prompt {
  std::vector<uint32_t> ids;
  std::vector<Hash128> keys;  // keys[c]: chain hash of chunk c
};

// (shards, chunk tokens, eviction policy)
class PinPrefix : public ::testing::TestWithParam<std::tuple<int, int, EvictionPolicy>> {};

TEST_P(PinPrefix, MatchesPerChunkProbesUnderRandomOperations) {
  const auto [shards, chunk, policy] = GetParam();
  StoreOptions options;
  options.num_shards = shards;
  options.eviction = policy;
  options.ttl_seconds = 3;
  ChunkShape shape;
  shape.salt = Hash128{0x1234567890abcdefULL, 0x0fedcba987654321ULL};
  shape.geometry.layers = 1;
  shape.geometry.chunk = chunk;
  shape.geometry.kv_heads = 1;
  shape.geometry.head_dim = 4;
  shape.geometry.payload_bytes = 64;
  const int64_t per_entry = static_cast<int64_t>(allocation_size(64)) + 4 * chunk +
                            StoreStats::kEntryOverheadBytes;
  options.capacity_bytes = 60 * per_entry;  // room for about a third of what is put
  MemoryTier batched(options), single(options);

  std::mt19937_64 rng(1000 * shards + chunk + 7 * static_cast<int>(policy));
  auto below = [&](uint64_t n) { return static_cast<size_t>(rng() % n); };
  // Prompts of 1-40 chunks; most extend an earlier one, so chains share prefixes.
  std::vector<Prompt> prompts;
  for (int p = 0; p < 24; ++p) {
    Prompt pr;
    const size_t chunks = 1 + below(40);
    if (!prompts.empty() && below(3) != 0) {
      const Prompt& base = prompts[below(prompts.size())];
      pr.ids.assign(base.ids.begin(),
                    base.ids.begin() + static_cast<std::ptrdiff_t>(below(base.keys.size() + 1) *
                                                                  static_cast<size_t>(chunk)));
    }
    while (pr.ids.size() < chunks * static_cast<size_t>(chunk))
      pr.ids.push_back(static_cast<uint32_t>(rng()));
    Hash128 h = shape.salt;
    for (size_t c = 0; c < chunks; ++c) {
      h = chain_hash(h, pr.ids.data() + c * static_cast<size_t>(chunk), chunk);
      pr.keys.push_back(h);
    }
    prompts.push_back(std::move(pr));
  }
  auto parent_of = [&](const Prompt& pr, size_t c) { return c == 0 ? shape.salt : pr.keys[c - 1]; };
  auto ids_of = [&](const Prompt& pr, size_t c) {
    return pr.ids.data() + c * static_cast<size_t>(chunk);
  };

  int64_t now = 1'000'000;
  Pins held_batched, held_single;  // pins kept across operations (unevictable meanwhile)
  int64_t lookups = 0, hits = 0, long_runs = 0, collisions = 0;
  auto same_stats = [&](const char* after) {
    StoreStats a, b;
    batched.fill(&a);
    single.fill(&b);
    ASSERT_EQ(a.entries, b.entries) << after;
    ASSERT_EQ(a.bytes_used, b.bytes_used) << after;
    ASSERT_EQ(a.evictions, b.evictions) << after;
    ASSERT_EQ(a.memory.expired, b.memory.expired) << after;
    ASSERT_EQ(a.memory.writes, b.memory.writes) << after;
  };

  for (int op = 0; op < 6000; ++op) {
    const Prompt& pr = prompts[below(prompts.size())];
    const size_t kind = below(100);
    if (kind < 35) {  // put a prefix of the prompt, one chunk at a time as KVStore::put does
      const size_t upto = 1 + below(pr.keys.size());
      for (size_t c = 0; c < upto; ++c) {
        // A forged collision now and then: another chunk's ids under this key.
        const bool forge = below(50) == 0;
        std::vector<uint32_t> ids(ids_of(pr, c), ids_of(pr, c) + chunk);
        if (forge) ids[below(ids.size())] ^= 1;
        for (MemoryTier* tier : {&batched, &single}) {
          std::shared_ptr<const ChunkEntry> pin;
          if (tier->probe(pr.keys[c], shape.salt, parent_of(pr, c), ids.data(), now, &pin) !=
              MemoryTier::Probe::kAbsent)
            continue;
          auto fresh = tier->new_entry(shape, parent_of(pr, c), ids.data(), now);
          if (!fresh) continue;
          bool inserted = false;
          tier->insert(pr.keys[c], std::move(fresh), now, &pin, &inserted);
        }
      }
    } else if (kind < 80) {  // look a prefix up
      const size_t upto = 1 + below(pr.keys.size());
      Pins got_batched, got_single;
      MemoryTier::Probe stop_batched = MemoryTier::Probe::kSame;
      for (size_t c = 0; c < upto;) {  // runs of random length, as long as they all hit
        const size_t n = std::min(upto - c, 1 + below(MemoryTier::kMaxPrefixRun));
        const MemoryTier::PrefixRun run = batched.pin_prefix(
            pr.keys.data() + c, n, shape.salt, parent_of(pr, c), ids_of(pr, c), chunk, now,
            &got_batched);
        ASSERT_LE(run.hits, n);
        ASSERT_EQ(got_batched.size(), c + run.hits);
        c += run.hits;
        if (run.hits < n) {
          stop_batched = run.stop;
          ASSERT_NE(stop_batched, MemoryTier::Probe::kSame);
          break;
        }
      }
      MemoryTier::Probe stop_single = MemoryTier::Probe::kSame;
      for (size_t c = 0; c < upto; ++c) {
        std::shared_ptr<const ChunkEntry> pin;
        stop_single = single.probe(pr.keys[c], shape.salt, parent_of(pr, c), ids_of(pr, c), now,
                                   &pin);
        if (stop_single != MemoryTier::Probe::kSame) break;
        got_single.push_back(std::move(pin));
      }
      ASSERT_EQ(stop_batched, stop_single) << "op " << op;
      ASSERT_EQ(got_batched.size(), got_single.size()) << "op " << op;
      for (size_t c = 0; c < got_batched.size(); ++c) {
        ASSERT_TRUE(got_batched[c]->same_chunk(shape.salt, parent_of(pr, c), ids_of(pr, c)));
        ASSERT_NE(got_batched[c], got_single[c]);  // two tiers, two entries
      }
      ++lookups;
      hits += static_cast<int64_t>(got_batched.size());
      long_runs += got_batched.size() >= 8;
      collisions += stop_batched == MemoryTier::Probe::kCollision;
      if (below(5) == 0) {  // keep these pinned for a while
        held_batched = std::move(got_batched);
        held_single = std::move(got_single);
      }
    } else if (kind < 88) {  // erase one chunk
      const size_t c = below(pr.keys.size());
      const bool a = batched.erase(pr.keys[c], shape.salt, parent_of(pr, c), ids_of(pr, c));
      const bool b = single.erase(pr.keys[c], shape.salt, parent_of(pr, c), ids_of(pr, c));
      ASSERT_EQ(a, b);
    } else if (kind < 92) {  // invalidate a random subset
      const uint32_t salt_bit = static_cast<uint32_t>(below(4));
      auto doomed = [&](const ChunkEntry& e) { return (e.tokens.data()[0] & 3) == salt_bit; };
      ASSERT_EQ(batched.erase_if(doomed), single.erase_if(doomed));
    } else if (kind < 93) {
      ASSERT_EQ(batched.clear(), single.clear());
    } else if (kind < 98) {
      now += static_cast<int64_t>(below(1500));  // entries expire after 3 s
    } else {
      held_batched.clear();
      held_single.clear();
    }
    same_stats("an operation");
    if (::testing::Test::HasFatalFailure()) return;
  }
  for (const Prompt& pr : prompts)
    for (const Hash128& k : pr.keys) ASSERT_EQ(batched.contains(k), single.contains(k));
  // The operations reached every case.
  StoreStats st;
  batched.fill(&st);
  EXPECT_GT(lookups, 1000);
  EXPECT_GT(hits, 2000);
  EXPECT_GT(long_runs, 40);
  EXPECT_GT(collisions, 0);
  EXPECT_GT(st.evictions, 0);
  EXPECT_GT(st.memory.expired, 0);
}

INSTANTIATE_TEST_SUITE_P(
    ShardsChunksPolicies, PinPrefix,
    ::testing::Values(std::make_tuple(1, 16, EvictionPolicy::kLRU),
                      std::make_tuple(3, 16, EvictionPolicy::kLRU),
                      std::make_tuple(16, 16, EvictionPolicy::kLFU),
                      std::make_tuple(16, 1, EvictionPolicy::kLRU),
                      std::make_tuple(7, 17, EvictionPolicy::kTTL),  // ids on the heap
                      std::make_tuple(1024, 5, EvictionPolicy::kLRU)));

TEST(PinPrefix, RefusesRunsLongerThanItsLimit) {
  StoreOptions options;
  MemoryTier tier(options);
  std::vector<Hash128> keys(MemoryTier::kMaxPrefixRun + 1);
  std::vector<uint32_t> ids(keys.size() * 16, 1);
  Pins pins;
  EXPECT_THROW(tier.pin_prefix(keys.data(), keys.size(), Hash128{}, Hash128{}, ids.data(), 16, 0,
                               &pins),
               ::kvbridge::InvalidArgument);
}

}  // namespace
}  // namespace kvbridge::detail
