// The store's lower tiers (disk, Redis): the LowerTier interface KVStore walks, their counters,
// and how a lookup describes the entry it requires.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

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

/// The most lower tiers a store may have (each keeps a word in every memory entry): the disk and
/// Redis tiers, and room for two more.
constexpr size_t kMaxLowerTiers = 4;

/// What a verified hit reports besides its payload.
struct LoadedMeta {
  int64_t created_ms = 0;
  EntryProvenance provenance;
  /// The loading tier's mark for the new memory entry (ChunkEntry::tier_marks); -1: none.
  int64_t mark = -1;
  static LoadedMeta of(const EntryHeader& h) { return {h.created_ms, h.provenance, -1}; }
};

enum class LoadResult {
  kHit,        // payload filled, verified
  kMiss,       // absent, expired, corrupt or unreadable (each counted by the tier)
  kCollision,  // a valid entry for this key, but of other tokens / parent / salt
  kNoRoom,     // the tier has the entry, but memory has no room for it (the store counts it)
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

struct ChunkEntry;  // memory_tier.h (which includes this header)
class LowerTier;

/// One match() call's chain as the store walks it, for the tiers: chunk c's key, the entry it
/// must be, and the buffer its payload goes to. Keys are hashed on demand (a miss stops the walk
/// early); a tier may look at chunks after c to read them in the same round trip.
class ChainLookup {
 public:
  virtual std::string_view ns() const = 0;
  virtual const Fingerprint& fingerprint() const = 0;
  virtual size_t chunks() const = 0;
  virtual const Hash128& key(size_t c) = 0;
  /// What chunk c's stored entry must agree with (verify_entry).
  virtual ExpectedEntry expected(size_t c) = 0;
  /// Whether memory or a tier the store walks before `tier` holds chunk c (a tier reading ahead
  /// stops there).
  virtual bool held_above(size_t c, const LowerTier& tier) = 0;
  /// Chunk c's payload buffer (expected(c).geometry.payload_bytes, the same one until
  /// discard(c)), which becomes its memory entry when a tier's load() of c is a hit; null when
  /// memory has no room.
  virtual char* payload(size_t c) = 0;
  /// Frees chunk c's buffer (what was read into it is not the entry).
  virtual void discard(size_t c) = 0;

 protected:
  ~ChainLookup() = default;
};

/// The encoded header + tokens and the checksum of a chunk, made once for every tier it goes to.
struct PackedEntry {
  std::vector<unsigned char> prefix;
  Hash128 checksum;
};

/// A tier below memory (disk, Redis). KVStore keeps them in the order it walks them: a lookup
/// asks each in turn until one has the chunk; a put offers each chunk to every tier that wants
/// it. docs/architecture.md says what a new tier needs besides this class.
class LowerTier {
 public:
  virtual ~LowerTier() = default;

  /// The tier's index in the store's walk, given when the store adds it (< kMaxLowerTiers): its
  /// word in each memory entry is ChunkEntry::tier_marks[slot()].
  size_t slot() const noexcept { return slot_; }
  void set_slot(size_t slot) noexcept { slot_ = slot; }

  /// The tier's name (its Prometheus `tier` label) and its bit in erase()'s and clear()'s masks.
  virtual const char* name() const = 0;
  virtual StoreTier mask_bit() const = 0;
  virtual TierCounters& counters() = 0;
  /// Writes its section of the stats (counters, gauges, whether it is enabled).
  virtual void fill(StoreStats* s) const = 0;

  /// Whether the tier holds fp's entry of key, as far as it can tell without a round trip
  /// (a remote tier answers false).
  virtual bool contains(const Hash128& key, const Fingerprint& fp) = 0;

  /// This lookup's state of the tier (read-ahead, connections), kept by the store from chunk to
  /// chunk of one match() call.
  struct LookupState {
    virtual ~LookupState() = default;
  };
  /// Reads chunk c into chain.payload(c) and verifies it; on kHit also sets *meta. Counts its
  /// misses, corrupt and expired entries (never the hit: the store counts that once the entry is
  /// in memory). `state` starts empty at a call's first lookup here. Never throws.
  virtual LoadResult load(ChainLookup& chain, size_t c, std::unique_ptr<LookupState>& state,
                          LoadedMeta* meta) = 0;

  /// The write policy: whether a put should write fp's chunk `key` here. `pinned` is the chunk's
  /// memory entry, null when memory had no room.
  virtual bool wants(const Hash128& key, const Fingerprint& fp, const ChunkEntry* pinned) = 0;
  /// 0: store() is called for each chunk as the put reaches it; otherwise the put gathers
  /// writes until their bytes reach this, and once at its end.
  virtual size_t batch_bytes() const = 0;
  struct ChunkWrite {
    Hash128 key;
    const PackedEntry* packed;
    std::shared_ptr<const ChunkEntry> entry;  // the payload, creation time and provenance
  };
  /// Writes the batch; sets (*stored)[i] (sized to the batch) when write i is in the tier.
  /// Counts its failures; never throws.
  virtual void store(std::string_view ns, const Fingerprint& fp,
                     const std::vector<ChunkWrite>& batch, std::vector<char>* stored) = 0;

  /// Removes ns's entries of `keys` (fp's); returns how many it knows it removed.
  virtual int64_t erase(std::string_view ns, const Fingerprint& fp,
                        const std::vector<Hash128>& keys) = 0;
  /// Remove every entry of the model fingerprint (of any namespace, whichever store wrote it),
  /// or only those whose provenance names `adapter`; each sets its own fields of *r.
  virtual void invalidate(const Fingerprint& fp, InvalidateResult* r) = 0;
  virtual void invalidate_adapter(const Fingerprint& fp, const Fingerprint& adapter,
                                  InvalidateResult* r) = 0;
  /// Removes every entry; returns how many it removed.
  virtual int64_t clear() = 0;

 private:
  size_t slot_ = 0;
};

}  // namespace kvbridge::detail
