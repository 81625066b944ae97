// What the store's lower tiers (disk, Redis) share: counters and the description of the entry a
// lookup requires.
#pragma once

#include <atomic>
#include <cstdint>

#include "kvbridge/kv_store.h"
#include "src/store/entry_codec.h"

namespace kvbridge::detail {

#define KVBRIDGE_STATS_ATOMIC_(type, member, metric, kind, help) std::atomic<int64_t> member{0};
#define KVBRIDGE_STATS_LOAD_(type, member, metric, kind, help) \
  s->member = member.load(std::memory_order_relaxed);

/// TierStats' counted fields (KVBRIDGE_TIER_COUNTERS), as atomics.
struct TierCounters {
  KVBRIDGE_TIER_COUNTERS(KVBRIDGE_STATS_ATOMIC_)

  static void add(std::atomic<int64_t>& c, int64_t n = 1) {
    c.fetch_add(n, std::memory_order_relaxed);
  }
  void fill(TierStats* s) const { KVBRIDGE_TIER_COUNTERS(KVBRIDGE_STATS_LOAD_) }
};

/// What a verified hit reports besides its payload.
struct LoadedMeta {
  int64_t created_ms = 0;
  EntryProvenance provenance;
  static LoadedMeta of(const EntryHeader& h) { return {h.created_ms, h.provenance}; }
};

enum class LoadResult {
  kHit,        // payload filled, verified
  kMiss,       // absent, expired, corrupt or unreadable (each counted by the tier)
  kCollision,  // a valid entry for this key, but of other tokens / parent / salt
};

/// Counts what verify_entry found (anything but kUnreadable, which each tier counts by its
/// cause) and gives the lookup's result: a collision and each reason for a miss count a miss;
/// corrupt and expired entries also count by reason; every entry read whole whose checksum held
/// adds its `total_bytes` to bytes_read.
inline LoadResult count_check(EntryCheck r, size_t total_bytes, TierCounters& c) {
  if (r != EntryCheck::kCorrupt) TierCounters::add(c.bytes_read, static_cast<int64_t>(total_bytes));
  if (r == EntryCheck::kValid) return LoadResult::kHit;
  TierCounters::add(c.misses);
  if (r == EntryCheck::kOtherChunk) return LoadResult::kCollision;
  TierCounters::add(r == EntryCheck::kExpired ? c.expired : c.corrupt);
  return LoadResult::kMiss;
}

}  // namespace kvbridge::detail
